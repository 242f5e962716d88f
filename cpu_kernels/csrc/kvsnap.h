/* What every kernel shares: bf16 <-> float32, the ISA a variant was compiled for, the AMX permission.
   bf16 is carried as uint16_t (its bits); a kernel widens it to float32 in registers. */
#ifndef KVSNAP_H
#define KVSNAP_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The variant (cpu_kernels/build.py): tiles with AMX, vectors with AVX-512 BF16, else plain C. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSNAP_TILES 1
#else
#define KVSNAP_TILES 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSNAP_BF16_VECTORS 1
#else
#define KVSNAP_BF16_VECTORS 0
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bf16, round to nearest even (torch's c10::BFloat16), NaN kept a quiet NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Ask Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): 0 when granted.
   Defined in every variant (amx.c); only the amx variant calls it. */
int kvsnap_amx_init(void);

#endif
