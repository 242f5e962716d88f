"""RMSNorm, the MLP's gated activation and RoPE of bf16 CPU models in one pass each, in C.

transformers' ``LlamaRMSNorm`` runs eight operators over its input (a float32 copy, square,
mean, add, rsqrt, multiply, a bf16 copy, the weight), ``Gemma3RMSNorm`` six, and a gated MLP
two (``act(gate) * up``): each a pass over memory and, in a decode step, each a few
microseconds of dispatch, 61 norms and 30 MLPs a SmolLM2 step. The C functions here read their
input once and write their output once, spread over torch's threads (engine/cbuild.py), and
keep the roundings transformers makes, so that they compute the same bf16 values up to float32
rounding order (a different sum order in the mean, vectorised ``expf`` / ``tanhf``):

- Llama's norm: ``bf16(w * bf16(x * r))``, r = 1 / sqrt(mean(x^2) + eps) in float32;
- Gemma 3's: ``bf16(x * r * (1 + w))`` in float32 (its weight is an offset from one);
- the activation: ``bf16(bf16(act(gate)) * up)``, act = SiLU or GELU's tanh approximation;
- RoPE (:func:`rope`, which engine/lean.py calls): ``bf16(bf16(x * cos) + bf16(rotate_half(x) *
  sin))``, transformers' three roundings of elementwise products, so bit for bit its values.

:func:`fuse` points the forward of a bf16 CPU model's norm and MLP modules (the classes in
:data:`NORMS` and :data:`MLPS`) at these functions when the library builds; float32, CUDA, and a
machine without a C compiler (or ``KVSNAP_C_KERNELS=0``) keep transformers' operators.
"""

from __future__ import annotations

import ctypes
import functools
import types

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from . import cbuild
from .packed import _packed_forward, group, products, ungroup

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf(uint16_t x) { uint32_t u = ((uint32_t)x) << 16; float f; memcpy(&f, &u, 4); return f; }

