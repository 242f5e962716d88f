"""A benchmark's command line and what it writes: its options (the usual ones by name, with
their usual defaults), its JSON results file, and where and how it ran."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"  # the default home of results files (git ignores the JSON there)
DOCS_RESULTS = ROOT / "docs" / "results"  # the results the docs cite

USUAL = {  # the options most benchmarks take, with their usual defaults
    "model": "gemma3-270m",
    "models": "smollm2-135m,gemma3-270m",
    "tokens": 2048,
    "short": 64,
    "sessions": 8,
    "steps": 8,
    "reps": 3,
    "threads": 2,
    "out": None,
}


def options(doc: str, *usual: str, whole_doc: bool = False, **defaults) -> argparse.ArgumentParser:
    """The parser of a benchmark that ``doc`` describes (its first paragraph; ``whole_doc``: all
    of it, as written): ``--NAME`` for each of ``usual`` (:data:`USUAL`'s default unless
    ``defaults`` gives another) and for each further name of ``defaults``, in that order. An
    option's type is its default's (text for ``None``); underscores become dashes."""
    if whole_doc:
        parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for name in (*usual, *(k for k in defaults if k not in usual)):
        value = defaults[name] if name in defaults else USUAL[name]
        parser.add_argument(f"--{name.replace('_', '-')}", type=None if value is None else type(value), default=value)
    return parser


def step_options(doc: str) -> argparse.ArgumentParser:
    """The options of a decode-step benchmark: --sessions full-KV sessions on --short and --tokens
    token caches, --steps steps a measure, the cases alternating --reps times."""
    return options(doc, "models", "tokens", "short", "sessions", "steps", "reps", "threads", "out", steps=6, reps=4)


def write_json(path: str | Path | None, report: dict, indent: int = 2) -> Path | None:
    """``report`` as JSON at ``path`` (its folder made if need be); nothing when ``path`` is None."""
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent) + "\n")
    return path


def command_line() -> str:
    """This run's command (the interpreter's name, the script and its arguments)."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def started() -> str:
    """Now, in UTC, as a results file stamps its start."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def commit() -> str:
    """The checkout's commit, short ("" outside git)."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH)
        return done.stdout.strip()
    except OSError:
        return ""


def machine() -> str:
    """The CPU architecture, torch's threads and version."""
    import torch

    return f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"
