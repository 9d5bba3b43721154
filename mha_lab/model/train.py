"""Training the course's model: ``python -m mha_lab train`` and the weights it committed.

Stages (each writes ``NAME.npz`` float16 weights and ``NAME.json``, its log, into ``--out``):

- ``pretrain``: the base model and the same model with gpt-oss's sink logits, from scratch,
  on random windows of the corpus that each open with the start token;
- ``long``: a short fine-tune of the base at 4x the training length for each RoPE scaling;
- ``gqa``: the base's two K/V heads per layer mean-pooled into one, then a short uptraining.

The log holds the exact command, the corpus's SHA-256, every step's loss and the weights'
SHA-256; ``tests/test_model.py`` replays the first steps and checks the hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from mha_lab.model import WEIGHTS, corpus
from mha_lab.model.transformer import SCALINGS, ByteLM, Config, Rope, pool_kv_heads

__all__ = ["WEIGHTS", "PRETRAIN", "VARIANTS", "lr_at", "train_steps", "pretrain", "validation_loss", "save",
           "load", "sha256", "main"]

PRETRAIN = {"steps": 500, "batch": 16, "lr": 3e-3, "warmup": 30, "seed": 0}
"""Pretraining's recipe: AdamW (betas 0.9, 0.95, weight decay 0.01), linear warm-up, cosine decay to lr/10,
gradients clipped at norm 1; ``batch`` windows of ``Config.train_len`` tokens a step."""
VARIANTS = {"base": Config(), "sink-logit": Config(sink_logit=True)}
LONG = {"factor": 4, "steps": 40, "batch": 2, "lr": 1e-3, "warmup": 10, "seed": 3}
"""The long-context fine-tune: windows of ``factor`` x the training length, RoPE scaled by ``factor``;
only the attention projections and the norms learn (positions act nowhere else), so a variant
stores 0.2 M numbers, not 0.76 M."""
GQA = {"num_kv_heads": 1, "steps": 30, "batch": 16, "lr": 3e-4, "warmup": 5, "seed": 2}
"""The GQA uptraining: 6% of pretraining's steps (the GQA paper uptrains for 5%), at pretraining's final
rate."""
VALID_WINDOWS = 64


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    r"""Linear warm-up over ``warmup`` steps, then cosine decay to lr/10 at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_steps(model: ByteLM, params: Iterable[torch.nn.Parameter], batches: Callable[[], np.ndarray],
                steps: int, lr: float, warmup: int, rope: Rope | None = None,
                report: Callable[[int, float], None] | None = None) -> list[float]:
    """Run ``steps`` AdamW steps on ``batches()``; returns every step's training loss (nats per byte)."""
    params = list(params)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    losses = []
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = model.loss(torch.from_numpy(batches()), rope=rope)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if report is not None:
            report(step, losses[-1])
    model.eval()
    return losses


def pretrain(cfg: Config, steps: int, batch: int, lr: float, warmup: int, seed: int,
             report: Callable[[int, float], None] | None = None) -> tuple[ByteLM, list[float]]:
    """A fresh model (``torch.manual_seed(seed)``) trained on windows drawn by ``default_rng(seed)``."""
    torch.manual_seed(seed)
    model = ByteLM(cfg)
    rng = np.random.default_rng(seed)
    tokens = corpus.stream("train")
    losses = train_steps(model, model.parameters(), lambda: corpus.sample_windows(tokens, rng, batch, cfg.train_len),
                         steps, lr, warmup, report=report)
    return model, losses


