"""A session: its compressed KV cache, its two lengths and its token transcript."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from kvsnap.errors import InvalidArgument
from kvsnap.policies import Policy, Reselect, scored_policy

from .cache import cache_bytes, full_cache_bytes, kept_len

# What a turn after the first does to a compressed session:
#   per_turn  re-select from the rows kept so far, with this turn's tokens as the window
#   never     keep the first selection (new rows are appended)
#   reselect  keep every row of the full-attention layers in host memory as well, and select
#             this turn's rows afresh from all of them: the policy wrapped in Reselect
#             (policies/reselect.py), re-selecting per turn
RECOMPRESS_MODES = ("per_turn", "never", "reselect")


def resolve_recompress(policy: Policy, recompress: str) -> tuple[Policy, str]:
    """The session's policy and mode for a requested ``recompress``: "reselect" becomes the
    Reselect wrapper around ``policy`` (mode per_turn). InvalidArgument for an unknown mode or
    one the policy cannot follow."""
    if recompress not in RECOMPRESS_MODES:
        raise InvalidArgument(f"recompress must be one of {list(RECOMPRESS_MODES)}, got {recompress!r}")
    if recompress == "reselect":
        if scored_policy(policy) is not None:
            raise InvalidArgument(
                f"policy {scored_policy(policy).name!r} scores each row once, without a question: "
                "recompress 'reselect' (re-scoring a full copy by each turn's question) does not apply"
            )
        return (policy if policy.reselects else Reselect(inner=policy)), "per_turn"
    return policy, recompress


@dataclass(slots=True)
class TurnMark:
    """Where one turn sits in the session's token log, so that a rebuild replays it as it ran.

    A compressed session's cache depends on where each turn's compression happened (its
    observation window is that turn's tail), so the log keeps each turn's boundaries: the
    tokens it prefilled, the tokens it generated, and how many tokens its KV held at its end
    (the last generated token is pending unless the turn ended on EOS)."""

    prompt: int  # tokens the turn added before generating (prefilled after the pending ones)
    generated: int  # tokens it generated, right after its prompt in the log
    logical_len: int  # tokens in the KV when the turn ended
    reselected: bool = True  # a Reselect policy's turn: selected from a full copy (False: it had none)
    stopped_on: str = ""  # the stop string the answer ended on ("" when none did)
    messages: int = -1  # messages the turn added to the session's message log (-1: not known)

    def to_list(self) -> list:
        return [self.prompt, self.generated, self.logical_len, int(self.reselected), self.stopped_on, self.messages]

    @classmethod
    def from_list(cls, values: list) -> TurnMark:
        prompt, generated, logical_len, reselected = (int(v) for v in values[:4])
        stopped_on = str(values[4]) if len(values) > 4 else ""
        return cls(
            prompt, generated, logical_len, bool(reselected), stopped_on, int(values[5]) if len(values) > 5 else -1
        )


def marks_cover(marks: list[TurnMark], transcript_len: int) -> bool:
    """True when ``marks`` account for every token of a transcript of that length."""
    return bool(marks) and sum(m.prompt + m.generated for m in marks) == transcript_len


@dataclass(slots=True)
class TurnReport:
    """What one turn cost and what it left behind."""

    prompt_tokens: int  # tokens prefilled this turn (the new message plus the previous answer's last token)
    generated_tokens: int
    logical_len: int  # tokens the session has seen, after the turn
    kept_len: int  # rows a full-attention layer holds, after the turn
    kv_bytes: int  # bytes of KV held
    full_kv_bytes: int  # bytes full KV would hold for the same transcript
    prefill_s: float
    compress_s: float
    decode_s: float
    ttft_s: float  # turn start to first generated token (0 if nothing was generated)
    reselect_s: float = 0.0  # re-selection from the full cache (a Reselect policy), part of the prefill
    queue_s: float = 0.0  # waiting for a place in the worker's batch (continuous batching), before the prefill
    replayed_tokens: int = 0  # tokens replayed to take the session back to a turn boundary first (a rewind)
    cached_tokens: int = 0  # of prompt_tokens, those whose rows came from a shared prefix (engine/prefixes.py)

    @property
    def compression_ratio(self) -> float:
        return self.full_kv_bytes / self.kv_bytes if self.kv_bytes else 1.0


@dataclass(slots=True)
class Session:
    """One conversation's state on a worker.

    ``transcript`` holds every token (prompts and generated answers). The KV cache
    holds the first ``logical_len`` of them; the rest (normally the last generated
    token) are ``pending`` and are prefilled at the start of the next turn.
    """

    session_id: str
    policy: Policy
    recompress: str
    model_fingerprint: str
    cache: DynamicCache
    transcript: list[int] = field(default_factory=list)
    logical_len: int = 0
    turns: int = 0
    reports: list[TurnReport] = field(default_factory=list)
    marks: list[TurnMark] = field(default_factory=list)  # one per turn: the replay plan of a rebuild
    # a Reselect policy: every row of each full-attention layer (index -> keys, values, each
    # [1, H_kv, full_len, D]) in host memory; None = no full copy (plain SnapKV per turn)
    full_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    full_len: int = 0  # positions the full copy covers
    # decode-time eviction state of this turn, per full-attention layer (policy.decoder(); not stored)
    decoding: dict[int, object] = field(default_factory=dict)
    # the tenant whose shared prefixes the first turn may start from and adds to (engine/prefixes.py);
    # None: it neither reads nor adds any (not stored: only a first turn uses it)
    prefix_scope: str | None = None

    def __post_init__(self) -> None:
        self.policy, self.recompress = resolve_recompress(self.policy, self.recompress)

    @property
    def pending(self) -> list[int]:
        return self.transcript[self.logical_len :]

    @property
    def kept_len(self) -> int:
        return kept_len(self.cache)

    @property
    def kv_bytes(self) -> int:
        return cache_bytes(self.cache)

    @property
    def full_copy_bytes(self) -> int:
        """Host bytes of the full copy kept for re-selection (0 without one)."""
        return sum(t.numel() * t.element_size() for kv in (self.full_kv or {}).values() for t in kv)

    @property
    def full_kv_bytes(self) -> int:
        return full_cache_bytes(self.cache, self.logical_len)
