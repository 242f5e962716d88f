"""``kvsnap eval`` through a running service, in one command: a fresh local service on the model's
own defaults (bench/harness/service.py: its own Ray, embedded Redis and Serve app, 2 worker replicas),
then ``kvsnap eval --url`` against it with the arguments given, then the service stopped.

What the issue of the fact-retrieval defaults asks besides the in-process sweep: multi-key
retrieval through the service's ``/v1/completions`` (``x-session-id``), the old defaults
against the new. The eval names a policy by spec (``default`` = the model's defaults), so each
session's settings are spelled out; the service's own defaults answer whatever a spec leaves out.

Usage: python bench/service/service_eval.py --model gemma3-270m -- --tasks multikey --lengths 2048,4096 \\
           --policies full,reselect:512/s,default --out docs/results/multikey-service-gemma3-270m
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness

from harness.service import KEY, in_own_ray

from kvsnap.service.config import PolicyDefaults

KVSNAP = str(Path(sys.executable).with_name("kvsnap"))


def run_eval(cfg, eval_args: list[str]) -> int:
    cmd = [KVSNAP, "eval", "--url", f"http://127.0.0.1:{cfg.http_port}", *eval_args]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env={**os.environ, "KVSNAP_API_KEY": KEY}, check=False).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("eval_args", nargs=argparse.REMAINDER, help="after --: kvsnap eval's own arguments")
    args = ap.parse_args()
    eval_args = args.eval_args[1:] if args.eval_args[:1] == ["--"] else args.eval_args
    # the model's defaults, not the harness's fixed ones; answers up to the eval's own length
    rc = in_own_ray(run_eval, eval_args, model=args.model, defaults=PolicyDefaults())
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
