/* Whether the compiler links OpenMP (cpu_kernels/build.py asks once). */
#include <omp.h>

int kvsnap_threads(void) { return omp_get_max_threads(); }