@torch.no_grad()
def validation_loss(model: ByteLM, length: int | None = None, rope: Rope | None = None,
                    windows: int = VALID_WINDOWS) -> float:
    """Mean loss on ``windows`` held-out windows of ``length`` (default the training length), drawn with seed 1."""
    length = model.cfg.train_len if length is None else length
    batch = corpus.sample_windows(corpus.stream("valid"), np.random.default_rng(1), windows, length)
    return float(np.mean([float(model.loss(torch.from_numpy(b), rope=rope)) for b in np.array_split(batch, 8)]))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(model: ByteLM, name: str, log: dict, out: Path, only: Callable[[str], bool] | None = None) -> dict:
    """Write ``name.npz`` (float16; the parameters ``only`` selects, all by default) and ``name.json``."""
    out.mkdir(parents=True, exist_ok=True)
    arrays = {n: a for n, a in model.state_arrays().items() if only is None or only(n)}
    np.savez(out / f"{name}.npz", **arrays)
    log = {**log, "weights": f"{name}.npz", "sha256": sha256(out / f"{name}.npz"),
           "parameters_stored": int(sum(a.size for a in arrays.values()))}
    (out / f"{name}.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def load(name: str, folder: Path = WEIGHTS) -> ByteLM:
    """The stored model ``name``: its config from the log; a fine-tune's arrays laid over its parent's."""
    log = json.loads((folder / f"{name}.json").read_text())
    with np.load(folder / f"{name}.npz") as z:
        arrays = dict(z)
    if "parent" in log:
        parent = load(log["parent"], folder)
        arrays = {**parent.state_arrays(np.float32), **arrays}
    return ByteLM(Config(**log["config"])).load_arrays(arrays).eval()


def _finetuned(name: str) -> bool:
    """The parameters the long-context fine-tune trains: attention projections and norms."""
    return ".attn." in name or "norm" in name


def finetune(model: ByteLM, rope: Rope | None, length: int, steps: int, batch: int, lr: float, warmup: int,
             seed: int, only: Callable[[str], bool] | None = None,
             report: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``model`` further, in place, on training windows of ``length`` (``default_rng(seed)``)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tokens = corpus.stream("train")
    params = [p for n, p in model.named_parameters() if only is None or only(n)]
    return train_steps(model, params, lambda: corpus.sample_windows(tokens, rng, batch, length),
                       steps, lr, warmup, rope=rope, report=report)


def _printer(every: int, steps: int, started: float) -> Callable[[int, float], None]:
    def report(step: int, loss: float) -> None:
        if step % every == 0 or step == steps - 1:
            print(f"step {step:5d}/{steps}  loss {loss:.4f}  {time.perf_counter() - started:7.1f} s", flush=True)
    return report


def _environment(argv: list[str]) -> dict:
    return {"command": "python -m mha_lab train " + " ".join(argv), "torch": torch.__version__,
            "numpy": np.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "corpus": f"{corpus.PACKAGE}=={corpus.VERSION}", "corpus_sha256": corpus.digest()}


def _pretrain_stage(args: argparse.Namespace, argv: list[str]) -> None:
    recipe = {**PRETRAIN, "steps": args.steps or PRETRAIN["steps"]}
    for variant in args.variant:
        cfg = VARIANTS[variant]
        print(f"pretraining {variant}: {recipe}", flush=True)
        started = time.perf_counter()
        model, losses = pretrain(cfg, **recipe, report=_printer(50, recipe["steps"], started))
        seconds = time.perf_counter() - started
        log = {**_environment(argv), "stage": "pretrain", "config": cfg.as_dict(), "recipe": recipe,
               "seconds": round(seconds, 1), "losses": [round(x, 6) for x in losses],
               "valid_loss": round(validation_loss(model), 6)}
        log = save(model, variant, log, args.out)
        print(f"{variant}: valid loss {log['valid_loss']:.4f} after {seconds:.0f} s -> {args.out / variant}.npz")


def _long_stage(args: argparse.Namespace, argv: list[str]) -> None:
    recipe = {**LONG, "steps": args.steps or LONG["steps"]}
    factor = recipe.pop("factor")
    for method in args.method:
        model = load("base", args.out)
        cfg = model.cfg
        rope = Rope.scaled(method, cfg.head_dim, factor, cfg.train_len, cfg.rope_base)
        length = factor * cfg.train_len
        print(f"fine-tuning base with {method} x{factor} at length {length}: {recipe}", flush=True)
        started = time.perf_counter()
        losses = finetune(model, rope, length, **recipe, only=_finetuned,
                          report=_printer(10, recipe["steps"], started))
        log = {**_environment(argv), "stage": "long", "parent": "base", "method": method, "factor": factor,
               "length": length, "config": cfg.as_dict(), "recipe": {**recipe, "factor": factor},
               "seconds": round(time.perf_counter() - started, 1), "losses": [round(x, 6) for x in losses]}
        save(model, f"long-{method}", log, args.out, only=_finetuned)


def _gqa_stage(args: argparse.Namespace, argv: list[str]) -> None:
    recipe = {**GQA, "steps": args.steps or GQA["steps"]}
    num_kv_heads = recipe.pop("num_kv_heads")
    model = pool_kv_heads(load("base", args.out), num_kv_heads)
    print(f"uptraining base pooled to {num_kv_heads} K/V head(s): {recipe}", flush=True)
    started = time.perf_counter()
    losses = finetune(model, None, model.cfg.train_len, **recipe, report=_printer(10, recipe["steps"], started))
    log = {**_environment(argv), "stage": "gqa", "from": "base", "config": model.cfg.as_dict(),
           "recipe": {**recipe, "num_kv_heads": num_kv_heads}, "seconds": round(time.perf_counter() - started, 1),
           "losses": [round(x, 6) for x in losses]}
    save(model, f"gqa-{num_kv_heads}", log, args.out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m mha_lab train",
        description="Train the course's byte-level language model (4 layers, d_model 128, 4 query heads "
                    "sharing 2 K/V heads, RoPE, 0.76 M parameters) on the Python source of "
                    f"{corpus.PACKAGE}=={corpus.VERSION}, on one CPU thread. 'pretrain' (500 steps of 16 x 256 "
                    "bytes; the base model, then the same with sink logits on the same batches) took 19 and 25 "
                    "minutes on one thread of a busy 2-core machine (about 4 and 6 of CPU time); a rerun on "
                    "the same torch repeats the first steps' logged losses to the digit (the tests replay "
                    "them), and a full rerun of the base model on the same torch gave the same weights, byte for byte "
                    "(7 minutes at the lowest priority on a busy 2-core machine); on another CPU, which may sum in "
                    "another order, the validation loss is expected within 0.02 nats of the logged one. 'long' "
                    "fine-tunes the base at 4x the training length for each RoPE scaling (40 steps each, 11 minutes "
                    "here in all); 'gqa' pools the K/V heads into one and uptrains for 30 steps (about 1 minute). "
                    "Weights and logs go to --out.")
    parser.add_argument("stage", choices=("pretrain", "long", "gqa"), help="what to train (see above)")
    parser.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS),
                        help="pretrain: which models (default both)")
    parser.add_argument("--method", nargs="+", choices=SCALINGS, default=list(SCALINGS),
                        help="long: which RoPE scalings to fine-tune (default all)")
    parser.add_argument("--steps", type=int, default=None, help="fewer steps, for a quick look (default: the recipe)")
    parser.add_argument("--out", type=Path, default=WEIGHTS, help=f"folder for weights and logs (default {WEIGHTS})")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be positive, got {args.steps}")
    torch.set_num_threads(1)
    {"pretrain": _pretrain_stage, "long": _long_stage, "gqa": _gqa_stage}[args.stage](args, argv)
    return 0

