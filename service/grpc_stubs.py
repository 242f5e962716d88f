"""Python stubs for ``proto/kvsnap.proto``, generated on first import (and by ``make proto``).

The generated modules live in ``service/_generated/`` (git-ignored) and are
regenerated whenever the .proto file changes (its hash is part of the folder name).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
from pathlib import Path

import kvsnap.proto

PROTO = Path(kvsnap.proto.__file__).resolve().parent / "kvsnap.proto"


def _generate() -> Path:
    digest = hashlib.sha256(PROTO.read_bytes()).hexdigest()[:12]
    out = Path(__file__).resolve().parent / "_generated" / digest
    if not (out / "kvsnap_pb2_grpc.py").exists():
        from grpc_tools import protoc

        tmp = out.with_name(f"{digest}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        code = protoc.main(
            ["protoc", f"-I{PROTO.parent}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO)]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
        with contextlib.suppress(OSError):  # another process generated it concurrently
            tmp.rename(out)
    return out


def _load(name: str, folder: Path):
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_folder = _generate()
pb2 = sys.modules.get("kvsnap_pb2") or _load("kvsnap_pb2", _folder)
pb2_grpc = sys.modules.get("kvsnap_pb2_grpc") or _load("kvsnap_pb2_grpc", _folder)

if __name__ == "__main__":
    print(_folder)
