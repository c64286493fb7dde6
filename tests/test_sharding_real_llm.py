"""A real causal LLM's fine-tune published from 2 ranks: history-coded parts, served bit for bit.

SmolLM2-135M fine-tuned 3 steps as `bench/real_llm.py` does (`sft`: AdamW lr 1e-6 on bf16 weights,
real English text); its checkpoints published from 2 torchrun ranks, each its FSDP2 rows of every
tensor (tests/support/checkpoint_ranks.py): step 1 an anchor, steps 2 and 3 patches. Step 3's parts
are coded against each rank's part of step 2, a subscriber serves step 3 bit for bit, and each
patch step's parts cost at most 1.05x the unsharded patch's bytes (measured 1.04x; 2.2x for parts
without history). A row split doubles the records of this model's ~210 changing matrices, so what a
record costs besides its coded changes decides it: ~20 bytes in format 4's index (docs/sharding.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pulsesync.codec import CodecParams, PatchHistory, encode, read_header
from pulsesync.protocol import signing
from pulsesync.protocol.fetcher import split_parts
from pulsesync.protocol.manifest import ObjectRef, PatchManifest
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.helpers import assert_states_equal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")]
pytest.importorskip("transformers")
pytest.importorskip("gguf")
RANKS = Path(__file__).parent / "support" / "checkpoint_ranks.py"


async def test_a_real_fine_tune_published_from_two_ranks_costs_what_an_unsharded_publish_costs(
    tmp_path: Path,
) -> None:
    import real_llm

    states = real_llm.fine_tune(3)[1:]  # steps 1-3: the anchor, then two patches
    checkpoints = []
    for step, state in enumerate(states, start=1):
        checkpoints.append(tmp_path / f"step-{step}.safetensors")
        save_file({n: t.contiguous() for n, t in state.items()}, str(checkpoints[-1]))
    signing.write_keypair(tmp_path / "key")
    store = tmp_path / "store"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", str(RANKS), str(store)]
    cmd += [str(tmp_path / "key" / "publisher.key"), *map(str, checkpoints)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]

    trusted = signing.trusted_keys([tmp_path / "key" / "publisher.pub"])
    async with Subscriber(SubscriberConfig(), store=FileStore(store), trusted=trusted) as sub:
        assert (await sub.sync(3)).path == "slow"
        assert sub.state is not None
        assert_states_equal(sub.state, states[2])
        reference: PatchHistory | None = None
        previous: list[ObjectRef] = []
        for step in (2, 3):
            manifest = await sub.stores.chain.manifest(step, "patch")
            assert isinstance(manifest, PatchManifest) and len(manifest.objects) == 2
            unsharded = encode(states[step - 2], states[step - 1], CodecParams(), reference=reference)
            reference = unsharded.history
            parts = sum(ref.size for ref in manifest.objects)
            assert parts <= 1.05 * len(unsharded.data), (step, parts, len(unsharded.data))
            data = await sub.stores.chain.fetcher.fetch_patch(manifest)
            named = [read_header(part).reference_sha256 for part in split_parts(manifest, data)]
            assert named == ([None, None] if step == 2 else [ref.sha256 for ref in previous])
            previous = manifest.objects
    assert all(t.dtype == torch.bfloat16 for t in states[0].values())
