"""A small synthetic RL-like trainer: fp32 master weights updated by torch.optim.AdamW, published as bf16.

Used by the codec benchmark and the demo to produce realistic weight updates (about 1% of bf16
elements change per step at RL learning rates) without downloading a model.
"""

from __future__ import annotations

import torch

# LLM-like magnitudes: matrix weights ~ N(0, 0.0178) have median |w| ~ 0.012; norm weights ~ 1.0.
WEIGHT_STD = 0.0178


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
    ) -> None:
        self._gen = torch.Generator(device=device).manual_seed(seed)
        self.params: dict[str, torch.nn.Parameter] = {}
        self._direction: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                init = 1.0 + 0.05 * torch.randn(shape, generator=self._gen, device=device)
            else:
                init = WEIGHT_STD * torch.randn(shape, generator=self._gen, device=device)
            self.params[name] = torch.nn.Parameter(init)
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
        return {n: p.detach().to(dtype) for n, p in self.params.items()}

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step on a gradient of persistent signal plus fresh noise."""
        for name, p in self.params.items():
            grad = torch.randn(p.shape, generator=self._gen, device=p.device)
            grad.add_(self._direction[name], alpha=self.signal).mul_(1e-3)
            if name == self._embedding:
                tokens = torch.multinomial(self._token_weights, self._tokens_per_step, generator=self._gen)
                seen = torch.zeros(p.shape[0], dtype=torch.bool, device=p.device)
                seen[tokens] = True
                grad[~seen] = 0.0
            p.grad = grad
        self.optimizer.step()
        self.steps += 1
