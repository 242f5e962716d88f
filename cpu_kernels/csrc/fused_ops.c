/* Fused element-wise ops of a decoder layer in bf16: RMS norm, gated activation, RoPE (cpu_kernels/fused_ops.py). */
#include "kvsnap.h"

/* n rows of h values (row i at x + i * stride) -> out [n, h]. gemma: 0 = Llama's, 1 = Gemma's. */
void rms_norm(long n, int h, const uint16_t *x, long stride, const uint16_t *w, float eps, int gemma,
              uint16_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if(n >= 16)
    for (long i = 0; i < n; i++) {
        const uint16_t *xi = x + i * stride;
        uint16_t *oi = out + i * (long)h;
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int j = 0; j < h; j++) { float v = bf16_to_f32(xi[j]); ss += v * v; }
        float r = 1.f / sqrtf(ss / (float)h + eps);
        if (gemma) {
            #pragma omp simd
            for (int j = 0; j < h; j++) oi[j] = f32_to_bf16(bf16_to_f32(xi[j]) * r * (1.f + bf16_to_f32(w[j])));
        } else {
            #pragma omp simd
            for (int j = 0; j < h; j++) oi[j] = f32_to_bf16(bf16_to_f32(w[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xi[j]) * r)));
        }
    }
}

/* Rotary embedding of T tokens' H query and Hkv key heads of D values (token t's head h at
   q + t*qt + h*qh, rows of D contiguous), cos / sin [T, D]: out = bf16(bf16(x * cos) +
   bf16(rotate_half(x) * sin)), transformers' three roundings, into qo [T, H, D] and ko [T, Hkv, D]. */
static void rope_heads(long T, int H, int D, const uint16_t *x, long xt, long xh, const uint16_t *cos,
                       const uint16_t *sin, uint16_t *out) {
    int half = D / 2;
    for (long t = 0; t < T; t++) {
        const uint16_t *c = cos + t * D, *s = sin + t * D;
        for (int h = 0; h < H; h++) {
            const uint16_t *xi = x + t * xt + h * xh;
            uint16_t *oi = out + (t * H + h) * (long)D;
            #pragma omp simd
            for (int j = 0; j < half; j++) {
                float a = bf16_to_f32(xi[j]), b = bf16_to_f32(xi[j + half]);
                oi[j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(a * bf16_to_f32(c[j]))) + bf16_to_f32(f32_to_bf16(-b * bf16_to_f32(s[j]))));
                oi[j + half] = f32_to_bf16(bf16_to_f32(f32_to_bf16(b * bf16_to_f32(c[j + half]))) + bf16_to_f32(f32_to_bf16(a * bf16_to_f32(s[j + half]))));
            }
        }
    }
}

void rope(long T, int H, int Hkv, int D, const uint16_t *q, long qt, long qh, const uint16_t *k, long kt, long kh,
          const uint16_t *cos, const uint16_t *sin, uint16_t *qo, uint16_t *ko) {
    rope_heads(T, H, D, q, qt, qh, cos, sin, qo);
    rope_heads(T, Hkv, D, k, kt, kh, cos, sin, ko);
}

/* out[i] = bf16(bf16(act(g[i])) * u[i]) for n values; act: 0 = SiLU, 1 = GELU (tanh) */
void act_mul(long n, const uint16_t *g, const uint16_t *u, int act, uint16_t *out, int threads) {
    long block = 4096, blocks = (n + block - 1) / block;
    #pragma omp parallel for num_threads(threads) schedule(static) if(blocks > 8)
    for (long b = 0; b < blocks; b++) {
        long end = (b + 1) * block < n ? (b + 1) * block : n;
        if (act == 0) {
            #pragma omp simd
            for (long i = b * block; i < end; i++) {
                float v = bf16_to_f32(g[i]);
                out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(v / (1.f + expf(-v)))) * bf16_to_f32(u[i]));
            }
        } else {
            #pragma omp simd
            for (long i = b * block; i < end; i++) {
                float v = bf16_to_f32(g[i]);
                float a = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
                out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(a)) * bf16_to_f32(u[i]));
            }
        }
    }
}