/* float32 -> bf16, round to nearest even (torch's c10::BFloat16), NaN kept a quiet NaN */
static inline uint16_t tobf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* n rows of h values (row i at x + i * stride) -> out [n, h]. gemma: 0 = Llama's, 1 = Gemma's. */
void rms_norm(long n, int h, const uint16_t *x, long stride, const uint16_t *w, float eps, int gemma,
              uint16_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if(n >= 16)
    for (long i = 0; i < n; i++) {
        const uint16_t *xi = x + i * stride;
        uint16_t *oi = out + i * (long)h;
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int j = 0; j < h; j++) { float v = bf(xi[j]); ss += v * v; }
        float r = 1.f / sqrtf(ss / (float)h + eps);
        if (gemma) {
            #pragma omp simd
            for (int j = 0; j < h; j++) oi[j] = tobf(bf(xi[j]) * r * (1.f + bf(w[j])));
        } else {
            #pragma omp simd
            for (int j = 0; j < h; j++) oi[j] = tobf(bf(w[j]) * bf(tobf(bf(xi[j]) * r)));
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
                float a = bf(xi[j]), b = bf(xi[j + half]);
                oi[j] = tobf(bf(tobf(a * bf(c[j]))) + bf(tobf(-b * bf(s[j]))));
                oi[j + half] = tobf(bf(tobf(b * bf(c[j + half]))) + bf(tobf(a * bf(s[j + half]))));
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
                float v = bf(g[i]);
                out[i] = tobf(bf(tobf(v / (1.f + expf(-v)))) * bf(u[i]));
            }
        } else {
            #pragma omp simd
            for (long i = b * block; i < end; i++) {
                float v = bf(g[i]);
                float a = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
                out[i] = tobf(bf(tobf(a)) * bf(u[i]));
            }
        }
    }
}
"""

NORMS = {LlamaRMSNorm: 0, Gemma3RMSNorm: 1}  # the class, and which formula its forward is
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # a gated MLP's hidden_act, and the C code's number
MLPS = {LlamaMLP: "hidden_act", Gemma3MLP: "hidden_activation"}  # the class, and its config's activation field


def _activation(mlp: nn.Module) -> int | None:
    return ACTIVATIONS.get(getattr(mlp.config, MLPS[type(mlp)], None))


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = cbuild.build("fused", SOURCE)
    if lib is not None:
        lib.rms_norm.restype = None
        lib.rms_norm.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
        lib.rms_norm.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.act_mul.restype = None
        lib.act_mul.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.act_mul.argtypes += [ctypes.c_int]
        lib.rope.restype = None
        lib.rope.argtypes = [ctypes.c_long] + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] * 2
        lib.rope.argtypes += [ctypes.c_void_p] * 4
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """RMSNorm over the last dimension of bf16 ``x`` (its rows contiguous), as ``NORMS`` computes."""
    h = x.shape[-1]
    if x.stride(-1) != 1 or not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    n = x.numel() // h
    library().rms_norm(
        n, h, x.data_ptr(), h, weight.data_ptr(), eps, int(gemma), out.data_ptr(), torch.get_num_threads()
    )
    return out


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """``act(gate) * up`` of two bf16 tensors of one shape, with transformers' roundings."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    library().act_mul(gate.numel(), gate.data_ptr(), up.data_ptr(), act, out.data_ptr(), torch.get_num_threads())
    return out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` on bf16 ``q`` ``[1, H, T, D]`` and ``k`` ``[1, H_kv,
    T, D]`` (rows of D contiguous) with ``cos`` / ``sin`` ``[1, T, D]``, bit for bit; the outputs
    are laid out ``[1, T, H, D]`` in memory, as the projections' views they come from."""
    batch, heads, tokens, dim = q.shape
    kv_heads = k.shape[1]
    if batch != 1 or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.shape[0] != 1:
        raise ValueError(f"rope takes one sequence with rows of contiguous values, got {tuple(q.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(1, tokens, heads, dim, dtype=torch.bfloat16)
    k_out = torch.empty(1, tokens, kv_heads, dim, dtype=torch.bfloat16)
    library().rope(
        tokens, heads, kv_heads, dim,
        q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), k.stride(2), k.stride(1),
        cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
    )  # fmt: skip
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return type(self).forward(self, x)
    eps = self.variance_epsilon if isinstance(self, LlamaRMSNorm) else self.eps
    return rms_norm(x, self.weight, eps, gemma=NORMS[type(self)] == 1)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP with the fused activation; its projections are called as their forwards
    (engine/packed.py's where packed: the same products, without three module dispatches)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return type(self).forward(self, x)
    gate, up = products((self.gate_proj, self.up_proj), x)  # one AMX pass or oneDNN call where they take both
    return _packed_forward(self.down_proj, act_mul(gate, up, _activation(self)))


def fuse(model: nn.Module) -> int:
    """Point a bf16 CPU model's norms and gated MLPs at the C functions; returns how many
    modules it pointed (0: a float32 or CUDA model, another architecture, no library, or all of
    them fused already)."""
    first = next(model.parameters(), None)
    if first is None or first.dtype != torch.bfloat16 or first.device.type != "cpu" or library() is None:
        return 0
    count = 0
    for module in model.modules():
        if "forward" in module.__dict__:  # fused already (or another patch): left as it is
            continue
        if type(module) in NORMS and module.weight.dtype == torch.bfloat16:
            module.forward = types.MethodType(_norm_forward, module)
        elif type(module) in MLPS and _activation(module) is not None:
            module.forward = types.MethodType(_mlp_forward, module)
            group((module.gate_proj, module.up_proj))  # one oneDNN call for both where they are packed
        else:
            continue
        count += 1
    return count


def unfuse(model: nn.Module) -> None:
    """Undo :func:`fuse` (benchmarks compare both in one run)."""
    for module in model.modules():
        if "forward" in module.__dict__ and type(module) in (*NORMS, *MLPS):
            del module.forward
            if type(module) in MLPS:
                ungroup((module.gate_proj, module.up_proj))
