"""A Llama decoder layer's forward for bf16 models on a CPU, without transformers' module calls.

A decode step's layer is a few small products and a dozen smaller operators on 1-16 rows, and
in transformers' ``LlamaDecoderLayer`` each of them also pays module dispatch (the attention,
MLP, norm and projection modules, their hooks and decorators) and RoPE runs as fourteen
operators. :func:`lean_forward` makes the calls the layer makes anyway, in the same order: the
same packed projections (engine/models/packed.py), the norm and MLP modules' own forwards called
directly (engine/models/fused.py's where fused), the same cache update and attention function; RoPE
is one C pass with transformers' roundings (:func:`kvsnap.cpu_kernels.fused_ops.rope`). The hidden
states, keys and values are those of transformers' path bit for bit
(tests/engine/models/test_lean_llama_layer.py), so no invariant changes.

:func:`install` points the forward of a bf16 CPU Llama-family model's decoder layers here
(SmolLM2 is one) where the fused kernels built; a layer falls back to transformers' forward
for anything else (a capture that wants the attention input: KVzap, KVzip+).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, eager_attention_forward

from kvsnap.cpu_kernels import fused_ops

from ..batch import BatchCache
from . import packed
from .packed import _packed_forward, products


def _wants_hidden(cache) -> bool:
    """A row's capture wants the attention input (engine/capture.py's ``hidden_hook``)."""
    return isinstance(cache, BatchCache) and any(r.capture is not None and r.capture.wants_hidden for r in cache.rows)


def _applies(hidden_states: torch.Tensor, cache) -> bool:
    """bf16 on a CPU, one sequence (a packed step's; :func:`~kvsnap.cpu_kernels.fused_ops.rope` takes one), and no
    capture that wants the attention input."""
    return (
        hidden_states.dtype == torch.bfloat16
        and hidden_states.device.type == "cpu"
        and hidden_states.shape[0] == 1
        and not _wants_hidden(cache)
    )


def _projections(layer: LlamaDecoderLayer) -> tuple[nn.Linear, ...]:
    """The layer's query, key and value projections: one input, their products taken together."""
    attn = layer.self_attn
    return attn.q_proj, attn.k_proj, attn.v_proj


def lean_forward(
    self: LlamaDecoderLayer,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    if not _applies(hidden_states, cache):
        return type(self).forward(
            self, hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        )  # fmt: skip
    attn, mlp = self.self_attn, self.mlp
    residual = hidden_states
    hidden = self.input_layernorm.forward(hidden_states)  # fused.py's where fused
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    projected = products(_projections(self), hidden)  # one AMX pass or oneDNN call where they take it
    query, key, value = (p.view(shape).transpose(1, 2) for p in projected)
    query, key = fused_ops.rope(query, key, *position_embeddings)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    out, _ = attend(
        attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling,
        position_ids=position_ids, use_cache=use_cache, **kwargs,
    )  # fmt: skip
    out = out.reshape(*shape[:-2], -1).contiguous()
    hidden = residual + _packed_forward(attn.o_proj, out)
    residual = hidden
    hidden = self.post_attention_layernorm.forward(hidden)
    return residual + mlp.forward(hidden)


def install(model: nn.Module) -> int:
    """Point a bf16 CPU Llama-family model's decoder layers at :func:`lean_forward`; how many
    (0: another architecture or dtype, no fused kernels, or installed already)."""
    first = next(model.parameters(), None)
    if first is None or first.dtype != torch.bfloat16 or first.device.type != "cpu" or not fused_ops.available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not LlamaDecoderLayer or "forward" in module.__dict__:
            continue
        module.forward = types.MethodType(lean_forward, module)
        packed.group(_projections(module))  # one oneDNN call for the three where they are packed
        count += 1
    return count


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install` (benchmarks compare both in one run)."""
    for module in model.modules():
        if type(module) is LlamaDecoderLayer and "forward" in module.__dict__:
            del module.forward
            packed.ungroup(_projections(module))
