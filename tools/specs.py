"""Policy specs of ``kvsnap eval`` and ``kvsnap generate --decode``: a policy in a few
characters (``snapkv:256``, ``reselect:256``, ``snapkv:256+h2o:64@kivi2``), turned into the
session settings the API takes or the policy object the engine takes. The names are the
registered policies' (``kvsnap.policies.POLICIES``), a policy registered by a module of one's
own included."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvsnap.errors import InvalidArgument


def _spec_names() -> tuple[list[str], list[str]]:
    """The prefill and decode policy names a spec may use: every registered policy (a policy
    registered by a module of one's own too), and ``reselect`` (SnapKV re-selecting per turn)."""
    from kvsnap.policies import POLICIES, evictor_names

    return ["reselect", *sorted(n for n in POLICIES if n != "full")], evictor_names()


def _spec_pattern() -> re.Pattern:
    prefill, decode = _spec_names()
    return re.compile(
        rf"^(?P<policy>full|(?:{'|'.join(prefill)}):(?:(?P<budget>[1-9][0-9]*)|r(?P<ratio>0?\.[0-9]+)"
        r"|t(?P<tau>-?[0-9]+(?:\.[0-9]+)?))(?:/f(?P<floor>[1-9][0-9]*))?(?:/k(?P<kernel>[1-9][0-9]*))?"
        r"(?P<spans>/s)?(?:/q(?P<rest>[24]))?)"
        rf"(?:\+(?P<decode>{'|'.join(decode)}):(?P<decode_budget>[1-9][0-9]*))?"
        r"(?:@(?P<quant>kivi2|kivi4))?$"
    )


SINKS = 4  # streaming's attention sinks, here and as a decode-time policy


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy named on the command line: ``<prefill>[+<decode>:<budget>][@kivi2|@kivi4]``;
    a prefill budget may instead be ``r<share>`` (a share of the prefix: ``snapkv:r0.33``) or,
    for kvzip and kvzap, ``t<log score>`` (a threshold: ``kvzap:t-4``); ``/f<n>`` after a share or
    a threshold keeps at least n rows (``snapkv:r0.5/f512``: a prefix of 512 rows or fewer stays
    whole); ``/k<n>`` after that sets
    the pooling kernel of a policy that has one (``kvzip:r0.33/k1``: no pooling), and ``/s`` after
    that keeps sentence spans whole (``snapkv:r0.5/s``; snapkv, kvzip, kvzap); ``/q4`` or ``/q2``
    last keeps the rows the selection leaves out at 4 or 2 bits instead of dropping them
    (``snapkv:r0.25/s/q4``: mixed precision, engine/cold.py).

    Prefill: ``full`` | ``snapkv:B`` | ``reselect:B`` | ``streaming:B`` | ``h2o:B`` |
    ``scissorhands:B``. Each compressing one holds B + the observation window rows per KV
    head after prefill, a like-for-like comparison:

    - ``reselect:B`` is SnapKV with budget B that re-selects every turn from the full cache
      kept in the host tier (``recompress="reselect"``); ``snapkv:B`` re-selects from what it kept.
    - ``streaming:B`` keeps 4 sink rows and a recent window of B + window - 4 rows.
    - ``h2o:B`` / ``scissorhands:B``: B rows by their rule, plus the window as the recent rows;
      they also evict while decoding (capacity B + window).

    ``+h2o:D`` / ``+scissorhands:D`` / ``+streaming:D``: evict while decoding with that policy,
    capacity D + window (e.g. ``snapkv:256+h2o:128``). ``@kivi2`` / ``@kivi4``: the session's KV
    is KIVI-quantized between turns, as a quantized host tier stores it (in-process only; a
    service quantizes per deployment, ``kv_quant``). A first turn is never affected by it.
    """

    name: str
    policy: str
    budget: int = 0
    decode: str = ""
    decode_budget: int = 0
    quant: str = ""
    ratio: float | None = None  # ``snapkv:r0.33``: keep that share of the prefix instead of a budget
    tau: float | None = None  # ``kvzap:t-4``: keep the rows scoring above this log score (kvzip, kvzap)
    kernel: int | None = None  # ``kvzip:r0.33/k1``: the policy's pooling kernel instead of its default
    spans: bool = False  # ``snapkv:r0.5/s``: sentence spans kept whole (engine/spans.py)
    floor: int = 0  # ``snapkv:r0.5/f512``: a share keeps at least that many rows
    rest: str = ""  # ``snapkv:r0.25/q4``: the rows left out kept at 4 bits (kivi4), not dropped

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        m = _spec_pattern().match(text.strip())
        if m is None:
            prefill, decode = _spec_names()
            raise InvalidArgument(
                f"policy spec {text!r}: use full or <policy>:<budget> with policy one of {', '.join(prefill)}, "
                f"optionally +<decoder>:<budget> ({', '.join(decode)}) and @kivi2 or @kivi4"
            )
        policy = m["policy"].partition(":")[0]
        if m["ratio"] is not None and policy == "streaming":
            raise InvalidArgument(f"policy spec {text!r}: streaming keeps a fixed window, not a share (r<share>)")
        if m["tau"] is not None and policy not in ("kvzip", "kvzap"):
            raise InvalidArgument(f"policy spec {text!r}: a threshold (t<log score>) is for kvzip and kvzap only")
        if m["rest"] and policy == "reselect":
            raise InvalidArgument(f"policy spec {text!r}: reselect keeps every row in its full copy (no /q)")
        if m["floor"] and m["ratio"] is None and m["tau"] is None:
            raise InvalidArgument(f"policy spec {text!r}: a floor (/f<rows>) follows a share (r<share>) or a threshold")
        return cls(
            text.strip(),
            policy,
            int(m["budget"] or 0),
            m["decode"] or "",
            int(m["decode_budget"] or 0),
            m["quant"] or "",
            float(m["ratio"]) if m["ratio"] else None,
            float(m["tau"]) if m["tau"] is not None else None,
            int(m["kernel"]) if m["kernel"] else None,
            bool(m["spans"]),
            int(m["floor"] or 0),
            f"kivi{m['rest']}" if m["rest"] else "",
        )

    def settings(self, window: int) -> dict:
        """The session settings (as the API takes them) that realise this spec (``@kivi`` aside)."""
        from kvsnap.policies import policy_params

        if self.policy == "full":
            out = {"policy": "full"}
        elif self.policy in ("snapkv", "reselect"):  # the paper's pooling, spelled out: a service may differ
            recompress = "reselect" if self.policy == "reselect" else "per_turn"
            snapkv = {"policy": "snapkv", "budget": self.budget, "window": window, "kernel": 7, "pooling": "max"}
            out = snapkv | {"recompress": recompress}
        elif self.policy == "streaming":
            out = {"policy": "streaming", "window": self.budget + window - SINKS, "sinks": SINKS}
        else:  # h2o, scissorhands, kvzip, kvzap, and any registered policy with a budget and a window
            out = {"policy": self.policy, "budget": self.budget, "window": window}
        if self.ratio is not None or self.tau is not None:  # instead of the budget
            out.pop("budget", None)
            out |= {"ratio": self.ratio} if self.ratio is not None else {"tau": self.tau}
            if self.floor:
                out["floor"] = self.floor
        if self.kernel is not None:
            out["kernel"] = self.kernel
        if self.rest:
            out["rest"] = self.rest
        if self.policy != "full" and "spans" in policy_params(out["policy"]):
            out["spans"] = self.spans  # spelled out: a service's default may differ
        elif self.spans:
            raise InvalidArgument(f"policy spec {self.name!r}: {self.policy} keeps no sentence spans (/s)")
        if self.decode == "streaming":
            out["decode"] = {"policy": "streaming", "window": self.decode_budget + window - SINKS, "sinks": SINKS}
        elif self.decode:
            out["decode"] = {"policy": self.decode, "budget": self.decode_budget, "window": window}
        return out

    def build(self, window: int):
        """(policy, recompress, KIVI or None) for an in-process session."""
        from kvsnap.policies import make_policy
        from kvsnap.policies.kivi import parse_kivi

        settings = self.settings(window)
        recompress = settings.pop("recompress", "per_turn")
        return make_policy(settings.pop("policy"), **settings), recompress, parse_kivi(self.quant)


def spec_text(settings: dict) -> str:
    """The spec that realises session ``settings`` (a model's defaults, kvsnap.engine.defaults):
    ``{"policy": "kvzap", "ratio": 0.5, "floor": 512, "spans": True}`` -> ``kvzap:r0.5/f512/s``.
    The window is the eval's own (``--window``); settings a spec cannot say raise InvalidArgument."""
    rest = dict(settings)
    policy, recompress = rest.pop("policy"), rest.pop("recompress", "per_turn")
    rest.pop("window", None)
    if policy == "full":
        return "full"
    if recompress == "reselect" and policy == "snapkv":
        policy = "reselect"
    elif recompress != "per_turn":
        raise InvalidArgument(f"no policy spec says recompress={recompress!r}")
    if policy in ("snapkv", "reselect") and rest.pop("pooling", "max") != "max":
        raise InvalidArgument("a policy spec pools by max only")
    size = f"r{rest.pop('ratio')}" if "ratio" in rest else f"t{rest.pop('tau')}" if "tau" in rest else None
    budget = rest.pop("budget", None)
    text = f"{policy}:{size or budget}"
    floor = rest.pop("floor", 0)
    if floor and size is not None:
        text += f"/f{floor}"
    elif floor:
        rest["floor"] = floor  # a floor without a share: no spec says it
    kernel = rest.pop("kernel", None)
    if kernel is not None and not (policy in ("snapkv", "reselect") and kernel == 7):
        text += f"/k{kernel}"
    if rest.pop("spans", False):
        text += "/s"
    if (kept := rest.pop("rest", "drop")) != "drop":
        text += f"/q{kept[-1]}"
    if rest or (size is None and budget is None):
        raise InvalidArgument(f"no policy spec says {settings}")
    return text
