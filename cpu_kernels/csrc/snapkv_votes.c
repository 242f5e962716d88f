/* SnapKV's votes (cpu_kernels/snapkv_votes.py), with the prompt-chunk kernel's pieces (chunk_blocks.h). */
#include "kvsnap.h"

#if KVSNAP_BF16_VECTORS
#include "chunk_blocks.h"

/* SnapKV's votes: query head h's window query i sits at row L - w + i and sees rows up to it;
   votes[h * (L - w) + j] = sum over i of its softmax weight on row j (j < L - w). q: [H] x [w]
   rows of D bf16 at strides qsh / qst; k: [Hkv] x [L] rows of D, the first `shared` in blocks of bs
   rows (kb: a block's part each), the rest at k with head stride ks (rows_t). */
int window_votes(const uint16_t *q, long qsh, long qst, const uint16_t *k, long ks, const long *kb, long shared,
                 long bs, long L, int H, int Hkv, int D, int w, float scale, float *votes, int threads) {
    const rows_t K = {k, ks, kb, shared, bs};
    const long pair_groups = (L + 31) / 32, per_head = pair_groups * 32 * (long)D, Lp = pair_groups * 32;
    const long P = L - w, nqb = (w + QB - 1) / QB, units = nqb * H;
    const int DC = D / 32;
    uint16_t *kp = aligned_alloc(64, sizeof(uint16_t) * (per_head * Hkv + KB * D));
    float *part = aligned_alloc(64, sizeof(float) * (units * P + 16));
    if (!kp || !part) { free(kp); free(part); return 1; }
    const float base2 = scale * 1.44269504f;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long b = 0; b < Hkv * pair_groups; b++) {
            long g = b / pair_groups, pg = b % pair_groups;
            repack_keys(&K, g, L, D, 2 * pg, kp + g * per_head);
            repack_keys(&K, g, L, D, 2 * pg + 1, kp + g * per_head);
        }
        tiles_on();
        __attribute__((aligned(64))) uint16_t qbuf[QB * MAXD];
        __attribute__((aligned(64))) float s[QB * KB];
        float *x = aligned_alloc(64, sizeof(float) * QB * (Lp + KB));   /* a unit's queries' scores, per thread */
        if (!x) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic)
        for (long u = 0; u < units; u++) {
            if (!x) continue;   /* every thread takes part in the loop; this one has no room to work */
            const int h = (int)(u % H);
            const long i0 = (u / H) * QB;
            const int rows = w - i0 < QB ? (int)(w - i0) : QB;
            const uint16_t *kh = kp + (h / (H / Hkv)) * per_head;
            memset(qbuf, 0, sizeof(uint16_t) * QB * D);
            for (int r = 0; r < rows; r++) memcpy(qbuf + r * D, q + h * qsh + (i0 + r) * qst, 2 * D);
            const long last = L - w + i0 + rows - 1;   /* the unit's last query's row: no key past it */
            long seen = 0;
            for (long k0 = 0; k0 <= last; k0 += KB) {
                long end = last + 1 < k0 + KB ? last + 1 : k0 + KB;
                int groups = (int)((end - k0 + 15) / 16);
                scores(qbuf, D, kh + (k0 / 16) * DC * 512, groups, rows, s);
                for (int r = 0; r < rows; r++)
                    memcpy(x + r * (Lp + KB) + k0, s + r * KB, sizeof(float) * 16 * groups);
                seen = k0 + 16 * groups;
            }
            float *mine = part + u * P;
            memset(mine, 0, sizeof(float) * P);
            for (int r = 0; r < rows; r++) {
                float *xr = x + r * (Lp + KB);
                const long pos = L - w + i0 + r;   /* this query's row: it sees 0 .. pos */
                for (long j = pos + 1; j < seen; j++) xr[j] = NEG;
                __m512 best = _mm512_set1_ps(NEG);
                for (long j = 0; j < seen; j += 16) best = _mm512_max_ps(best, _mm512_load_ps(xr + j));
                const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(best) * base2), b2 = _mm512_set1_ps(base2);
                __m512 sum = _mm512_setzero_ps();
                for (long j = 0; j < seen; j += 16) {
                    __m512 e = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(xr + j), b2, shift));
                    _mm512_store_ps(xr + j, e);
                    sum = _mm512_add_ps(sum, e);
                }
                const float inv = 1.f / _mm512_reduce_add_ps(sum);
                for (long j = 0; j < P; j++) mine[j] += xr[j] * inv;
            }
        }
        free(x);
        tiles_off();
    }
    for (int h = 0; h < H; h++) {   /* each head's units in order: the same sums on any thread count */
        float *out = votes + (long)h * P;
        memcpy(out, part + (long)h * P, sizeof(float) * P);
        for (long b = 1; b < nqb; b++) {
            const float *add = part + (b * H + h) * P;
            for (long j = 0; j < P; j++) out[j] += add[j];
        }
    }
    free(kp);
    free(part);
    return failed;
}

#endif
