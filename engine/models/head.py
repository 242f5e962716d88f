"""The LM head: next-token logits of each row's last hidden state.

On a CPU the head is most of a decode step's cost for a large vocabulary (Gemma 3 270M: a
262,144 x 640 matrix, 168M of the model's 270M weights), and with fp32 weights it is
compute-bound once a step carries more than a few rows: on 2 cores, 20 ms for 1-2 rows,
50 ms for 8 and 88 ms for 16. So a batch of 16 spends most of its time there.

Rows that are decoded greedily need only the head's argmax, and :class:`LMHead` finds the
exact one (``screen``, on by default where it pays: :func:`screen_pays`):

1. **First pass**: with 6 greedy rows or more (:data:`SCREEN_MIN_ROWS`), logits from a
   bfloat16 copy of the head (a CPU's bf16 dot-product instructions: about 24 ms for 8 rows,
   30 ms for 16, but no faster than fp32 for 1-4 rows); with fewer, the fp32 logits.
2. **Candidates**: every token whose exact logit could still be the largest, from a rigorous
   bound on the first pass's error (for bf16: inputs rounded to 8 significant bits, fp32
   accumulation, output rounded to 8 bits; doubled for safety). On Gemma 3 270M a row has
   one candidate in the median and a few hundred at worst after the bf16 pass.
3. **Exact**: the candidates' logits recomputed in float64 from the head's weights and hidden
   state, softcapped as the model does.

A bfloat16 model's head is its own first pass (no copy) whatever the number of rows, and its
exact logits are those of its bf16 weights and hidden state, computed in float64.

Either way a greedy row's argmax is the argmax of the exact logits, whatever the batch and
whichever tokens passed the screen, so a greedy session's tokens do not depend on the rows it
shares a step with (the fp32 matmul's rounding does: its blocking changes with the number of
rows). Sampled rows (temperature > 0) need every logit and get the fp32 head (``W @ h^T``).
"""

from __future__ import annotations

import logging

import torch

from kvsnap.cpu_kernels import linear_tiles, linear_vectors

from . import packed

log = logging.getLogger(__name__)

SCREEN_MIN_WEIGHTS = 1 << 22  # a smaller head costs too little for a screen to pay
SCREEN_MIN_ROWS = 6  # fewer greedy rows: the first pass is fp32 (as fast there: bench/micro/greedy_head_bench.py)
EXACT_CHUNK = 4096  # candidates recomputed in float64 at a time (a few MiB of gathered rows)
_U = 2.0**-8  # bfloat16's unit roundoff
_FP32 = 2.0**-24 / (1 - 2.0**-24)  # fp32 rounding, relative: per accumulated term, and of the output


