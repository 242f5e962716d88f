"""bf16 CPU models' norms and gated MLPs pointed at the fused C ops (cpu_kernels/fused_ops.py).

:func:`fuse` points the forward of a bf16 CPU model's norm and MLP modules (the classes in
:data:`NORMS` and :data:`MLPS`) at those functions where the kernels run; float32, CUDA, and a
process without kernels (no C compiler, ``KVSNAP_C_KERNELS=0``) keep transformers' operators.
The ops keep transformers' roundings (their docstring), so the values are the same bf16 up to
float32 rounding order.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from kvsnap.cpu_kernels import fused_ops
from kvsnap.cpu_kernels.fused_ops import act_mul, rms_norm

from .packed import _packed_forward, group, products, ungroup

NORMS = {LlamaRMSNorm: 0, Gemma3RMSNorm: 1}  # the class, and which formula its forward is
# a gated MLP's hidden_act, and the C code's number
ACTIVATIONS = {"silu": fused_ops.SILU, "gelu_pytorch_tanh": fused_ops.GELU_TANH}
MLPS = {LlamaMLP: "hidden_act", Gemma3MLP: "hidden_activation"}  # the class, and its config's activation field


def _activation(mlp: nn.Module) -> int | None:
    return ACTIVATIONS.get(getattr(mlp.config, MLPS[type(mlp)], None))


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return type(self).forward(self, x)
    eps = self.variance_epsilon if isinstance(self, LlamaRMSNorm) else self.eps
    return rms_norm(x, self.weight, eps, gemma=NORMS[type(self)] == 1)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP with the fused activation; its projections are called as their forwards
    (engine/models/packed.py's where packed: the same products, without three module dispatches)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return type(self).forward(self, x)
    gate, up = products((self.gate_proj, self.up_proj), x)  # one AMX pass or oneDNN call where they take both
    return _packed_forward(self.down_proj, act_mul(gate, up, _activation(self)))


def fuse(model: nn.Module) -> int:
    """Point a bf16 CPU model's norms and gated MLPs at the C functions; returns how many
    modules it pointed (0: a float32 or CUDA model, another architecture, no library, or all of
    them fused already)."""
    first = next(model.parameters(), None)
    if first is None or first.dtype != torch.bfloat16 or first.device.type != "cpu" or not fused_ops.available():
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
