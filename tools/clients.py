"""What the client verbs share (``kvsnap eval --url``, ``kvsnap load``): the API key, the
served model, its tokenizer, comma-separated flags."""

from __future__ import annotations

import os

from kvsnap.errors import InvalidArgument

DTYPES = (
    "auto",
    "bfloat16",
    "float32",
)  # engine/models/__init__.py DTYPE_CHOICES (the CLI does not import torch to parse)


def csv(kind):
    """An argparse type: comma-separated values of ``kind``."""
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def api_key(args) -> str:
    """The client's API key: --api-key, else KVSNAP_API_KEY (kvsnap eval --url, kvsnap load)."""
    api_key = args.api_key or os.environ.get("KVSNAP_API_KEY")
    if not api_key:
        raise InvalidArgument(f"--api-key (or KVSNAP_API_KEY) is needed for `kvsnap {args.command}`")
    return api_key


def served_model(url: str, api_key: str) -> str:
    import requests

    r = requests.get(f"{url.rstrip('/')}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    if r.status_code != 200:
        raise InvalidArgument(f"{url}/v1/models answered {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


def tokenizer(model: str):
    from kvsnap.engine.models import tokenizer_for

    return tokenizer_for(model)
