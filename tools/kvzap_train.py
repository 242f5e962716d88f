"""Training KVzap surrogates here, from text on this machine (no downloads).

For each text the model prefills it with full KV while every full-attention layer's attention
input is recorded, then the engine's KVzip+ scratch pass (``Engine._reconstruction_scores``,
the same code the ``kvzip`` policy runs) rates every row: (attention input, log score) pairs,
a sample of ``per_text`` rows per text. Per layer a linear map (ridge, closed form) and a
2-layer MLP (hidden width D/8, GELU, Adam) learn to predict the log scores of the ``H_kv``
heads; R² per layer is measured on held-out texts (never trained on).

Texts: docstrings of the Python packages installed here (the standard library, torch,
transformers, ...), cut to ``tokens``-long pieces, and the project's own synthetic
long-context tasks (pass-key and multi-key documents).
"""

from __future__ import annotations

import ast
import random
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvsnap.engine import Engine
from kvsnap.engine.batch import Row
from kvsnap.engine.session import Session
from kvsnap.policies import FullKV
from kvsnap.policies.kvzap import SURROGATES, Surrogate

DOC_PACKAGES = ("json", "asyncio", "email", "http", "torch", "transformers", "pydantic", "redis", "ray")


def docstring_texts(max_files: int = 400, seed: int = 0) -> list[str]:
    """Docstrings of installed modules (one text per file, in a stable shuffled order)."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files: list[Path] = []
    for name in DOC_PACKAGES:
        for root in roots:
            base = root / name
            if base.is_dir():
                files += sorted(base.rglob("*.py"))[:200]
    random.Random(seed).shuffle(files)
    texts = []
    for path in files[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        docs = [
            ast.get_docstring(node)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        text = "\n\n".join(d for d in docs if d and len(d) > 40)
        if len(text) > 400:
            texts.append(text)
    return texts


def corpus(tokenizer, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` token sequences of about ``tokens`` tokens, each starting as a session's first turn
    does (the tokenizer's special tokens, e.g. BOS: the attention sink is a row like any
    other): docstring pieces, every fourth one a synthetic pass-key or multi-key document."""
    from kvsnap.tools.tasks import multi_key_prompt, pass_key_prompt

    pieces, out = iter(docstring_texts(seed=seed)), []
    start = list(tokenizer.encode("", add_special_tokens=True))  # what a first turn starts with
    buffer: list[int] = []
    while len(out) < n:
        if len(out) % 4 == 3:
            i = len(out)
            made = pass_key_prompt(tokenizer, tokens, seed=seed + i) if i % 8 == 3 else None
            doc = made.document if made else multi_key_prompt(tokenizer, tokens, keys=4, seed=seed + i).document
            out.append((start + list(tokenizer.encode(doc, add_special_tokens=False)))[:tokens])
            continue
        while len(buffer) < tokens:
            text = next(pieces, None)
            if text is None:
                raise RuntimeError(f"ran out of docstrings after {len(out)} texts")
            buffer += list(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        out.append((start + buffer)[:tokens])
        buffer = buffer[tokens - len(start) :]
    return out


class _Inputs:
    """A capture that keeps every full-attention layer's attention input ``[t, D]`` of a prefill."""

    wants_hidden = True

    def __init__(self, layers: list[int]):
        self.layers, self.hidden = set(layers), {i: [] for i in layers}

    def add_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        if layer_idx in self.layers:
            self.hidden[layer_idx].append(hidden.float().cpu())

    def add(self, *args, **kwargs) -> None:  # queries: not needed
        pass


@torch.inference_mode()
def attention_inputs(engine: Engine, tokens: list[int]) -> tuple[Session, dict[int, torch.Tensor]]:
    """A full-KV session that prefilled ``tokens``, and per full-attention layer the attention
    inputs ``[n, D]`` of its rows (what a surrogate reads)."""
    session = engine.new_session(FullKV())
    inputs = _Inputs(engine.full_layers)
    for start in range(0, len(tokens), engine.prefill_chunk):
        engine.step([Row(session, tokens[start : start + engine.prefill_chunk], inputs)])
    session.transcript.extend(tokens)
    return session, {i: torch.cat(inputs.hidden[i]) for i in engine.full_layers}


@torch.inference_mode()
def pairs(engine: Engine, tokens: list[int]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Per full-attention layer: the attention inputs ``[n, D]`` of a text's rows and their
    KVzip+ log scores ``[n, H_kv]``."""
    session, x = attention_inputs(engine, tokens)
    scores = engine._reconstruction_scores(session, tokens)
    y = {i: scores[i][0].t().float().cpu() for i in engine.full_layers}
    return x, y


@dataclass
class Dataset:
    x: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    y: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, x: dict[int, torch.Tensor], y: dict[int, torch.Tensor], rows: torch.Tensor) -> None:
        for i in x:
            self.x.setdefault(i, []).append(x[i][rows])
            self.y.setdefault(i, []).append(y[i][rows])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.x[i]), torch.cat(self.y[i])


def collect(engine: Engine, texts: list[list[int]], per_text: int, seed: int = 0, log=None) -> Dataset:
    """``per_text`` random rows of each text (all of a shorter one), as (input, log score) pairs."""
    data, gen = Dataset(), torch.Generator().manual_seed(seed)
    for n, tokens in enumerate(texts):
        x, y = pairs(engine, tokens)
        rows = torch.randperm(len(tokens), generator=gen)[:per_text]
        data.add(x, y, rows)
        if log:
            log(f"text {n + 1}/{len(texts)}: {len(tokens)} tokens")
    return data


def fit_linear(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-2) -> torch.nn.Linear:
    """Least squares with a small ridge, closed form (the features centred, a bias fitted)."""
    mean_x, mean_y = x.mean(0), y.mean(0)
    xc, yc = x - mean_x, y - mean_y
    gram = xc.t() @ xc + ridge * len(x) * torch.eye(x.shape[1])
    weight = torch.linalg.solve(gram, xc.t() @ yc)  # [D, H_kv]
    layer = torch.nn.Linear(x.shape[1], y.shape[1])
    with torch.no_grad():
        layer.weight.copy_(weight.t())
        layer.bias.copy_(mean_y - mean_x @ weight)
    return layer


def fit_mlp(x: torch.Tensor, y: torch.Tensor, epochs: int = 200, seed: int = 0) -> torch.nn.Module:
    """Linear -> GELU -> Linear (hidden width D/8), Adam on the mean squared error, full batch
    on standardised inputs folded back into the first layer."""
    torch.manual_seed(seed)
    dim, heads = x.shape[1], y.shape[1]
    net = Surrogate([0], dim, heads, "mlp").nets["0"]
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    xs = (x - mean) / std
    with torch.no_grad():
        net[2].bias.copy_(y.mean(0))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-4)
    with torch.enable_grad():
        for _ in range(epochs):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(xs), y)
            loss.backward()
            opt.step()
    with torch.no_grad():  # net(xs) == net'(x): fold the standardisation into the first layer
        first = net[0]
        first.bias.sub_((first.weight / std) @ mean)
        first.weight.div_(std)
    return net


def r2(pred: torch.Tensor, y: torch.Tensor) -> float:
    """Coefficient of determination over every (row, head), each head around its own mean."""
    sse = ((pred - y) ** 2).sum()
    sst = ((y - y.mean(0)) ** 2).sum()
    return float(1 - sse / sst)


def threshold_for(nets: dict, data: Dataset, share: float, kind: str = "linear") -> float:
    """The log-score threshold above which the ``kind`` surrogate keeps about ``share`` of the
    rows of ``data`` (all layers and heads together): a kvzap ``tau`` that lands on a given
    compression."""
    with torch.no_grad():
        predicted = torch.cat([nets[kind](i, data.layer(i)[0]).flatten() for i in data.x])
    return float(torch.quantile(predicted, 1 - share))


def train(engine: Engine, train_set: Dataset, test_set: Dataset, epochs: int = 200) -> tuple[dict, dict]:
    """Both surrogates of every full-attention layer; (surrogates by kind, R² by kind and layer
    on the held-out set, beside a constant predictor's)."""
    text = engine.model.config.get_text_config()
    nets = {k: Surrogate(engine.full_layers, text.hidden_size, text.num_key_value_heads, k) for k in SURROGATES}
    report: dict = {k: {} for k in (*SURROGATES, "constant")}
    for i in engine.full_layers:
        x, y = train_set.layer(i)
        xt, yt = test_set.layer(i)
        fitted = {"linear": fit_linear(x, y), "mlp": fit_mlp(x, y, epochs)}
        for kind, module in fitted.items():
            nets[kind].nets[str(i)].load_state_dict(module.state_dict())
            with torch.no_grad():
                report[kind][i] = r2(module(xt), yt)
        report["constant"][i] = r2(y.mean(0).expand_as(yt), yt)
    return nets, report


def main_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
