"""The fused C kernels of bf16 CPU models (engine/models/fused.py): RMSNorm and gated activations give
transformers' bf16 values (up to one rounding step where float32 sums in another order), and a
model running them answers as one running transformers' operators."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kvsnap.cpu_kernels import fused_ops
from kvsnap.engine import load_model
from kvsnap.engine.models import fused

from ...conftest import random_tokens

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="KVSNAP_C_KERNELS=0: torch's operators run")


def steps_apart(got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> None:
    """Equal, or at most ``steps`` bf16 rounding steps apart in a few values (float32 rounding
    order; each rounding transformers makes on the way can move a value by one step)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    # a step of the value, or of a hundredth of the largest (GELU's tail: 1 + tanh(z) cancels)
    step = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(0.01 * want.float().abs().max())
    assert ((got.float() - want.float()).abs() <= steps * step * 1.01 + 1e-30).all()
    assert (got != want).float().mean() < 0.03


@pytest.mark.parametrize("norm_class", [LlamaRMSNorm, Gemma3RMSNorm])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_gives_transformers_values(norm_class, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = norm_class(96).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen) * 0.5)
    x = (torch.randn(1, rows, 96, generator=gen) * 3).bfloat16()
    eps = norm.variance_epsilon if norm_class is LlamaRMSNorm else norm.eps
    with torch.inference_mode():
        steps_apart(fused_ops.rms_norm(x, norm.weight, eps, gemma=norm_class is Gemma3RMSNorm), norm(x))
        steps_apart(fused_ops.rms_norm(x[:, ::2], norm.weight, eps, norm_class is Gemma3RMSNorm), norm(x[:, ::2]))


@pytest.mark.parametrize(("name", "act"), [("silu", 0), ("gelu_pytorch_tanh", 1)])
def test_act_mul_gives_transformers_values(name, act):
    gen = torch.Generator().manual_seed(act)
    gate, up = ((torch.randn(3, 5000, generator=gen) * 3).bfloat16() for _ in range(2))
    steps_apart(fused_ops.act_mul(gate, up, act), ACT2FN[name](gate) * up, steps=2)  # act(gate), then the product


def test_a_bf16_model_runs_them_and_computes_as_with_transformers_operators(tiny_engine):
    """Every norm and MLP of a bf16 tiny model runs the kernels (a float32 one none), and its
    logits over whole prompts are those of the same model on transformers' operators within
    bf16's rounding: the same next token wherever the top two are further apart than that."""
    loaded = load_model(tiny_engine.loaded.name, dtype="bfloat16")
    config = loaded.model.config
    norms = sum(isinstance(m, (LlamaRMSNorm, Gemma3RMSNorm)) for m in loaded.model.modules())
    assert norms > config.num_hidden_layers and fused.fuse(loaded.model) == 0  # fused at load already
    assert all("forward" in m.__dict__ for m in loaded.model.modules() if isinstance(m, (LlamaRMSNorm, Gemma3RMSNorm)))
    assert fused.fuse(load_model(tiny_engine.loaded.name).model) == 0  # float32: transformers' operators

    prompts = torch.tensor([random_tokens(60, seed=seed) for seed in range(4)])
    with torch.inference_mode():
        ours = loaded.model(prompts).logits.float()  # [4, 60, V]
        fused.unfuse(loaded.model)
        theirs = loaded.model(prompts).logits.float()
    gap = (ours - theirs).abs().max()
    assert gap <= 0.05 * theirs.abs().max()
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * gap  # rows whose next token no rounding can flip
    assert clear.float().mean() > 0.5 and torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
