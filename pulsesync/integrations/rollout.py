"""Rollouts from a vLLM server fed by `pulsesync subscribe`, each tagged with the policy step that made it.

The engine names the verified step every worker holds in its weight version (`GET /weight_info`,
vLLM 0.32+, written by the vllm sink on either engine path once every worker holds it; any string
that is not pulsesync's counts as no verified step). A batch is generated between two reads of it:
when both reads name the same step and state digest, no update landed while the batch ran (updates
only ever change what is held), so every completion of the batch came from that step. When they
differ, the batch is generated again (`ROLLOUT_RETRIES`), never labelled with a guess. The vllm
sink's default `pause_mode: wait` drains running requests before an update, so a retry is rare: only
a batch that straddles an update's pause pays it.

Bounded staleness: before generating, wait until the engine holds a step of at least the
trainer's step minus `max_lag` (`PolicyLagError` after `lag_timeout_seconds`, and at once for a
step newer than the trainer's: another run's weights). Framework-neutral; `integrations.trl`
adapts it to TRL's `rollout_func`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from pulsesync.errors import EngineError, PolicyLagError
from pulsesync.metrics import ROLLOUT_LAG_WAIT_SECONDS, ROLLOUT_POLICY_LAG, ROLLOUT_RETRIES
from pulsesync.sinks.http import EngineClient, reply_field
from pulsesync.sinks.vllm_sessions import weight_version
from pulsesync.sinks.weight_version import HeldPolicy

log = logging.getLogger("pulsesync.rollout")


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its prompt and tokens, the engine's logprob of each token, the policy step."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    step: int


@dataclass(frozen=True)
class RolloutBatch:
    """The completions of one batch, in prompt order, all from `policy`; `requests` replays them exactly."""

    trainer_step: int
    policy: HeldPolicy
    completions: list[Completion]
    requests: list[dict[str, Any]]  # the /v1/completions bodies (seeded) that produced them
    attempts: int
    waited_seconds: float

    @property
    def lag(self) -> int:
        """Trainer step minus the policy step that generated the batch."""
        return self.trainer_step - self.policy.step


@dataclass
class RolloutClient:
    """Generates batches on one OpenAI-compatible vLLM server that `pulsesync subscribe` keeps in sync."""

    url: str
    max_lag: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)  # /v1/completions parameters: max_tokens, temperature, ...
    model: str | None = None  # the served model name; asked of /v1/models when None
    api_key: str | None = None
    lag_timeout_seconds: float = 600.0
    request_timeout_seconds: float = 600.0
    poll_seconds: float = 0.1
    attempts: int = 5  # generations of one batch before giving up when each straddles an update
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_lag < 0 or self.attempts < 1:
            raise ValueError("max_lag must be >= 0 and attempts >= 1")
        self._seeds = random.Random(self.seed)

    async def generate(self, prompts: list[list[int]], trainer_step: int) -> RolloutBatch:
        """One completion per prompt (repeated prompts share a request with `n`), from one policy step."""
        groups = [(ids, len(list(run))) for ids, run in groupby(prompts)]
        async with EngineClient(self.url, self.api_key, self.request_timeout_seconds) as engine:
            model = self.model or await self._served_model(engine)
            started = time.monotonic()
            policy = await self._policy_within_lag(engine, trainer_step)
            waited = time.monotonic() - started
            for attempt in range(1, self.attempts + 1):
                bodies = [self._body(model, ids, n) for ids, n in groups]
                try:
                    replies = await asyncio.gather(*(engine.post("/v1/completions", b) for b in bodies))
                except EngineError:  # an update's `pause_mode: abort` fails running requests: retry then
                    if await weight_version(engine) == policy:
                        raise
                    replies = None
                after = await weight_version(engine)
                if replies is not None and after == policy:
                    completions = [
                        c for (ids, n), r in zip(groups, replies, strict=True) for c in self._parse(r, ids, n, policy)
                    ]
                    batch = RolloutBatch(trainer_step, policy, completions, bodies, attempt, waited)
                    ROLLOUT_POLICY_LAG.set(batch.lag)
                    ROLLOUT_LAG_WAIT_SECONDS.observe(waited)
                    log.info(
                        "rollout: trainer step %d, policy step %d (lag %d), %d completions, attempt %d, waited %.2fs",
                        trainer_step, policy.step, batch.lag, len(completions), attempt, waited,
                    )  # fmt: skip
                    return batch
                ROLLOUT_RETRIES.inc()
                log.info("rollout: the engine went from %s to %s during the batch; generating it again", policy, after)
                policy = await self._policy_within_lag(engine, trainer_step)
        raise EngineError(f"rollout: {self.url} changed its policy during each of {self.attempts} attempts at a batch")

    async def _policy_within_lag(self, engine: EngineClient, trainer_step: int) -> HeldPolicy:
        """What the engine holds once it is within max_lag of trainer_step; PolicyLagError otherwise."""
        deadline = time.monotonic() + self.lag_timeout_seconds
        while True:
            held = await weight_version(engine)
            if held is not None and held.step > trainer_step:
                raise PolicyLagError(
                    f"rollout: {self.url} holds step {held.step}, newer than the trainer's step {trainer_step} "
                    "(another run's weights?)"
                )
            if held is not None and held.step >= trainer_step - self.max_lag:
                return held
            if time.monotonic() >= deadline:
                what = f"step {held.step}" if held is not None else "no verified step"
                raise PolicyLagError(
                    f"rollout: {self.url} holds {what} after {self.lag_timeout_seconds:g}s; the trainer is at step "
                    f"{trainer_step} and max_lag is {self.max_lag} (is `pulsesync subscribe` feeding it?)"
                )
            await asyncio.sleep(self.poll_seconds)

    async def _served_model(self, engine: EngineClient) -> str:
        data = reply_field(await engine.get("/v1/models"), "data", list, f"rollout: {self.url}/v1/models")
        name = data[0].get("id") if data and isinstance(data[0], dict) else None
        if not isinstance(name, str):
            raise EngineError(f"rollout: {self.url}/v1/models names no model: {str(data)[:300]!r}")
        self.model = name
        return name

    def _body(self, model: str, prompt_ids: list[int], n: int) -> dict[str, Any]:
        seed = self._seeds.getrandbits(63)  # recorded in the body: a batch replays exactly on a fresh server
        return self.sampling | {
            "model": model,
            "prompt": prompt_ids,
            "n": n,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
        }

    def _parse(self, reply: Any, prompt_ids: list[int], n: int, policy: HeldPolicy) -> list[Completion]:
        """The reply's n completions, each checked: token ids, one float logprob per token."""
        where = f"rollout: {self.url}/v1/completions"
        choices = sorted(reply_field(reply, "choices", list, where), key=lambda c: c.get("index", -1))
        if len(choices) != n:
            raise EngineError(f"{where} answered {len(choices)} choices for n={n}")
        out = []
        for choice in choices:
            ids = reply_field(choice, "token_ids", list, where)
            logprobs = reply_field(reply_field(choice, "logprobs", dict, where), "token_logprobs", list, where)
            if len(logprobs) != len(ids) or not all(type(t) is int for t in ids):
                raise EngineError(f"{where} answered {len(ids)} token ids and {len(logprobs)} logprobs")
            # vLLM answers None for a NaN logprob; TRL maps None back to NaN and leaves its ratio at 1.
            if not all(lp is None or isinstance(lp, float) for lp in logprobs):
                raise EngineError(f"{where} answered logprobs {str(logprobs)[:200]!r}")
            out.append(Completion(list(prompt_ids), ids, logprobs, policy.step))
        return out
