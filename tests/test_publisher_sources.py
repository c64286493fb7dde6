"""Publisher sources: checkpoint completeness, --watch on a real transformers trainer, the CLI, the Trainer callback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pulsesync.cli import main
from pulsesync.errors import ConfigError
from pulsesync.protocol import layout, signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import AnchorManifest
from pulsesync.publisher import Publisher
from pulsesync.publisher.checkpoints import incomplete_reason, load_checkpoint
from pulsesync.publisher.config import PublisherConfig, WatchConfig
from pulsesync.publisher.sources import watch
from pulsesync.rebuild import reconstruct
from pulsesync.store import FileStore
from tests.support.helpers import assert_states_equal, ready_kinds, write_checkpoint
from tests.support.servers import free_port

ROOT = Path(__file__).parent.parent
transformers = pytest.importorskip("transformers")


def small_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 40, generator=g).bfloat16(), "b": torch.randn(40, generator=g).bfloat16()}


def test_incomplete_checkpoints_are_recognized(tmp_path: Path) -> None:
    now_settled = WatchConfig(settle_seconds=0)
    ckpt = tmp_path / "checkpoint-3"
    write_checkpoint(ckpt, small_state(0), {"config.json": "{}"})
    assert incomplete_reason(ckpt, now_settled) is None
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    for cut in (4, 100, len(data) - 1):  # mid-header, mid-JSON, mid-data
        weights.write_bytes(data[:cut])
        assert incomplete_reason(ckpt, now_settled) is not None, cut
    weights.write_bytes(data)
    assert "no DONE yet" in str(incomplete_reason(ckpt, WatchConfig(settle_seconds=0, completion_file="DONE")))
    assert "settle_seconds" in str(incomplete_reason(ckpt, WatchConfig(settle_seconds=60)))
    # HF shard names promise an index and N shards.
    weights.rename(ckpt / "model-00001-of-00002.safetensors")
    assert "index.json not written yet" in str(incomplete_reason(ckpt, now_settled))
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "1 of 00002 shards written" in str(incomplete_reason(ckpt, now_settled))


def test_load_checkpoint_takes_weights_and_the_listed_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "7"
    write_checkpoint(ckpt, small_state(1), {"config.json": "{}", "tokenizer.json": "{}", "optimizer.txt": "x"})
    state, files = load_checkpoint(ckpt, PublisherConfig().anchor_files)
    assert_states_equal(state, small_state(1))
    assert sorted(files) == ["config.json", "tokenizer.json"]
    single, none = load_checkpoint(ckpt / "model.safetensors", [])
    assert_states_equal(single, small_state(1)) if not none else pytest.fail("a file has no side files")


async def test_watch_publishes_checkpoints_that_save_pretrained_writes_in_a_subprocess(tmp_path: Path) -> None:
    ckpts, store_dir = tmp_path / "ckpts", tmp_path / "store"
    ckpts.mkdir()
    signing.write_keypair(tmp_path)
    config = PublisherConfig.model_validate(
        {
            "store": {"url": store_dir.as_uri()},
            "signing_key": str(tmp_path / "publisher.key"),
            "anchor_interval": 2,
            "on_backpressure": "block",
            "shard_size": 100_000,  # several anchor shards, like the trainer's
            # No settling time: completeness must come from the files themselves (index, shard sizes).
            "watch": {"poll_seconds": 0.01, "settle_seconds": 0},
        }
    )
    steps = 4
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.hf_trainer_proc", str(ckpts), str(steps)], cwd=ROOT)
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(config, ckpts, stop=stop))
    while proc.poll() is None:
        assert not watcher.done(), watcher.exception()
        await asyncio.sleep(0.05)
    assert proc.returncode == 0 and (ckpts / "done").exists()
    stop.set()
    reports = await watcher
    assert sorted({r.step for r in reports if r.ok}) == list(range(1, steps + 1))
    assert all(r.ok for r in reports)

    store = FileStore(store_dir)
    reader = ChainClient(store, signing.trusted_keys([tmp_path / "publisher.pub"]))
    for step in range(1, steps + 1):
        on_disk = {}
        for shard in sorted((ckpts / f"checkpoint-{step}").glob("*.safetensors")):
            on_disk.update(load_file(shard))
        assert_states_equal((await reconstruct(reader, step)).state, on_disk)

    # The anchor directory opens with from_pretrained as is and computes the same logits.
    anchor = await reader.manifest(3, "anchor")
    assert isinstance(anchor, AnchorManifest)
    local = tmp_path / "anchor-3"
    for ref in anchor.objects:
        await store.download_file(ref.key, local / ref.key.rsplit("/", 1)[1], expected_sha256=ref.sha256)
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= {
        p.name for p in local.iterdir()
    }
    ids = torch.arange(12).reshape(1, 12)
    logits = {}
    for name, path in (("anchor", local), ("trainer", ckpts / "checkpoint-3")):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    assert torch.equal(logits["anchor"].view(torch.int16), logits["trainer"].view(torch.int16))


def test_cli_publish_one_checkpoint_then_backfill_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    signing.write_keypair(tmp_path)
    for step in (10, 11, 12):
        write_checkpoint(tmp_path / "ckpts" / f"checkpoint-{step}", small_state(step), {"config.json": "{}"})
    flags = ["--store", (tmp_path / "store").as_uri(), "--signing-key", str(tmp_path / "publisher.key")]
    one = ["publish", *flags, "--anchor-interval", "2", "--checkpoint"]
    assert main([*one, str(tmp_path / "ckpts" / "checkpoint-10"), "--step", "10"]) == 0
    assert "step=10 kind=anchor ok=true" in capsys.readouterr().out
    assert main([*one, str(tmp_path / "ckpts" / "checkpoint-11" / "model.safetensors"), "--step", "11"]) == 0
    assert "step=11 kind=patch ok=true" in capsys.readouterr().out
    assert main([*one, str(tmp_path / "ckpts" / "checkpoint-12"), "--step", "12"]) == 0  # k=2: patch + anchor
    out = capsys.readouterr().out
    assert "step=12 kind=patch ok=true" in out and "step=12 kind=anchor ok=true" in out
    assert main([*one, str(tmp_path / "ckpts" / "checkpoint-12"), "--step", "12"]) == 6
    assert "ConflictError: step 12 is not newer than step 12" in capsys.readouterr().err
    assert main([*one, str(tmp_path / "nope"), "--step", "13"]) == 5
    assert "NotFoundError: checkpoint" in capsys.readouterr().err
    assert main(["publish", *flags, "--checkpoint", str(tmp_path / "ckpts" / "checkpoint-12")]) == 3
    assert "--checkpoint needs --step" in capsys.readouterr().err

    # Backfill into a second prefix; consumed checkpoints are deleted.
    config = tmp_path / "publisher.yaml"
    config.write_text("watch:\n  settle_seconds: 0\n  delete_consumed: true\n")
    backfill = ["publish", "--config", str(config), "--store", (tmp_path / "store2").as_uri()]
    assert (
        main(
            [*backfill, "--signing-key", str(tmp_path / "publisher.key"), "--watch", str(tmp_path / "ckpts"), "--once"]
        )
        == 0
    )
    assert capsys.readouterr().out.count("ok=true") == 3
    assert not list((tmp_path / "ckpts").iterdir())
    assert (tmp_path / "store2" / layout.commit_key(12)).exists()


def test_cli_publish_rejects_bad_config_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "publisher.yaml"
    config.write_text("anchor_interval: 0\n")
    assert main(["publish", "--config", str(config), "--watch", str(tmp_path), "--once"]) == 3
    assert "anchor_interval" in capsys.readouterr().err
    config.write_text("anchor_intervall: 5\n")
    assert main(["publish", "--config", str(config), "--watch", str(tmp_path), "--once"]) == 3
    assert "anchor_intervall" in capsys.readouterr().err
    assert main(["publish", "--store", (tmp_path / "s").as_uri(), "--watch", str(tmp_path), "--once"]) == 3
    assert "signing_key" in capsys.readouterr().err


def train_with(callback: Any, model: Any, tmp_path: Path, steps: int, lr: float) -> None:
    """A transformers Trainer run of `steps` optimizer steps on random tokens, batches of 2, with the callback."""
    ids = torch.randint(0, 512, (2 * steps, 16))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=lr,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
    )
    data = [{"input_ids": row, "labels": row} for row in ids]
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()


def test_trainer_callback_publishes_every_step_and_serves_metrics(tmp_path: Path) -> None:
    from pulsesync.integrations.transformers import PulseSyncCallback
    from tests.support.hf_trainer_proc import TINY_QWEN2

    signing.write_keypair(tmp_path)
    port = free_port()
    config = PublisherConfig.model_validate(
        {
            "store": {"url": (tmp_path / "store").as_uri()},
            "signing_key": str(tmp_path / "publisher.key"),
            "anchor_interval": 2,
            "on_backpressure": "block",
            "metrics_port": port,
        }
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**TINY_QWEN2))
    initial = {n: t.detach().clone() for n, t in model.state_dict().items()}
    train_with(PulseSyncCallback(config), model, tmp_path, steps=3, lr=1e-4)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'pulsesync_published_total{kind="patch"}' in text and "pulsesync_publish_stage_seconds_bucket" in text
    with pytest.raises(ConfigError, match=f"metrics_port {port}: cannot serve"):
        Publisher(config)  # the port is taken: a clear error at start, not a traceback

    reader = ChainClient(FileStore(tmp_path / "store"), signing.trusted_keys([tmp_path / "publisher.pub"]))
    ready = asyncio.run(ready_kinds(reader))
    # The initial weights are step 0, so engines launched from any checkpoint converge to a known policy.
    assert ready == {0: {"anchor"}, 1: {"patch"}, 2: {"patch", "anchor"}, 3: {"patch"}}
    assert_states_equal(asyncio.run(reconstruct(reader, 0)).state, initial)
    final = asyncio.run(reconstruct(reader, 3))
    assert_states_equal(final.state, {n: t.detach() for n, t in model.state_dict().items()})


@pytest.mark.parametrize("kind", ["lora", "moe"])
def test_trainer_callback_publishes_a_lora_adapter_or_moe_experts_under_checkpoint_names(
    tmp_path: Path, kind: str
) -> None:
    """A PEFT model publishes its adapter and adapter_config.json; a MoE model one tensor per expert."""
    from pulsesync.integrations.transformers import PulseSyncCallback
    from tests.support.hf_trainer_proc import TINY_QWEN2
    from tests.support.vllm_workload import TINY_QWEN3_MOE

    signing.write_keypair(tmp_path)
    config = PublisherConfig.model_validate(
        {"store": {"url": (tmp_path / "store").as_uri()}, "signing_key": str(tmp_path / "publisher.key")}
    )
    torch.manual_seed(0)
    if kind == "lora":
        peft = pytest.importorskip("peft")
        base = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**TINY_QWEN2))
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    else:
        moe = transformers.Qwen3MoeConfig(**TINY_QWEN3_MOE | {"num_hidden_layers": 1})
        model = transformers.Qwen3MoeForCausalLM(moe)
    train_with(PulseSyncCallback(config), model, tmp_path, steps=2, lr=1e-3)

    reader = ChainClient(FileStore(tmp_path / "store"), signing.trusted_keys([tmp_path / "publisher.pub"]))
    final = asyncio.run(reconstruct(reader, 2))
    if kind == "lora":
        expected = peft.get_peft_model_state_dict(model)
        assert json.loads(final.files["adapter_config.json"])["r"] == 4 and "config.json" not in final.files
        assert all(".lora_A." in n or ".lora_B." in n for n in final.state)
    else:
        expected = transformers.core_model_loading.revert_weight_conversion(model, model.state_dict())
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in final.state
    assert_states_equal(final.state, {n: t.detach() for n, t in expected.items()})


def test_cli_publish_synthetic_trainer_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_dir = tmp_path / "keys"
    signing.write_keypair(key_dir)
    store = tmp_path / "store"
    flags = ["--store", store.as_uri(), "--signing-key", str(key_dir / "publisher.key"), "--anchor-interval", "2"]
    assert main(["publish", *flags, "--synthetic", "--interval", "0", "--max-steps", "3"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4  # anchor 0, patches 1 and 2, anchor 2
    # A restart continues the numbering after the newest step (and anchors anew).
    assert main(["publish", *flags, "--synthetic", "--interval", "0", "--max-steps", "1"]) == 0
    reader = ChainClient(FileStore(store), signing.trusted_keys([key_dir / "publisher.pub"]))
    ready = asyncio.run(ready_kinds(reader))
    assert ready == {0: {"anchor"}, 1: {"patch"}, 2: {"patch", "anchor"}, 3: {"anchor"}}
    assert asyncio.run(reconstruct(reader)).step == 3


def test_sigterm_during_publish_checkpoint_finishes_the_step_and_exits_0(tmp_path: Path) -> None:
    """docs/publisher.md: SIGTERM/SIGINT finish the work under way, flush and exit 0 (not 143 mid-upload)."""
    import signal
    import time

    signing.write_keypair(tmp_path / "keys")
    state = {f"layer{i}.weight": torch.randn(1024, 4096).bfloat16() for i in range(24)}  # 192 MiB: seconds of work
    write_checkpoint(tmp_path / "ckpt", state, {"config.json": '{"model_type": "t"}'})
    store = tmp_path / "store"
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--step", "0", "--store", f"file://{store}"]
    args += ["--signing-key", str(tmp_path / "keys" / "publisher.key")]
    proc = subprocess.Popen([sys.executable, "-m", "pulsesync", "publish", *args], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (store / "anchors").exists():  # the anchor is being written to the store: mid-step
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    trusted = signing.trusted_keys([tmp_path / "keys" / "publisher.pub"])
    assert asyncio.run(ready_kinds(ChainClient(FileStore(store), trusted))) == {0: {"anchor"}}, err


def test_publish_checkpoint_with_a_cache_dir_resumes_from_local_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A per-checkpoint hook: each `publish --checkpoint` resumes from --cache-dir, not from the store's anchor."""
    import shutil

    signing.write_keypair(tmp_path / "keys")
    common = ["--store", f"file://{tmp_path / 'store'}", "--signing-key", str(tmp_path / "keys" / "publisher.key")]
    common += ["--cache-dir", str(tmp_path / "cache")]
    for step in (0, 1):
        write_checkpoint(tmp_path / f"ckpt-{step}", small_state(step))
    assert main(["publish", *common, "--checkpoint", str(tmp_path / "ckpt-0"), "--step", "0"]) == 0
    assert "step=0 kind=anchor ok=true" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "store" / "anchors")  # the store cannot rebuild step 0 now: only the cache can
    assert main(["publish", *common, "--checkpoint", str(tmp_path / "ckpt-1"), "--step", "1"]) == 0
    assert "step=1 kind=patch ok=true" in capsys.readouterr().out
