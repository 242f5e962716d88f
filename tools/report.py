"""What ``kvsnap eval`` reports: accuracy per task and policy (overall, per length, depth and
turn), the KV each policy holds, tables, the accuracy curves and the quality-versus-memory
picture (accuracy on the first turn and on follow-ups against KV bytes per session)."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

TURN_TASKS = ("multiturn", "docfirst", "facts")  # one question per turn: accuracy per turn


@dataclass(slots=True)
class TurnScore:
    task: str
    policy: str
    length: int
    seed: int
    turn: int
    depth: float
    correct: bool
    answer: str
    text: str
    latency_s: float
    context_tokens: int = 0
    kv_bytes: int = 0
    full_kv_bytes: int = 0
    copy_bytes: int = 0  # a re-selecting session's full copy, held in the host tier besides its KV


@dataclass(slots=True)
class GenScore:
    policy: str
    length: int
    seed: int
    tokens: int
    agreement: float  # share of generated tokens where the policy's top-1 equals full KV's token
    nll: float  # mean negative log-likelihood of full KV's tokens under the policy
    decode_tok_s: float
    kv_bytes: int  # KV held at the end (as a quantized tier holds it, for @kivi)
    full_kv_bytes: int
    kept_len_max: int  # most rows a full-attention layer held after any decoding step
    logical_len: int


def summarize(scores: list[TurnScore | GenScore]) -> dict:
    """Accuracy (0..1) per task and policy: overall, per length, per depth, per turn; KV held.
    Long generation: agreement with full KV, perplexity of its tokens, decode speed, KV held."""

    def acc(rows):
        return sum(r.correct for r in rows) / len(rows)

    groups = defaultdict(list)
    out = {}
    for s in scores:
        if isinstance(s, GenScore):
            groups[("longgen", s.policy)].append(s)
        else:
            groups[(s.task, s.policy)].append(s)
    for (task, policy), rows in list(groups.items()):
        if task == "longgen":
            out.setdefault(task, {})[policy] = {
                "agreement": statistics.mean(r.agreement for r in rows),
                "perplexity": math.exp(statistics.mean(r.nll for r in rows)),
                "tokens_mean": statistics.mean(r.tokens for r in rows),
                "decode_tok_s_median": statistics.median(r.decode_tok_s for r in rows),
                "kv_bytes_mean": statistics.mean(r.kv_bytes for r in rows),
                "full_kv_bytes_mean": statistics.mean(r.full_kv_bytes for r in rows),
                "kept_len_max": max(r.kept_len_max for r in rows),
                "per_length": {
                    str(k): statistics.mean(r.agreement for r in rows if r.length == k)
                    for k in sorted({r.length for r in rows})
                },
                "n": len(rows),
            }
            del groups[(task, policy)]
    for (task, policy), rows in groups.items():
        by = {key: defaultdict(list) for key in ("length", "depth", "turn")}
        for r in rows:
            by["length"][r.length].append(r)
            by["depth"][_depth_bin(r)].append(r)
            by["turn"][r.turn].append(r)
        last_turns = [r for r in rows if r.turn == max(x.turn for x in rows if x.seed == r.seed)]
        follow_ups = [r for r in rows if r.turn > 1]
        out.setdefault(task, {})[policy] = {
            "accuracy": acc(rows),
            "follow_up_accuracy": acc(follow_ups) if follow_ups else None,  # turns after the first
            "n": len(rows),
            "per_length": {str(k): acc(v) for k, v in sorted(by["length"].items())},
            "per_depth": {str(k): acc(v) for k, v in sorted(by["depth"].items())},
            "per_turn": {str(k): acc(v) for k, v in sorted(by["turn"].items())},
            "kv_bytes_mean": statistics.mean(r.kv_bytes for r in last_turns),
            "full_kv_bytes_mean": statistics.mean(r.full_kv_bytes for r in last_turns),
            "held_bytes_mean": statistics.mean(r.kv_bytes + r.copy_bytes for r in last_turns),  # what tiers hold
            "latency_s_median": statistics.median(r.latency_s for r in rows),
        }
    return out


def _depth_bin(score: TurnScore) -> str:
    """Pass-key depths are the ones asked for; planted-key depths are random: quarters of the document."""
    if score.task == "passkey":
        return f"{score.depth:g}"
    quarter = min(3, int(score.depth * 4))
    return f"{quarter / 4:.2f}-{(quarter + 1) / 4:.2f}"


def format_tables(summary: dict) -> str:
    lines = []
    for task, per_policy in summary.items():
        if task == "longgen":
            lines += _longgen_table(per_policy)
            continue
        first = next(iter(per_policy.values()))
        lengths = list(first["per_length"])
        turns = list(first["per_turn"]) if task in TURN_TASKS else []
        width = max(16, 2 + max(map(len, per_policy)))
        head = f"{'policy':{width}}{'acc':>7}" + "".join(f"{'L=' + k:>9}" for k in lengths)
        head += (
            "".join(f"{'turn ' + k:>9}" for k in turns) + (f"{'follow-ups':>11}" if turns else "") + f"{'KV MiB':>9}"
        ) + f"{'held MiB':>10}{'x full':>8}"
        title = "accuracy; KV at the end of a case, mean; held = KV + a re-selection's full copy"
        lines += ["", f"{task}  ({title})", head]
        for policy, s in per_policy.items():
            row = f"{policy:{width}}{s['accuracy']:>7.0%}" + "".join(f"{s['per_length'][k]:>9.0%}" for k in lengths)
            row += "".join(f"{s['per_turn'][k]:>9.0%}" for k in turns)
            row += (f"{s['follow_up_accuracy']:>11.0%}" if turns else "") + f"{s['kv_bytes_mean'] / 2**20:>9.2f}"
            row += f"{s['held_bytes_mean'] / 2**20:>10.2f}" + _share(s["held_bytes_mean"], s["full_kv_bytes_mean"])
            lines.append(row)
        lines.append(f"{'  by depth':{width}}" + "".join(f"{k:>11}" for k in first["per_depth"]))
        for policy, s in per_policy.items():
            lines.append(f"  {policy:{width - 2}}" + "".join(f"{v:>11.0%}" for v in s["per_depth"].values()))
    return "\n".join(lines)


def _share(part: float, whole: float) -> str:
    return f"{part / whole:>8.2f}" if whole else f"{'-':>8}"


def _longgen_table(per_policy: dict) -> list[str]:
    first = next(iter(per_policy.values()))
    tokens = first["tokens_mean"]
    width = max(16, 2 + max(map(len, per_policy)))
    head = f"{'policy':{width}}{'agree':>7}" + "".join(f"{'L=' + k:>9}" for k in first["per_length"])
    head += f"{'ppl':>8}{'tok/s':>8}{'rows max':>10}{'KV MiB':>9}{'full MiB':>10}"
    lines = ["", f"longgen  ({tokens:.0f} tokens written with full KV, read back by each policy)", head]
    for policy, s in per_policy.items():
        row = f"{policy:{width}}{s['agreement']:>7.1%}" + "".join(f"{v:>9.1%}" for v in s["per_length"].values())
        row += f"{s['perplexity']:>8.3f}{s['decode_tok_s_median']:>8.1f}{s['kept_len_max']:>10}"
        row += f"{s['kv_bytes_mean'] / 2**20:>9.2f}{s['full_kv_bytes_mean'] / 2**20:>10.2f}"
        lines.append(row)
    return lines


def plot(summary: dict, path: Path) -> bool:
    """Accuracy curves of the retrieval tasks; False when there are none to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = {task: v for task, v in summary.items() if task != "longgen"}  # a table, not a curve
    if not summary:
        return False
    fig, axes = plt.subplots(1, len(summary), figsize=(5 * len(summary), 3.8), squeeze=False)
    for ax, (task, per_policy) in zip(axes[0], summary.items(), strict=True):
        key = "per_turn" if task in TURN_TASKS else "per_length"
        for n, (policy, s) in enumerate(per_policy.items()):  # distinct markers: equal lines stay visible
            ax.plot(list(s[key]), [100 * v for v in s[key].values()], marker="os^vDxP*"[n % 8], label=policy,
                    markersize=9 - n, alpha=0.8)  # fmt: skip
        ax.set_title(task)
        ax.set_xlabel("turn" if key == "per_turn" else "context tokens")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_memory(summary: dict, path: Path, default: str | None = None) -> bool:
    """Quality against memory: per policy, accuracy on the first turn and on follow-ups against
    the KV a session holds (MiB, a re-selection's full copy included), one panel per task with
    turns; full KV and ``default`` (a policy label) marked. False when no task has turns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = {t: v for t, v in summary.items() if t in TURN_TASKS}
    if not tasks:
        return False
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.6), squeeze=False)
    for ax, (task, per_policy) in zip(axes[0], tasks.items(), strict=True):
        for policy, s in per_policy.items():
            mib = s["held_bytes_mean"] / 2**20
            later = s["follow_up_accuracy"]
            ax.scatter([mib], [100 * s["per_turn"]["1"]], marker="o", color="tab:blue", s=40)
            if later is not None:
                ax.scatter([mib], [100 * later], marker="^", color="tab:orange", s=40)
                ax.plot([mib, mib], [100 * s["per_turn"]["1"], 100 * later], color="0.8", lw=1, zorder=0)
            mark = " (full KV)" if policy == "full" else " (default)" if policy == default else ""
            weight = "bold" if mark else "normal"
            ax.annotate(policy + mark, (mib, 100 * s["per_turn"]["1"]), fontsize=7, weight=weight,
                        xytext=(4, 3), textcoords="offset points")  # fmt: skip
        ax.scatter([], [], marker="o", color="tab:blue", label="turn 1")
        ax.scatter([], [], marker="^", color="tab:orange", label="follow-ups")
        ax.set_title(f"{task}: accuracy against KV per session")
        ax.set_xlabel("KV held per session, MiB (mean, end of the conversation)")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def save(scores: list[TurnScore], summary: dict, meta: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "quality.json", "png": out_dir / "quality.png", "memory": out_dir / "memory.png"}
    paths["json"].write_text(
        json.dumps({"meta": meta, "summary": summary, "turns": [asdict(s) for s in scores]}, indent=1)
    )
    if not plot(summary, paths["png"]):
        del paths["png"]
    if not plot_memory(summary, paths["memory"], meta.get("default_policy")):
        del paths["memory"]
    return paths
