"""KVzap: a small per-layer model predicts each row's KVzip+ log score from the row's own
attention input, as the prefill passes (see :mod:`.scored` for which rows stay).

``surrogate``: ``linear`` (``D -> H_kv``) or ``mlp`` (``D -> D/8 -> H_kv``, GELU), trained here
by ``bench/compression/train_kvzap.py`` and shipped in ``policies/kvzap_weights/``
(``<model>.<surrogate>.safetensors``, the model's fingerprint in its metadata) for the embedded
models. A model without weights trained on it refuses the policy before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvsnap.errors import InvalidArgument

from .scored import ScoredPolicy

WEIGHTS = Path(__file__).parent / "kvzap_weights"
SURROGATES = ("linear", "mlp")


@dataclass(frozen=True, slots=True)
class KVzap(ScoredPolicy):
    name = "kvzap"
    scored_by = "hidden"

    surrogate: str = "linear"

    def __post_init__(self) -> None:
        ScoredPolicy.__post_init__(self)
        if self.surrogate not in SURROGATES:
            raise InvalidArgument(f"surrogate must be one of {SURROGATES}, got {self.surrogate!r}")


class Surrogate(torch.nn.Module):
    """One model's KVzap predictors: per full-attention layer, attention input ``[T, D]`` ->
    predicted log scores ``[H_kv, T]``."""

    def __init__(self, layers: list[int], dim: int, kv_heads: int, kind: str = "linear"):
        super().__init__()
        self.kind, self.layers = kind, list(layers)
        hidden = max(1, dim // 8)
        self.nets = torch.nn.ModuleDict(
            {
                str(i): torch.nn.Linear(dim, kv_heads)
                if kind == "linear"
                else torch.nn.Sequential(
                    torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, kv_heads)
                )
                for i in self.layers
            }
        )

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.nets[str(layer)](hidden.float()).transpose(-1, -2)

    def save(self, path: Path, meta: dict[str, str]) -> None:
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path, layers: list[int], dim: int, kv_heads: int, kind: str) -> Surrogate:
        net = cls(layers, dim, kv_heads, kind)
        net.load_state_dict(load_file(str(path)))
        return net.eval()


def weights_path(model: str, kind: str) -> Path:
    """Where the ``kind`` surrogate of ``model`` (an embedded model's name, or an HF id: its
    slashes become ``--``) is kept."""
    name = model.replace("/", "--")
    if not name or name.startswith(".") or "\\" in name:
        raise InvalidArgument(f"no KVzap surrogates for a model named {model!r}")
    return WEIGHTS / f"{name}.{kind}.safetensors"


def trained_for(path: Path) -> str:
    """The model fingerprint a surrogate file was trained on (its metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("fingerprint", "")
