/* A prompt chunk's attention (cpu_kernels/chunk_attention.py): see chunk_blocks.h. */
#include "kvsnap.h"

#if KVSNAP_BF16_VECTORS
#include "chunk_blocks.h"

/* q: [H] x [T] rows of D bf16 at strides qsh / qst (elements); k / v: [Hkv] x [L] rows of D, the
   first `shared` in blocks of bs rows (kb / vb: a block's part each), the rest at k / v with head
   strides ks / vs (rows_t); out: [T, H, D] bf16. window <= 0: no window. Nonzero without memory. */
int chunk_attention(const uint16_t *q, long qsh, long qst, const uint16_t *k, long ks, const uint16_t *v, long vs,
                    const long *kb, const long *vb, long shared, long bs,
                    long T, long L, int H, int Hkv, int D, int window, float scale, uint16_t *out, int threads) {
    const rows_t K = {k, ks, kb, shared, bs}, V = {v, vs, vb, shared, bs};
    long pair_groups = (L + 31) / 32, per_head = pair_groups * 32 * (long)D;   /* padded to 32 keys */
    uint16_t *kp = aligned_alloc(64, sizeof(uint16_t) * (per_head * Hkv + KB * D));
    uint16_t *vp = aligned_alloc(64, sizeof(uint16_t) * (per_head * Hkv + KB * D));
    if (!kp || !vp) { free(kp); free(vp); return 1; }
    long nq = (T + QB - 1) / QB, units = nq * H;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long b = 0; b < Hkv * pair_groups; b++) {
            long g = b / pair_groups, pg = b % pair_groups;
            repack_keys(&K, g, L, D, 2 * pg, kp + g * per_head);
            repack_keys(&K, g, L, D, 2 * pg + 1, kp + g * per_head);
            repack_values(&V, g, L, D, pg, vp + g * per_head);
        }
        tiles_on();
        #pragma omp for schedule(dynamic)
        for (long u = 0; u < units; u++) {
            int h = (int)(u % H);
            long t0 = (u / H) * QB;
            int rows = T - t0 < QB ? (int)(T - t0) : QB;
            long g = h / (H / Hkv);
            unit(q, qsh, qst, h, t0, rows, T, L, D, window, scale, kp + g * per_head, vp + g * per_head, out, H);
        }
        tiles_off();
    }
    free(kp);
    free(vp);
    return 0;
}

#endif
