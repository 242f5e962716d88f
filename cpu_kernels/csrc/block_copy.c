/* Copies between a shared prefix's blocks and a session's buffers (cpu_kernels/block_copy.py). */
#include "kvsnap.h"

/* Consecutive blocks of a shared prefix into a new session's buffers: part p (a layer's keys
   or values) takes blocks first[p] .. B-1, block b's part at src[b * P + p] ([Hkv, T, D]
   values, contiguous), to rows (b - first[p]) * T on of its buffer dst[p] ([Hkv, cap[p], D]). */
void gather_blocks(long B, long P, long T, long Hkv, long D, const long *src, uint16_t **dst, const long *first,
                   const long *cap, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < P; p++)
        for (long b = first[p]; b < B; b++)
            for (long h = 0; h < Hkv; h++)
                memcpy(dst[p] + (h * cap[p] + (b - first[p]) * T) * D, (const uint16_t *)src[b * P + p] + h * T * D,
                       sizeof(uint16_t) * T * D);
}

/* The rows just appended to a session's layers into new blocks: part p (rows from src[p] on,
   its heads hs[p] values apart, rows of D) gives rows b * T .. (b + 1) * T - 1 to block b, whose
   parts are contiguous at dst[b] ([P, Hkv, T, D]). */
void scatter_blocks(long B, long P, long T, long Hkv, long D, const long *src, const long *hs, uint16_t **dst,
                    int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < P; p++)
        for (long b = 0; b < B; b++)
            for (long h = 0; h < Hkv; h++)
                memcpy(dst[b] + (p * Hkv + h) * T * D, (const uint16_t *)src[p] + h * hs[p] + b * T * D,
                       sizeof(uint16_t) * T * D);
}

/* Rows pos[h * R + r] of a layer's keys or values whose first `shared` rows lie in blocks of bs
   rows (block b's part at blocks[b], its heads bs * D values apart) and the rest at own (heads hs
   apart), to dst ([Hkv, R, D] contiguous): a selection kept from shared and own rows at once. */
void gather_rows(long R, long Hkv, long D, const long *blocks, long shared, long bs, const uint16_t *own, long hs,
                 const long *pos, uint16_t *dst, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long h = 0; h < Hkv; h++)
        for (long r = 0; r < R; r++) {
            long p = pos[h * R + r];
            const uint16_t *src = p < shared ? (const uint16_t *)blocks[p / bs] + (h * bs + p % bs) * D
                                             : own + h * hs + (p - shared) * D;
            memcpy(dst + (h * R + r) * D, src, sizeof(uint16_t) * D);
        }
}
