"""Prefill and compression: a prompt goes onto a session's cache, then the session's policy
keeps the rows it scores best (SnapKV's observation window, a scored policy's own signal, or a
re-selection from the host-side full copy), and decode-time eviction gets its start.

A mixin of :class:`~.engine.Engine` (it reads the engine's model, device and layers).
"""

from __future__ import annotations

import time

import torch

from kvsnap.errors import InvalidArgument
from kvsnap.policies import FullKV, Policy, gather_rows, scored_policy, window_attention
from kvsnap.policies.kvzap import Surrogate, trained_for, weights_path

from .batch import Row
from .cache import CompressedLayer, export_kv, full_layer_indices, import_kv
from .capture import ReconstructionCapture, WindowCapture
from .cold import rest_kivi
from .prefix_rows import keys_for
from .session import Session
from .spans import layer_spans, span_ends
from .turn import Prefill, Timer

RESELECT_CHUNK = 4096  # rows of the host-side full cache moved to the device at a time for scoring


class Compression:
    """The prefill and compression half of :class:`~.engine.Engine`."""

    def prefill(self, session: Session, tokens: list[int], timer: Timer | None = None) -> torch.Tensor:
        """Prefill pending + ``tokens`` onto the cache, then compress. Returns next-token logits [V]."""
        job = Prefill(self, session, tokens, timer or Timer())
        while (logits := job.step(self.prefill_chunk)) is None:
            pass
        job.settle()
        return logits

    @torch.inference_mode()
    def after_prefill(self, job: Prefill) -> None:
        """The prompt is on the cache: compress it with the session's policy (or re-select from
        its full copy) and start decode-time eviction."""
        session, timer, captured = job.session, job.timer, job.capture
        if job.compress and session.policy.reselects and (job.first_turn or session.full_kv is not None):
            t0 = time.perf_counter()
            self._reselect(session, captured, job.window)
            elapsed = time.perf_counter() - t0
            timer.reselect_s += elapsed
            timer.compress_s += elapsed
        elif job.compress:  # also a reselect session that lost its full copy: plain SnapKV per turn
            t0 = time.perf_counter()
            self._compress(session, captured, job.new)
            timer.compress_s += time.perf_counter() - t0
        if job.decoder is not None:
            session.decoding = self._start_decoding(session, job.decoder, captured)
        elif self.prunes_answers(session.policy):  # KVzap with a threshold: the answer's rows are scored too
            session.decoding = {idx: None for idx in self.full_layers}

    def _compress(self, session: Session, captured: WindowCapture, new: list[int]) -> None:
        """Apply the session policy to every full-attention layer (the window = this turn's tail;
        a scored policy rates the turn's ``new`` rows by its own signal, see policies/scored.py)."""
        rest = rest_kivi(session.policy)  # the rows left out: dropped (None) or quantized by it
        scored = scored_policy(session.policy)
        if scored is not None:
            if scored.scored_by == "hidden":
                scores = {idx: torch.cat(captured.scores[idx], dim=-1)[None] for idx in captured.layers}
            else:
                scores = self._reconstruction_scores(session, new)
            spans = self.row_spans(scored, new)
            for idx, layer_scores in scores.items():
                layer: CompressedLayer = session.cache.layers[idx]
                positions = scored.keep_scored(layer_scores.to(layer.keys.device), layer.kept_len, spans=spans)
                if positions.shape[-1] < layer.kept_len:
                    layer.keep(positions, rest)
            return
        by_old: dict[int, torch.Tensor | None] = {}  # span ids by rows kept from earlier turns
        for idx in captured.layers:
            layer: CompressedLayer = session.cache.layers[idx]
            old_rows = layer.kept_len - len(new)
            if old_rows not in by_old:  # the same for every layer that kept as many rows: cut once
                by_old[old_rows] = self.row_spans(session.policy, new, old_rows=old_rows)
            spans = by_old[old_rows]
            scale = captured.scales.get(idx)
            keys = keys_for(layer, session.policy)  # shared prefix rows: read where they lie
            positions = session.policy.select(
                captured.queries[idx], keys, scale, logical_len=session.logical_len, spans=spans
            )
            if positions.shape[-1] < layer.kept_len:
                layer.keep(positions, rest)

    @torch.inference_mode()
    def _reconstruction_scores(self, session: Session, context: list[int]) -> dict[int, torch.Tensor]:
        """KVzip+ log scores ``[1, H_kv, n]`` per full-attention layer of the session's last
        ``n = len(context)`` rows (this turn's, on the cache, not yet compressed): a scratch
        pass of :data:`REPEAT_PROMPT` and the context again, on a copy of the cache that is then
        dropped (the session's cache, lengths and transcript are untouched)."""
        n = len(context)
        scratch = Session(
            session.session_id, FullKV(), "never", session.model_fingerprint,
            import_kv(self.model.config, export_kv(session.cache), session.logical_len),
        )  # fmt: skip
        scratch.logical_len = session.logical_len
        starts = {idx: session.cache.layers[idx].kept_len - n for idx in self.full_layers}
        capture = ReconstructionCapture(starts, n, skip=len(self.repeat_ids))
        tokens = self.repeat_ids + list(context)
        for start in range(0, len(tokens), self.prefill_chunk):
            self.step([Row(scratch, tokens[start : start + self.prefill_chunk], capture)])
        out = {}
        for idx, start in starts.items():
            values = session.cache.layers[idx].values[:, :, start : start + n]
            out[idx] = capture.scores(idx, values, self.attention[idx].o_proj.weight)
        return out

    def row_spans(self, policy: Policy, tokens: list[int], old_rows: int = 0) -> torch.Tensor | None:
        """Span ids of a layer's rows for a policy that keeps sentence spans (else None): ``old_rows``
        rows kept from earlier turns, a span each, then the rows of ``tokens`` (engine/spans.py)."""
        if not policy.keeps_spans:
            return None
        return layer_spans(self.span_table(), old_rows, tokens)

    def span_table(self) -> bytes:
        """Which tokens end a span (engine/spans.py), built on first use: 0.05-0.4 s on the
        embedded models' vocabularies, which a replica spends at start, not in a first turn."""
        if self._span_ends is None:
            self._span_ends = span_ends(self.tokenizer, self.vocab_size)
        return self._span_ends

    def surrogate(self, kind: str) -> Surrogate:
        """This model's KVzap surrogate of ``kind`` (policies/kvzap_weights/); InvalidArgument,
        naming the training command, when none was trained for it."""
        net = self.surrogates.get(kind)
        if net is None:
            path = weights_path(self.loaded.name, kind)
            train = f"train one: python bench/compression/train_kvzap.py --model {self.loaded.name}"
            if not path.exists():
                raise InvalidArgument(
                    f"no KVzap {kind} surrogate for model {self.loaded.name!r} ({path.name}); {train}"
                )
            if trained_for(path) != self.loaded.weights:
                raise InvalidArgument(f"the KVzap {kind} surrogate {path.name} was trained on another model; {train}")
            text = self.model.config.get_text_config()
            net = Surrogate.load(path, self.full_layers, text.hidden_size, text.num_key_value_heads, kind)
            self.surrogates[kind] = net.to(self.device)
        return net

    def _reselect(self, session: Session, captured: WindowCapture, window: int) -> None:
        """Keep every row in the host-side full copy; select this turn's rows from all of them.

        The rows added since the last selection (this turn's prompt, earlier answers) are
        appended to the full copy; SnapKV then scores the whole copy with this turn's window
        queries, RESELECT_CHUNK rows at a time, and the device cache gets just the selection.
        """
        full = session.full_kv if session.full_kv is not None else {}
        new = session.logical_len - session.full_len
        spans = self.row_spans(session.policy, session.transcript[: session.logical_len])  # the full copy's rows
        for idx in captured.layers:
            layer: CompressedLayer = session.cache.layers[idx]
            kept = layer.kept_len - new  # rows before these were selected earlier (all of them in the copy)
            rows_k, rows_v = (_to_host(t[:, :, kept:]) for t in (layer.keys, layer.values))  # [1, H_kv, new, D]
            old = full.get(idx)
            full_k, full_v = (rows_k, rows_v) if old is None else (_cat(old[0], rows_k), _cat(old[1], rows_v))
            full[idx] = (full_k, full_v)
            positions = session.policy.select(
                captured.queries[idx],
                full_k,
                captured.scales.get(idx),
                logical_len=session.logical_len,
                chunk=RESELECT_CHUNK,
                spans=spans,
            )  # [1, H_kv, k] on the device
            host_positions = positions.to(full_k.device)
            layer.keys = gather_rows(full_k, host_positions).to(self.device, non_blocking=True)
            layer.values = gather_rows(full_v, host_positions).to(self.device, non_blocking=True)
        session.full_kv, session.full_len = full, session.logical_len

    def _start_decoding(self, session: Session, decoder: Policy, captured: WindowCapture) -> dict[int, object]:
        """Each full-attention layer's decode-time eviction state, seeded with the observation
        window's attention over the rows the layer kept (the window is their tail)."""
        states = {}
        for idx in full_layer_indices(session.cache):
            layer: CompressedLayer = session.cache.layers[idx]
            attn = None
            if decoder.needs_attention:
                attn = window_attention(captured.queries[idx], layer.keys, captured.scales.get(idx)).mean(dim=2)
            states[idx] = decoder.start(attn, layer.kept_len)  # attn: [B, H_kv, w, kept]
        return states


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host-memory copy (pinned when a GPU is there, so copies back are asynchronous)."""
    host = t.detach().to("cpu", copy=True).contiguous()
    return host.pin_memory() if torch.cuda.is_available() else host


def _cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.cat([a, b], dim=-2)
    return out.pin_memory() if torch.cuda.is_available() else out
