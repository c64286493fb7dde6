"""TRL's `GRPOTrainer` in a pulsesync loop: publish every optimizer step, generate on a pulsesync-fed vLLM.

    from pulsesync.integrations.trl import PulseSyncCallback, rollout_func

    trainer = GRPOTrainer(
        model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
        rollout_func=rollout_func("http://127.0.0.1:8000", max_lag=1),
        callbacks=[PulseSyncCallback(PublisherConfig(store=..., signing_key=...))],
    )

The callback publishes step 0 (the initial policy) when training begins and then the weights of
every optimizer step as step `global_step`, so the trainer at step s holds policy s. The
`rollout_func` generates through the server's `/v1/completions`, one request per prompt with `n`
completions, after waiting until the engine holds a step of at least s - `max_lag`. It returns
what TRL needs (`prompt_ids`, `completion_ids`, and `logprobs`, the engine's logprob of each
sampled token), plus `policy_step`, the step that generated each completion. TRL forwards that
field to the reward functions as a keyword argument.

The lag of every batch is logged. It is also set as the Prometheus gauge
`pulsesync_rollout_policy_lag_steps` and added to TRL's logged metrics as
`pulsesync/policy_lag`. Sampling follows the trainer's arguments: `max_completion_length`,
`temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`.

Requires TRL (1.16 tested): `pip install 'pulsesync[trl]'`. docs/integrations.md has the whole loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pulsesync.integrations.rollout import RolloutBatch, RolloutClient
from pulsesync.integrations.transformers import PulseSyncCallback

__all__ = ["PulseSyncCallback", "RolloutFunc", "rollout_func", "sampling_of"]

RolloutFunc = Callable[[list[Any], Any], dict[str, list[Any]]]


def sampling_of(args: Any) -> dict[str, Any]:
    """The /v1/completions sampling parameters that a GRPOConfig's generation settings mean."""
    out: dict[str, Any] = {
        "max_tokens": args.max_completion_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k if args.top_k else -1,  # TRL's 0 and vLLM's -1 both mean no top-k
        "repetition_penalty": args.repetition_penalty,
    }
    if args.min_p is not None:
        out["min_p"] = args.min_p
    return out


def _prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of one prompt as GRPOTrainer tokenizes it: chat template for messages, plain text otherwise."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    encoded = tokenizer.apply_chat_template(
        conversation=[prompt], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"][0])


def rollout_func(
    url: str,
    *,
    max_lag: int = 1,
    lag_timeout_seconds: float = 600.0,
    api_key: str | None = None,
    model: str | None = None,
    adapter: str | None = None,
    sampling: dict[str, Any] | None = None,
    seed: int = 0,
    on_batch: Callable[[RolloutBatch], None] | None = None,
) -> RolloutFunc:
    """A TRL `rollout_func` that generates on the vLLM server at `url`, at most `max_lag` steps behind the trainer.

    `adapter`: generate with this LoRA adapter (the `vllm_lora` sink's name), tagged with its step.
    `sampling` overrides the parameters taken from the trainer's arguments; `on_batch` sees every
    batch (its policy, lag and the exact requests, which replay on a fresh server).
    """
    client = RolloutClient(
        url,
        max_lag=max_lag,
        model=model,
        adapter=adapter,
        api_key=api_key,
        lag_timeout_seconds=lag_timeout_seconds,
        seed=seed,
    )

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        tokenizer = trainer.processing_class
        client.sampling = sampling_of(trainer.args) | (sampling or {})
        ids = [_prompt_ids(tokenizer, p) for p in prompts]
        batch = asyncio.run(client.generate(ids, trainer.state.global_step))
        metrics = getattr(trainer, "_metrics", None)  # what GRPOTrainer.log averages and reports
        if isinstance(metrics, dict) and isinstance(metrics.get("train"), dict):
            metrics["train"].setdefault("pulsesync/policy_lag", []).append(float(batch.lag))
        if on_batch is not None:
            on_batch(batch)
        return {
            "prompt_ids": [c.prompt_ids for c in batch.completions],
            "completion_ids": [c.completion_ids for c in batch.completions],
            "logprobs": [c.logprobs for c in batch.completions],
            "policy_step": [c.step for c in batch.completions],
        }

    return rollout
