"""Service overhead of this tree against another commit, side by side in one run.

Builds the other commit in a git worktree with a virtualenv of its own (``make install``
there), then runs ``bench/service/overhead_bench.py``'s overhead phase (a 4-token turn on a held
session: in-process, HTTP and gRPC, median of --reps, on kvsnap serve's data path; in a tree
from before bench/ had groups, ``bench/service_bench.py``'s) from each tree in turn,
alternating which goes first, for --rounds rounds. Each phase runs in its own child process
with its own local Ray, embedded Redis and Serve app. The result is the median over rounds of
each tree's added milliseconds (HTTP, gRPC) and their difference.

Usage: python bench/service/ab_overhead.py --base <commit> [--rounds 3] [--reps 30] [--out FILE]
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.cli import RESULTS, ROOT, options, write_json
from harness.service import run_phase_process  # (it sets kvsnap serve's data path for both trees' children)

# the overhead phase's script in a tree: where it is now, where it was before bench/ had groups
OVERHEAD_SCRIPTS = ("bench/service/overhead_bench.py", "bench/service_bench.py")


def build(base: str, where: Path) -> Path:
    """A worktree of ``base`` with its own virtualenv; returns its python."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), base], check=True)
    subprocess.run(["make", "-C", str(where), "install"], check=True, stdout=subprocess.DEVNULL)
    return where / ".venv" / "bin" / "python"


def overhead(python: Path, tree: Path, reps: int) -> dict:
    """One run of the tree's overhead phase (its own child process, Ray and Serve app)."""
    script = next(tree / path for path in OVERHEAD_SCRIPTS if (tree / path).exists())
    return run_phase_process(script, "overhead", [f"--reps={reps}"], 1800, python=python, cwd=tree)


def main() -> None:
    ap = options(__doc__, rounds=3, reps=30, whole_doc=True)
    ap.add_argument("--base", required=True, help="the commit to compare against (e.g. main before a change)")
    ap.add_argument("--out", default=str(RESULTS / "ab_service.json"))
    args = ap.parse_args()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    base = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], capture_output=True, text=True, check=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvsnap-ab-"))
    trees = {"base": None, "head": (Path(sys.executable), ROOT)}
    try:
        trees["base"] = (build(base.stdout.strip(), scratch / "base"), scratch / "base")
        runs: dict[str, list[dict]] = {"base": [], "head": []}
        for r in range(args.rounds):
            for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
                result = overhead(*trees[name], args.reps)
                runs[name].append(result)
                print(
                    f"round {r + 1} {name}: HTTP +{result['http_added_ms']:.1f} ms, "
                    f"gRPC +{result['grpc_added_ms']:.1f} ms",
                    flush=True,
                )
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(scratch / "base")], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {
        name: {k: statistics.median(run[k] for run in rs) for k in ("http_added_ms", "grpc_added_ms")}
        for name, rs in runs.items()
    }
    summary["head_minus_base_ms"] = {k: summary["head"][k] - summary["base"][k] for k in summary["head"]}
    report = {"args": vars(args), "base": base.stdout.strip(), "head": head, "summary": summary, "runs": runs}
    write_json(args.out, report)
    print(f"median of {args.rounds} rounds (added to in-process, tiny-llama, 4-token turn):")
    for name in ("base", "head"):
        s = summary[name]
        print(f"  {name}: HTTP +{s['http_added_ms']:.1f} ms, gRPC +{s['grpc_added_ms']:.1f} ms")
    d = summary["head_minus_base_ms"]
    print(f"  head - base: HTTP {d['http_added_ms']:+.1f} ms, gRPC {d['grpc_added_ms']:+.1f} ms; wrote {args.out}")


if __name__ == "__main__":
    main()
