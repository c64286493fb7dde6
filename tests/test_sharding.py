"""Issue 29: sharded trainers publish from every rank under torchrun (gloo, CPU); subscribers see one model.

Each run trains a tiny Llama with AdamW (tests/support/sharded_trainer.py) and publishes every
step from every rank. After every step a subscriber's state must equal the trainer's whole model
bit for bit, and its root digest that of an unsharded publish of the same weights.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pulsesync.codec.parse import read_header
from pulsesync.digest import state_digest
from pulsesync.protocol import layout, signing
from pulsesync.protocol.manifest import AnchorManifest, PatchManifest, parse_manifest
from pulsesync.publisher import AsyncPublisher, PublisherConfig
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.helpers import assert_states_equal

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")]
transformers = pytest.importorskip("transformers")
LlamaForCausalLM = transformers.LlamaForCausalLM
TRAINER = Path(__file__).parent / "support" / "sharded_trainer.py"
STEPS = 5


def torchrun(tmp_path: Path, nproc: int, layouts: str, *extra: str, fails: bool = False) -> Path:
    """Run the trainer on `nproc` ranks; returns its output folder (fails with the ranks' output)."""
    if not (tmp_path / "key").exists():
        signing.write_keypair(tmp_path / "key")
    out = tmp_path / "out"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), str(TRAINER), str(out)]
    cmd += ["--key", str(tmp_path / "key" / "publisher.key"), "--layouts", layouts, "--steps", str(STEPS), *extra]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert (done.returncode != 0) == fails, (done.stdout + done.stderr)[-6000:]
    with (tmp_path / "torchrun.log").open("a") as log:  # every run's, for what the ranks logged
        log.write(done.stdout + done.stderr)
    return out


def markers(root: Path) -> dict[str, PatchManifest | object]:
    return {p.name: parse_manifest(p.read_bytes()) for p in sorted((root / "store" / "ready").iterdir())}


async def follow(
    root: Path,
    pub: Path,
    steps: list[int],
    nproc: int,
    paths_expected: list[str] | None = None,
    llama: bool = True,
) -> None:
    """A subscriber syncs step by step (anchor, then fast paths); a fresh one rebuilds the last from an anchor.

    `nproc`: the parts every patch must have (0: not checked); `llama`: the state is the Llama's, which
    from_pretrained reads back from the fresh subscriber's directory."""
    store = FileStore(root / "store")
    sub = Subscriber(SubscriberConfig(), store=store, trusted=signing.trusted_keys([pub]))
    unsharded = FileStore(root / "unsharded")
    reference = AsyncPublisher(
        PublisherConfig(anchor_interval=100),
        store=unsharded,
        signing_key=signing.load_private_key(pub.parent / "publisher.key"),
    )
    await reference.start()
    paths = []
    for step in steps:
        full = load_file(str(root / f"full-{step}.safetensors"))
        result = await sub.sync(step)
        paths.append(result.path)
        assert sub.state is not None
        assert_states_equal(sub.state, full)
        await reference.publish(step, full)
        await reference.flush()
        unsharded_root = parse_manifest((root / "unsharded" / layout.commit_key(step)).read_bytes()).state_digest.root
        assert result.digest == unsharded_root == state_digest(full).root
    await reference.close()
    assert paths == (paths_expected or ["slow"] + ["fast"] * (len(steps) - 1)), paths
    for name, manifest in markers(root).items():
        if isinstance(manifest, PatchManifest) and nproc:
            assert len(manifest.objects) == nproc, name  # one part per rank
    # A fresh subscriber rebuilds the newest step from a sharded anchor and writes the HF directory an
    # engine loads: from_pretrained reads it back, bit for bit.
    fresh = Subscriber(SubscriberConfig(out_dir=root / "served"), store=store, trusted=signing.trusted_keys([pub]))
    assert (await fresh.sync()).path == "slow"
    assert fresh.state is not None
    last = load_file(str(root / f"full-{steps[-1]}.safetensors"))
    assert_states_equal(fresh.state, last)
    if llama:
        model = LlamaForCausalLM.from_pretrained(root / "served" / "current", dtype=torch.bfloat16)
        assert_states_equal({n: t.contiguous() for n, t in model.state_dict().items()}, last)
    await sub.close()
    await fresh.close()


