"""docs/ARCHITECTURE.md matches the code: every path it names exists (files and folders of this
repository, written as `folder/file.py` or `folder/`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
TOPS = "|".join(map(re.escape, TOP))
PATH = re.compile(rf"(?<![\w./-])((?:{TOPS})/[\w./-]*)")


def named_paths(text: str) -> set[str]:
    """The repository paths ``text`` names, without a trailing dot or a ``<placeholder>``."""
    return {m.rstrip(".") for m in PATH.findall(text) if "<" not in m and "*" not in m}


def test_every_path_architecture_names_exists():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paths = named_paths(text)
    assert len(paths) > 30  # it names the house, room by room
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_the_check_finds_a_missing_path():
    assert named_paths("see `engine/nowhere.py` and engine/turn.py.") == {"engine/nowhere.py", "engine/turn.py"}
