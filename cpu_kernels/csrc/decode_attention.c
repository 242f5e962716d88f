/* A decode step's one-token attention over bf16 keys and values, and its new rows appended (cpu_kernels/decode_attention.py). */
#include "decode_blocks.h"

/* R rows of one token each. Row r: query q + r*H*D (float32, [H, D]); keys / values [Hkv, L[r], D]
   bf16 with head strides khs[r] / vhs[r] and rows of D contiguous values; out + r*H*D
   (float32). Query head h*G + g reads KV head h (grouped-query attention). Each (row, KV head,
   block of BLK keys) is one unit of work on one thread; the blocks of a head are joined in
   their order, so a row's result depends neither on the other rows nor on the thread count.
   Returns 0, or -1 when out of memory. */
int one_token_rows(int R, const float *q, const uint16_t **k, const uint16_t **v, const long *L,
                   const long *khs, const long *vhs, int H, int Hkv, int D, float scale,
                   float *out, int threads) {
    int G = H / Hkv;
    long *first = malloc(sizeof(long) * (R + 1));  /* the first unit of each row */
    if (!first) return -1;
    first[0] = 0;
    for (int r = 0; r < R; r++) first[r + 1] = first[r] + (long)Hkv * ((L[r] + BLK - 1) / BLK);
    long units = first[R];
    float *part = malloc(sizeof(float) * units * G * (D + 2));  /* per unit: m[G], s[G], o[G][D] */
    if (!part) { free(first); return -1; }
    #pragma omp parallel num_threads(threads)
    {
        float sc[MAXG * BLK];
        int r = 0;
        #pragma omp for schedule(static)
        for (long u = 0; u < units; u++) {
            while (first[r + 1] <= u) r++;
            while (first[r] > u) r--;
            long local = u - first[r], nb = (L[r] + BLK - 1) / BLK;
            int h = (int)(local / nb);
            long b = local % nb, l0 = b * BLK, n = L[r] - l0 < BLK ? L[r] - l0 : BLK;
            float *pu = part + u * G * (D + 2);
            block(q + ((long)r * H + h * G) * D, k[r] + h * khs[r] + l0 * D, v[r] + h * vhs[r] + l0 * D,
                  n, G, D, scale, sc, pu, pu + G, pu + 2 * G);
        }
        #pragma omp for schedule(static)
        for (long rh = 0; rh < (long)R * Hkv; rh++) {
            int rr = (int)(rh / Hkv), h = (int)(rh % Hkv);
            long nb = (L[rr] + BLK - 1) / BLK;
            join_blocks(part + (first[rr] + h * nb) * G * (D + 2), nb, G, D, out + ((long)rr * H + h * G) * D);
        }
    }
    free(part);
    free(first);
    return 0;
}

/* R one-token rows' new keys and values into their sessions' buffers: row r's KV head h is
   the D values at ks + h*hk + cols[r]*tk (vs + h*hv + cols[r]*tv), written to kd[r] + h*khs[r]
   (vd[r] + h*vhs[r]). Plain copies: a row's bits are the projection's. */
void append_rows(int R, int Hkv, int D, const uint16_t *ks, long hk, long tk, const uint16_t *vs, long hv,
                 long tv, const long *cols, uint16_t **kd, uint16_t **vd, const long *khs, const long *vhs) {
    for (int r = 0; r < R; r++)
        for (int h = 0; h < Hkv; h++) {
            memcpy(kd[r] + h * khs[r], ks + h * hk + cols[r] * tk, sizeof(uint16_t) * D);
            memcpy(vd[r] + h * vhs[r], vs + h * hv + cols[r] * tv, sizeof(uint16_t) * D);
        }
}
