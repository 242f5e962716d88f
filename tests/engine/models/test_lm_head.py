"""The LM head (engine/models/head.py): greedy rows get the exact argmax, through an fp32 or a bf16
first pass and a float64 recompute of the candidates; sampled rows get every fp32 logit."""

from __future__ import annotations

import pytest
import torch

from kvsnap.engine import SamplingParams
from kvsnap.engine.models.head import SCREEN_MIN_ROWS, LMHead, screen_pays


class Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)

    def get_output_embeddings(self):
        return self.lm_head


def exact_argmax(weight: torch.Tensor, hidden: torch.Tensor) -> list[int]:
    return (hidden.double() @ weight.double().T).argmax(-1).tolist()


def near_ties(vocab: int = 5000, dim: int = 64, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A head and hidden states where each row's best token beats a twin by about 1e-4: bf16
    (8 significant bits) cannot tell them apart, and the twin comes first in the vocabulary."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=g) * 0.05
    hidden = torch.randn(rows, dim, generator=g)
    best = []
    for r in range(rows):
        twin, winner = 2 * r + 10, 2 * r + 11
        direction = hidden[r] / hidden[r].norm()
        weight[twin] = direction * 3.0  # far above every random row
        weight[winner] = weight[twin] + direction * (1e-4 / hidden[r].norm())
        best.append(winner)
    return weight, hidden, best


@pytest.mark.parametrize("rows", [1, SCREEN_MIN_ROWS - 1, SCREEN_MIN_ROWS, 8])
def test_greedy_rows_get_the_exact_argmax_on_near_ties(rows):
    weight, hidden, best = near_ties(rows=rows)
    assert exact_argmax(weight, hidden) == best
    bf16 = torch.nn.functional.linear(hidden.bfloat16(), weight.bfloat16()).float()
    assert any(int(bf16[r].argmax()) != best[r] for r in range(rows)), "no near tie: the test proves nothing"
    head = LMHead(Head(weight), softcap=None, screen=True)
    logits = head(hidden, [True] * rows)
    assert logits.argmax(-1).tolist() == best
    # the candidates hold their exact logits; a token the screen dropped is -inf (bf16 pass) or its fp32 value
    exact = (hidden.double() @ weight.double().T).float()
    for r in range(rows):
        assert logits[r, best[r]] == exact[r, best[r]]
        assert torch.isfinite(logits[r]).sum() >= 1


def test_a_flat_row_makes_every_token_a_candidate_and_is_recomputed_in_chunks(monkeypatch):
    """A zero hidden state gives every token the same logit: all are candidates; the float64
    recompute goes in chunks (bounded memory) and the argmax is the first token, as torch's."""
    monkeypatch.setattr("kvsnap.engine.models.head.EXACT_CHUNK", 64)
    weight, hidden, _ = near_ties(rows=6)
    hidden[2] = 0.0
    head = LMHead(Head(weight), softcap=None, screen=True)
    for rows in (3, 6):  # the fp32 first pass, and the bf16 one
        logits = head(hidden[:rows], [True] * rows)
        assert torch.isfinite(logits[2]).all() and (logits[2] == 0).all()
        assert logits.argmax(-1).tolist() == exact_argmax(weight, hidden[:rows])


def test_softcap_keeps_the_argmax_and_caps_the_values():
    weight, hidden, best = near_ties(rows=6)
    head = LMHead(Head(weight), softcap=50.0, screen=True)
    logits = head(hidden, [True] * 6)
    assert logits.argmax(-1).tolist() == best
    exact = hidden.double() @ weight.double().T
    for r in range(6):
        assert logits[r, best[r]] == (torch.tanh(exact[r, best[r]] / 50.0) * 50.0).float()


def test_sampled_rows_get_every_fp32_logit_beside_greedy_ones():
    weight, hidden, best = near_ties(rows=6)
    head = LMHead(Head(weight), softcap=None, screen=True)
    greedy = [True, False, True, True, False, True]
    logits = head(hidden, greedy)
    sampled = [r for r, g in enumerate(greedy) if not g]
    assert torch.equal(logits[sampled], head.full(hidden[sampled]))  # every logit, as the fp32 head gives them
    assert [int(logits[r].argmax()) for r, g in enumerate(greedy) if g] == [
        b for b, g in zip(best, greedy, strict=True) if g
    ]
    assert torch.equal(head(hidden, [False] * 6), head.full(hidden))


def test_the_screen_is_off_where_it_cannot_pay_or_cannot_bound():
    small = torch.randn(300, 32)
    assert not screen_pays(small, None)  # a tiny head: fp32 is cheap
    assert not screen_pays(torch.randn(1 << 16, 64), torch.zeros(1 << 16))  # a bias: the bound knows none
    assert not screen_pays(torch.randn(1 << 16, 64).half(), None)  # neither an fp32 nor a bf16 head
    assert screen_pays(torch.randn(1 << 16, 64).bfloat16(), None)  # a bf16 model's head: its own first pass
    linear = torch.nn.Linear(32, 300, bias=True)
    model = Head(small)
    model.lm_head = linear
    assert not LMHead(model, None, screen=True).screen  # forced on, but a bias: off


@pytest.mark.slow
def test_gemma_greedy_argmax_equals_the_exact_one_for_real_hidden_states(gemma_engine):
    """Gemma 3 270M's 262k-token head on its own hidden states (a document, then greedy decode):
    the screen picks the exact argmax through both first passes, and so does fp32 here."""
    engine = gemma_engine
    assert engine.head.screen  # on by default for this head on a CPU with bf16 kernels
    hidden = []
    full = engine.head.full
    session = engine.new_session("full")
    tokens = engine.encode("The lighthouse keeper wrote down the weather every morning. " * 8)
    engine.head.full = lambda h: (hidden.append(h.clone()), full(h))[1]
    try:
        engine.turn(session, tokens, SamplingParams(max_new_tokens=24, temperature=0.7, seed=3))
    finally:
        del engine.head.full
    states = torch.cat(hidden)
    weight = engine.head.weight.detach()
    want = exact_argmax(weight, states)
    for rows in (1, SCREEN_MIN_ROWS, len(states)):
        got = [int(i) for part in states.split(rows) for i in engine.head(part, [True] * len(part)).argmax(-1)]
        assert got == want, rows


def test_a_bf16_head_gives_the_exact_argmax_of_its_own_weights():
    """A bfloat16 model's head is its own first pass (no copy), for any number of rows; the
    greedy argmax is that of its bf16 weights and hidden state computed in float64."""
    torch.manual_seed(3)
    weight = torch.randn(1 << 16, 64).bfloat16()
    head = LMHead(Head(weight), None, screen=True)
    assert head.screen and head.weight_bf16.data_ptr() == head.weight.data_ptr()  # no copy
    for rows in (1, 2, 8):
        hidden = torch.randn(rows, 64).bfloat16()
        exact = (weight.double() @ hidden.double().T).T
        assert head(hidden, [True] * rows).argmax(-1).tolist() == exact.argmax(-1).tolist()


def test_without_amx_the_bf16_first_pass_runs_on_a_copy_of_the_head_made_once():
    """On a CPU without AMX tiles a bf16 head's first pass runs on a copy of the head made at
    start-up: cpu_kernels/linear_vectors.py's repack where the CPU has AVX-512 BF16 (within the bound the
    screen assumes, any row count), else oneDNN's product with the head packed once (F.linear
    reorders it every call: the same bits)."""
    from kvsnap.cpu_kernels import linear_vectors
    from kvsnap.engine.models import packed

    weight = torch.randn(1 << 16, 64).bfloat16()
    head = LMHead(Head(weight), None, screen=True)
    if head.tiles or not (linear_vectors.takes(weight) or packed.can_pack(weight)):
        assert head.packed is None and head.few is None
        pytest.skip("AMX tiles take the first pass here, or there are no bf16 kernels")
    assert (head.few is None) != (head.packed is None)  # one copy, not two
    for rows in (1, 5, 8, 16, 40):
        hidden = torch.randn(rows, 64).bfloat16()
        got = head._first_pass(hidden)
        if head.few is None:
            assert torch.equal(got, torch.nn.functional.linear(hidden, weight)), rows
            continue
        exact = hidden.double() @ weight.double().T
        norms = weight.double().norm(dim=1)[None, :] * hidden.double().norm(dim=1)[:, None]
        bound = head.product_error * norms + 2.0**-8 * exact.abs() * 1.01  # the screen's model
        assert ((got.double() - exact).abs() <= bound).all(), rows
