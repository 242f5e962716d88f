"""Answers against bytes for every setting ``kvsnap calibrate`` swept, one panel a model: the
follow-ups each setting answered (x full KV's) over the bytes it held (x full KV's), dropping
rows (SnapKV, KVzap) and keeping them at 4 or 2 bits (mixed precision) told apart.

    .venv/bin/python bench/compression/calibrate_plot.py docs/results/calibrate_smollm2-135m.json \\
        docs/results/calibrate_gemma3-270m.json docs/results/calibrate_qwen2.5-coder-0.5b.json \\
        --out docs/results/calibrate_quality_memory.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = {"full KV": "C0", "snapkv, rest dropped": "C1", "kvzap, rest dropped": "C2",
          "mixed, rest at 4 bits": "C3", "mixed, rest at 2 bits": "C4"}  # fmt: skip


def kind(policy: str) -> str:
    """How a setting treats the rows it does not select."""
    if policy == "full":
        return "full KV"
    if policy.endswith(("/q4", "/q2")):
        return f"mixed, rest at {policy[-1]} bits"
    return f"{policy.partition(':')[0]}, rest dropped"


def points(result: dict) -> dict[str, list[tuple[float, float, str]]]:
    """Per kind, (bytes x full, follow-ups x full KV's, setting) of each row of the table."""
    full = next(r for r in result["table"] if r["policy"] == "full")
    out: dict[str, list] = {}
    for row in result["table"]:
        share = row["follow_ups"] / full["follow_ups"] if full["follow_ups"] else 0.0
        out.setdefault(kind(row["policy"]), []).append((row["bytes_x_full"], share, row["policy"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="calibrate results files")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(p).read_text()) for p in args.results]
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), sharey=True, squeeze=False)
    handles = {}
    for ax, result in zip(axes[0], results, strict=True):
        for label, pts in sorted(points(result).items()):
            pts.sort()
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=COLORS.get(label))
            handles.setdefault(label, line)
        ax.axhline(result["thresholds"]["follow_ups"], color="grey", linestyle=":", linewidth=1)
        name = result["model"].rsplit("/", 1)[-1]
        name = name[:-13] if len(name) > 13 and name[-13] == "-" else name  # a converted folder's hash
        ax.set_title(f"{name} ({result['sweep']['dtype'].split('.')[-1]})")
        ax.set_xlabel("KV held, x full KV's bytes")
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("follow-ups answered, x full KV's")
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="lower center", ncol=len(handles))
    fig.suptitle("kvsnap calibrate: answers against bytes (dotted: the follow-up bar)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
