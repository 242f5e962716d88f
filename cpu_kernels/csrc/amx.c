/* The AMX tile state, asked of Linux once per process before any tile instruction (kvsnap.h). */
#include "kvsnap.h"

#include <sys/syscall.h>
#include <unistd.h>

int kvsnap_amx_init(void) {
#if KVSNAP_TILES
    return syscall(SYS_arch_prctl, 0x1023, 18) ? -1 : 0;
#else
    return -1; /* not compiled for tiles */
#endif
}