class LMHead:
    """``head(hidden, greedy)``: logits ``[B, V]`` of last hidden states ``[B, D]``; rows with
    ``greedy[b]`` True get exact-argmax logits (see the module) when the screen is on."""

    def __init__(self, model: torch.nn.Module, softcap: float | None, screen: bool | None = None):
        head = model.get_output_embeddings()
        self.weight, self.bias, self.softcap = head.weight, head.bias, softcap
        if screen is None:
            screen = screen_pays(self.weight, self.bias)
        self.screen = bool(screen) and self.bias is None  # the bound knows no bias
        self.packed = None  # the head packed for oneDNN: the first pass on a CPU without AMX
        self.few = None  # or repacked for cpu_kernels/linear_vectors.py
        if self.screen:
            weight = self.weight.detach()
            # a bf16 head is its own first pass; an fp32 one gets a bf16 copy
            self.weight_bf16 = weight if weight.dtype == torch.bfloat16 else weight.to(torch.bfloat16)
            self.tiles = linear_tiles.takes(self.weight_bf16)  # a few rows' first pass on AMX tiles
            # without AMX, with AVX-512 BF16: cpu_kernels/linear_vectors.py's kernel on a repacked copy
            self.few = linear_vectors.repack(self.weight_bf16) if linear_vectors.takes(self.weight_bf16) else None
            # elsewhere oneDNN's product with the head packed once, not reordered every call: the
            # same bits, a second copy of the head (engine/models/packed.py)
            if not self.tiles and self.few is None and packed.can_pack(self.weight_bf16):
                self.packed = packed.pack(self.weight_bf16)
                size = self.weight_bf16.numel() * 2 / 2**20
                log.info("the LM head's first pass: its weight packed for oneDNN (%.0f MiB more)", size)
            # |w_v . h| <= |w_v| |h|; in chunks: no fp32 copy of a bf16 head
            self.row_norms = torch.cat([w.float().norm(dim=1) for w in weight.split(EXACT_CHUNK)])
            self.norm_max = float(self.row_norms.max())
            # per-product error (both inputs rounded) plus fp32 accumulation over D terms
            self.product_error = 2 * _U + _U * _U + 2 * weight.shape[1] * 2.0**-24

    def __call__(self, hidden: torch.Tensor, greedy: list[bool] | None = None) -> torch.Tensor:
        if not self.screen or not greedy or not any(greedy):
            return self.full(hidden)
        if all(greedy):
            return self.argmax_logits(hidden)
        logits = torch.empty(hidden.shape[0], self.weight.shape[0], device=hidden.device)
        picked = torch.tensor(greedy, device=hidden.device)
        logits[picked] = self.argmax_logits(hidden[picked])
        logits[~picked] = self.full(hidden[~picked])
        return logits

    def full(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every logit, fp32, computed as ``W @ h^T``: on a CPU, torch's ``linear`` with a few
        rows against a large vocabulary takes a slow path (Gemma 3's head, 2 cores: about
        100-120 ms for 2-16 rows, against 20-90 ms this way). One row goes as two (the
        matrix-vector kernel takes 55 ms where two rows take 21)."""
        return self._cap(self._raw(hidden)).float()

    def _raw(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden if hidden.shape[0] > 1 else hidden.expand(2, -1).contiguous()
        logits = (self.weight @ rows.T).T[: hidden.shape[0]]
        return logits if self.bias is None else logits + self.bias

    def argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[G, V]`` logits whose argmax is the exact logits' argmax (see the module): the
        candidates' exact values, and elsewhere a first pass's values (fp32 for fewer than
        :data:`SCREEN_MIN_ROWS` rows) or -inf (the bf16 screen)."""
        hidden = hidden.float()
        if hidden.shape[0] < SCREEN_MIN_ROWS and self.weight.dtype == torch.float32:  # as fast as bf16 here
            raw = self._raw(hidden).contiguous()  # [G, V] (the product is [V, G])
            rows, cols = self._candidates(raw, hidden, _FP32 * hidden.shape[1], _FP32)
            logits = self._cap(raw).float()
        else:
            approx = self._first_pass(hidden.to(torch.bfloat16))  # [G, V]
            rows, cols = self._candidates(approx, hidden, self.product_error, _U / (1 - _U))
            logits = torch.full_like(approx, -torch.inf, dtype=torch.float32)
        if rows is None:  # overflow in the first pass: no bound holds
            return self.full(hidden)
        for start in range(0, len(cols), EXACT_CHUNK):  # chunked: a flat row could make every token one
            r, c = rows[start : start + EXACT_CHUNK], cols[start : start + EXACT_CHUNK]
            exact = (self.weight[c].double() * hidden[r].double()).sum(-1)  # [candidates]
            logits[r, c] = self._cap(exact).float()
        return logits

    def _first_pass(self, rows: torch.Tensor) -> torch.Tensor:
        """bf16 logits of bf16 ``rows``: float32 sums of the products, rounded to bf16 (the bound's
        model), on AMX tiles where they fit (cpu_kernels/linear_tiles.py: no reorder of the head per call,
        1.4-1.9x faster here), else oneDNN's product on the head packed once (the same bits as
        ``F.linear``, which reorders the head every call), else ``F.linear``."""
        if self.tiles and linear_tiles.fits(rows):
            return linear_tiles.linear(rows, self.weight_bf16)
        if self.few is not None:  # any rows: the screen needs no particular bits, only its bound
            return linear_vectors.linears(rows, [self.few])[0]
        if self.packed is not None:  # a decode step 1.1-1.6x without AMX (docs/BENCHMARKS.md)
            return packed.product(rows, self.packed)
        return torch.nn.functional.linear(rows, self.weight_bf16)

    def _candidates(self, approx: torch.Tensor, hidden: torch.Tensor, a: float, b: float):
        """(rows, cols) of the tokens whose exact logit may be their row's largest, given a
        first pass ``approx`` whose logit ``o_v`` is within ``a |w_v| |h| + b |o_v|`` of the exact
        one (``a``: rounded inputs and the accumulation, ``b``: the output's rounding).

        With ``N`` the largest row norm, the top token ``t`` is exactly at least
        ``L = o_t - a N |h| - b |o_t|``, and a token with ``o_v < o_t - m``,
        ``m = (2 a N |h| + 2 b |o_t|) / (1 - b)``, is exactly below ``L``: it cannot be the argmax.
        The first cut keeps every token within ``2 m`` of the top; the second drops those whose
        own bound (``|w_v|``, not ``N``, doubled) puts them below another candidate."""
        top = approx.amax(dim=-1).float()  # [G]
        if not torch.isfinite(top).all():
            return None, None
        h_norm = hidden.norm(dim=-1)
        floor = top - 2 * (2 * a * self.norm_max * h_norm + 2 * b * top.abs()) / (1 - b)
        floor = (floor - floor.abs() * 2.0**-7).to(approx.dtype)  # rounding to bf16 cannot raise it
        rows, cols = (approx >= floor[:, None]).nonzero(as_tuple=True)
        guess = approx[rows, cols].float()
        slack = 2 * (a * self.row_norms[cols] * h_norm[rows] + b * guess.abs() * (1 + b))
        lowest = torch.full_like(top, -torch.inf).scatter_reduce(0, rows, guess - slack, "amax")
        keep = guess + slack >= lowest[rows]
        return rows[keep], cols[keep]

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap:
            return torch.tanh(logits / self.softcap) * self.softcap
        return logits


def screen_pays(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The screen's default: a head large enough (:data:`SCREEN_MIN_WEIGHTS`) for its cost to
    matter, without a bias (every LM we embed), either in bfloat16 (a bf16 model: the screen is
    what makes its greedy tokens independent of the batch, at the cost of the candidates'
    recompute) or in fp32 on a CPU with oneDNN bfloat16 kernels."""
    if bias is not None or weight.numel() < SCREEN_MIN_WEIGHTS:
        return False
    if weight.dtype == torch.bfloat16:
        return True
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )
