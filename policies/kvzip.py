"""KVzip+ (the oracle of query-agnostic compression): rows rated by a scratch reconstruction pass.

The engine runs the pass (``Engine._reconstruction_scores``) right after the turn's prompt is
on the cache; see :mod:`.scored` for the score and for which rows stay. It costs a second
prefill of the turn's tokens (the context repeated) and leaves the session's cache, transcript
and logs exactly as they were: the pass runs on a copy of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scored import ScoredPolicy

# what the scratch pass asks before the context comes again (KVzip's "repeat" prompt)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


@dataclass(frozen=True, slots=True)
class KVzip(ScoredPolicy):
    name = "kvzip"
    scored_by = "reconstruction"
