"""A small synthetic RL-like trainer: fp32 master weights updated by torch.optim.AdamW, published as bf16.

Used by the codec benchmark and the demo to produce realistic weight updates (about 1% of bf16
elements change per step at RL learning rates) without downloading a model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

# LLM-like magnitudes: matrix weights ~ N(0, 0.0178) have median |w| ~ 0.012; norm weights ~ 1.0.
WEIGHT_STD = 0.0178
# The real-like workload (real_like_trainer), calibrated by bench/calibrate.py: see docs/benchmarks.md.
REAL_LIKE_WEIGHT_STD = 0.012
REAL_LIKE_NEAR_ZERO = 0.006
REAL_LIKE_SIGNAL = 0.0


def _add_near_zero_mass(init: torch.Tensor, fraction: float, gen: torch.Generator) -> None:
    """Replace `fraction` of the weights by log-uniform magnitudes in [1e-7, 1e-3], random sign.

    Pretrained LLMs hold such a mass (e.g. embedding rows of tokens pretraining rarely saw, decayed
    toward zero); it is where one AdamW step moves a bf16 weight by many ULPs.
    """
    picked = torch.rand(init.shape, generator=gen, device=init.device) < fraction
    count = int(picked.sum())
    magnitude = 10.0 ** (-7.0 + 4.0 * torch.rand(count, generator=gen, device=init.device))
    sign = torch.randint(0, 2, (count,), generator=gen, device=init.device) * 2 - 1
    init[picked] = magnitude * sign


def llm_like_shapes(
    hidden: int, layers: int, vocab: int, intermediate: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a Llama-style decoder with one large embedding."""
    inter = intermediate or hidden * 8 // 3
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden // 4, hidden),
            p + "self_attn.v_proj.weight": (hidden // 4, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


class SyntheticTrainer:
    """fp32 master weights + AdamW on noisy gradients with a persistent direction (like RL fine-tuning)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        lr: float = 1e-6,
        seed: int = 0,
        signal: float = 0.0,
        seen_tokens: float = 0.02,
        device: str | torch.device = "cpu",
        master_dtype: torch.dtype = torch.float32,
        weight_std: float = WEIGHT_STD,
        near_zero_fraction: float = 0.0,
    ) -> None:
        self._gen = torch.Generator(device=device).manual_seed(seed)
        self.params: dict[str, torch.nn.Parameter] = {}
        self._direction: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                init = 1.0 + 0.05 * torch.randn(shape, generator=self._gen, device=device)
            else:
                init = weight_std * torch.randn(shape, generator=self._gen, device=device)
                if near_zero_fraction:
                    _add_near_zero_mass(init, near_zero_fraction, self._gen)
            self.params[name] = torch.nn.Parameter(init.to(master_dtype))
            self._direction[name] = torch.randn(shape, generator=self._gen, device=device)
        self.signal = signal
        # Embedding rows get gradients only for tokens in the batch: Zipf-distributed, so common
        # tokens recur every step and rare ones almost never (as in RL rollouts).
        self._embedding = next((n for n in shapes if "embed" in n), None)
        vocab = shapes[self._embedding][0] if self._embedding else 1
        self._token_weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64, device=device)
        self._tokens_per_step = max(1, int(seen_tokens * vocab))
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=0.0, foreach=True)
        self.steps = 0

    def state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The published weights: master weights cast to `dtype` (new tensors)."""
        return {n: p.detach().to(dtype, copy=True) for n, p in self.params.items()}

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step on a gradient of persistent signal plus fresh noise."""
        for name, p in self.params.items():
            grad = torch.randn(p.shape, generator=self._gen, device=p.device, dtype=p.dtype)
            grad.add_(self._direction[name], alpha=self.signal).mul_(1e-3)
            if name == self._embedding:
                tokens = torch.multinomial(self._token_weights, self._tokens_per_step, generator=self._gen)
                seen = torch.zeros(p.shape[0], dtype=torch.bool, device=p.device)
                seen[tokens] = True
                grad[~seen] = 0.0
            p.grad = grad
        self.optimizer.step()
        self.steps += 1


@dataclass(frozen=True)
class StepStatistics:
    """What one optimizer step did to the published bf16 weights (bench/calibrate.py)."""

    density: float  # fraction of elements whose bits changed
    one_ulp: float  # of the changed: moved by exactly one ULP
    five_plus_ulp: float  # of the changed: moved by 5 ULP or more
    recurrence: float  # of the changed: changed at the previous step too
    same_direction: float  # of the recurring: moved in the same direction as at the previous step


def _ordered_delta(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """new - old in ULPs (order-preserving map of bf16 bits), int32, flat."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        v = t.reshape(-1).view(torch.int16).to(torch.int32)
        return torch.where(v < 0, v ^ 0x7FFF, v)

    return ordered(new) - ordered(old)


def step_statistics(states: list[dict[str, torch.Tensor]]) -> list[StepStatistics]:
    """Per consecutive pair of bf16 states: density, ULP moves, recurrence, sign persistence."""
    out: list[StepStatistics] = []
    previous: torch.Tensor | None = None
    for old, new in itertools.pairwise(states):
        delta = torch.cat([_ordered_delta(old[n], new[n]) for n in sorted(new)])
        changed = delta != 0
        n = max(1, int(changed.sum()))
        moves = delta[changed].abs()
        recur = same = 0
        if previous is not None:
            both = changed & (previous != 0)
            recur = int(both.sum())
            same = int((torch.sign(delta[both]) == torch.sign(previous[both])).sum())
        out.append(
            StepStatistics(
                density=n / delta.numel(),
                one_ulp=int((moves == 1).sum()) / n,
                five_plus_ulp=int((moves >= 5).sum()) / n,
                recurrence=recur / n if previous is not None else float("nan"),
                same_direction=same / max(1, recur) if previous is not None else float("nan"),
            )
        )
        previous = delta
    return out


def real_like_trainer(hidden: int, layers: int, seed: int = 0, lr: float = 1e-6, **overrides: Any) -> SyntheticTrainer:
    """The real-like workload: a SyntheticTrainer calibrated to real fine-tunes (docs/benchmarks.md).

    bf16 weights updated in place by AdamW (a fine-tune that loads the model in bf16), LLM weight
    magnitudes with a near-zero mass, and a gradient with a persistent direction.
    """
    settings: dict[str, Any] = {
        "master_dtype": torch.bfloat16,
        "weight_std": REAL_LIKE_WEIGHT_STD,
        "near_zero_fraction": REAL_LIKE_NEAR_ZERO,
        "signal": REAL_LIKE_SIGNAL,
    } | overrides
    return SyntheticTrainer(llm_like_shapes(hidden, layers, vocab=96 * hidden), lr=lr, seed=seed, **settings)