@pytest.mark.parametrize(
    ("nproc", "layouts"),
    [(2, "fsdp2,uneven,tp,pipeline,experts"), (4, "fsdp2,uneven,tp,pipeline,experts")],
)
async def test_every_layout_publishes_from_every_rank_and_subscribers_see_the_whole_model(
    tmp_path: Path, nproc: int, layouts: str
) -> None:
    out = torchrun(tmp_path, nproc, layouts)
    pub = tmp_path / "key" / "publisher.pub"
    for name in layouts.split(","):
        await follow(out / name, pub, list(range(STEPS)), nproc)
        # Step 3's anchor carries every rank's part history, the reference of step 4's parts wherever a
        # history-coded record is smaller (the fresh subscriber above rebuilt step 4 from that anchor).
        anchor = parse_manifest((out / name / "store" / layout.anchor_ready_key(3)).read_bytes())
        assert isinstance(anchor, AnchorManifest) and len(anchor.histories) == nproc, name


@pytest.mark.parametrize("relaunched_on", [2, 4])
async def test_a_rank_killed_mid_step_leaves_no_marker_and_the_relaunched_job_resumes_with_a_patch(
    tmp_path: Path, relaunched_on: int
) -> None:
    """No marker for the step a rank died in; the relaunched job (on 4 ranks: resharded) rebuilds its pieces of
    the newest committed step and publishes a patch against it: subscribers take the fast path. On the same
    layout each rank's cache (`cache_dir`) holds all it needs: no payload is read from the store."""
    kill = 2
    torchrun(tmp_path, 2, "fsdp2", "--kill-step", str(kill), "--cache", fails=True)
    root = tmp_path / "out" / "fsdp2"
    assert not (root / "store" / layout.commit_key(kill)).exists()
    torchrun(tmp_path, relaunched_on, "fsdp2", "--first-step", str(kill + 1), "--resume", "--cache")  # relaunched
    ready = markers(root)
    assert layout.commit_key(kill).split("/")[1] not in ready
    restart = ready[layout.commit_key(kill + 1).split("/")[1]]
    assert isinstance(restart, PatchManifest) and restart.base_step == kill - 1  # a patch on the last commit
    assert len(restart.objects) == relaunched_on
    said = (tmp_path / "torchrun.log").read_text()
    assert said.count("resumed at step 1 from anchor 0 and 1 patches") == relaunched_on
    from_store = [int(n) for n in re.findall(r"rank \d+ read (\d+) bytes from the store", said)]
    assert len(from_store) == relaunched_on
    if relaunched_on == 2:
        assert from_store == [0, 0], said[-3000:]
    else:  # ranks 2 and 3 hold no cache; each codes its part against the parts of step 1 its rows overlap, joined
        assert sorted(from_store)[-2] > 0, said[-3000:]
        assert said.count("parts joined)") == relaunched_on, said[-3000:]
        headers = [read_header((root / "store" / ref.key).read_bytes()) for ref in restart.objects]
        assert any(h.reference_parts for h in headers), headers
    pub = tmp_path / "key" / "publisher.pub"
    await follow(root, pub, [0, 1, *range(kill + 1, STEPS)], 0, ["slow", "fast", "fast", "fast"])


