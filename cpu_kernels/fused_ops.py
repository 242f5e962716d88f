"""RMSNorm, the MLP's gated activation and RoPE of bf16 CPU models in one pass each, in C.

transformers' ``LlamaRMSNorm`` runs eight operators over its input (a float32 copy, square,
mean, add, rsqrt, multiply, a bf16 copy, the weight), ``Gemma3RMSNorm`` six, and a gated MLP
two (``act(gate) * up``): each a pass over memory and, in a decode step, each a few
microseconds of dispatch, 61 norms and 30 MLPs a SmolLM2 step. The C functions here read their
input once and write their output once, spread over torch's threads (cpu_kernels/build.py), and
keep the roundings transformers makes, so that they compute the same bf16 values up to float32
rounding order (a different sum order in the mean, vectorised ``expf`` / ``tanhf``):

- Llama's norm: ``bf16(w * bf16(x * r))``, r = 1 / sqrt(mean(x^2) + eps) in float32;
- Gemma 3's: ``bf16(x * r * (1 + w))`` in float32 (its weight is an offset from one);
- the activation: ``bf16(bf16(act(gate)) * up)``, act = SiLU or GELU's tanh approximation;
- RoPE (:func:`rope`, which engine/models/lean.py calls): ``bf16(bf16(x * cos) + bf16(rotate_half(x) *
  sin))``, transformers' three roundings of elementwise products, so bit for bit its values.

C source: cpu_kernels/csrc/fused_ops.c, in every variant. engine/models/fused.py points a bf16 CPU
model's norm and MLP modules at these functions where :func:`available`; float32, CUDA and a
process without kernels keep transformers' operators.
"""

from __future__ import annotations

import ctypes

import torch

from . import build

SILU, GELU_TANH = 0, 1  # the activations act_mul computes (the C code's numbers)
_INT, _LONG, _PTR = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
_SIGNATURES = {
    "rms_norm": [_LONG, _INT, _PTR, _LONG, _PTR, ctypes.c_float, _INT, _PTR, _INT],
    "act_mul": [_LONG, _PTR, _PTR, _INT, _PTR, _INT],
    "rope": [_LONG] + [_INT] * 3 + [_PTR, _LONG, _LONG] * 2 + [_PTR] * 4,
}


def _fn(name: str):
    return build.function(name, None, _SIGNATURES[name])


def available() -> bool:
    return _fn("rms_norm") is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """RMSNorm over the last dimension of bf16 ``x`` (its rows contiguous), as ``NORMS`` computes."""
    h = x.shape[-1]
    if x.stride(-1) != 1 or not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    n = x.numel() // h
    _fn("rms_norm")(n, h, x.data_ptr(), h, weight.data_ptr(), eps, int(gemma), out.data_ptr(), torch.get_num_threads())
    return out


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """``act(gate) * up`` of two bf16 tensors of one shape, with transformers' roundings."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    _fn("act_mul")(gate.numel(), gate.data_ptr(), up.data_ptr(), act, out.data_ptr(), torch.get_num_threads())
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
    _fn("rope")(
        tokens, heads, kv_heads, dim,
        q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), k.stride(2), k.stride(1),
        cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
    )  # fmt: skip
    return q_out.transpose(1, 2), k_out.transpose(1, 2)