async def test_a_job_relaunched_on_as_many_ranks_publishes_the_bytes_an_uninterrupted_run_does(tmp_path: Path) -> None:
    """Stopped after step 2 and relaunched with `resume`: steps 3 (a patch, then an anchor) and 4 are the
    uninterrupted run's parts, byte for byte (each rank's part history rebuilt). A rank's cache damaged in
    between does not prove: the ranks rebuild from the store instead, and still publish those bytes."""
    torchrun(tmp_path / "whole", 2, "fsdp2")
    torchrun(tmp_path / "relaunched", 2, "fsdp2", "--steps", "3", "--cache")
    (cached,) = (tmp_path / "relaunched" / "out" / "fsdp2" / "cache" / "rank-00000").glob("anchors/**/pieces-*")
    data = bytearray(cached.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 10] ^= 0x01
    cached.write_bytes(bytes(data))
    torchrun(tmp_path / "relaunched", 2, "fsdp2", "--first-step", "3", "--resume", "--cache")
    said = (tmp_path / "relaunched" / "torchrun.log").read_text()
    assert "step 3: the ranks' caches do not give step 2 (the ranks' rebuilt pieces compose to digest" in said
    assert said.count("resumed at step 2 from anchor 0 and 2 patches") == 2
    # Each rank's cache holds what it uploaded since the last committed anchor (step 3's) and nothing before.
    for rank in (0, 1):
        cache = tmp_path / "relaunched" / "out" / "fsdp2" / "cache" / f"rank-{rank:05d}"
        files = [f.relative_to(cache) for f in cache.rglob("*") if f.is_file()]
        held = sorted((f.parts[1], f.name.replace(f"{rank:05d}", "R")) for f in files)
        assert [(step, name.split("-R")[0]) for step, name in held] == [
            (layout.anchor_prefix(3).split("/")[1], "patch-history"),
            (layout.anchor_prefix(3).split("/")[1], "pieces"),
            (layout.patch_prefix(4).split("/")[1], "part"),
        ], held
    runs = [markers(tmp_path / run / "out" / "fsdp2") for run in ("whole", "relaunched")]
    for step in (3, 4):
        name = layout.commit_key(step).split("/")[1]
        commits = [run[name] for run in runs]
        assert all(isinstance(c, PatchManifest) for c in commits)
        assert [o.sha256 for o in commits[0].objects] == [o.sha256 for o in commits[1].objects]  # type: ignore[union-attr]


async def test_a_relaunch_whose_rebuilt_pieces_do_not_prove_publishes_an_anchor_and_says_why(tmp_path: Path) -> None:
    """A byte of the anchor's pieces flipped in the store: the ranks' rebuilt pieces do not compose to the signed
    digest, so nothing is published against them; the relaunch's first step is an anchor, served bit for bit."""
    torchrun(tmp_path, 2, "fsdp2", "--steps", "3")
    root = tmp_path / "out" / "fsdp2"
    (piece,) = (root / "store" / "anchors").glob("000000000000/*/pieces-00000-of-00002.safetensors")
    data = bytearray(piece.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 10] ^= 0x01
    piece.write_bytes(bytes(data))
    torchrun(tmp_path, 2, "fsdp2", "--first-step", "3", "--resume")
    assert isinstance(markers(root)[layout.commit_key(3).split("/")[1]], AnchorManifest)
    said = (tmp_path / "torchrun.log").read_text()
    assert "step 3: not resumed at step 2 (the ranks' rebuilt pieces compose to digest" in said
    sub = Subscriber(
        SubscriberConfig(),
        store=FileStore(root / "store"),
        trusted=signing.trusted_keys([tmp_path / "key" / "publisher.pub"]),
    )
    assert (await sub.sync(3)).path == "slow"
    assert sub.state is not None
    assert_states_equal(sub.state, load_file(str(root / "full-3.safetensors")))
    await sub.close()


async def test_a_rank_whose_pieces_move_makes_the_step_an_anchor_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 publishes a tensor it did not have from step 2 on (the `grows` layout) while rank 1's pieces
    stay: step 2 is committed as an anchor on both ranks, no patch of it is in any manifest, and a subscriber
    follows every step bit for bit."""
    out = torchrun(tmp_path, 2, "grows")
    root = out / "grows"
    commit = parse_manifest((root / "store" / layout.commit_key(2)).read_bytes())
    assert isinstance(commit, AnchorManifest), commit
    assert "model.grown.weight" in commit.state_digest.tensors
    listed = {ref.key for manifest in markers(root).values() for ref in getattr(manifest, "objects", [])}
    assert not any(key.startswith(layout.patch_prefix(2)) for key in listed), listed
    paths = ["slow", "fast", "slow", "fast", "fast"]  # step 2, an anchor, is the slow path's
    await follow(root, tmp_path / "key" / "publisher.pub", list(range(STEPS)), 0, paths, llama=False)
