"""Sinks and the subscribe CLI, fed by the real publisher.

The real vLLM server is tested in test_vllm_engine.py (`pytest -m engine`); here its worker-side
applier runs on real `transformers` parameters and on modules laid out as vLLM lays them out.
SGLang cannot run here (no CPU build of sgl-kernel): a local stand-in replies as SGLang 0.5.23 does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from pulsesync.cli import main
from pulsesync.digest import state_digest
from pulsesync.errors import EngineError
from pulsesync.protocol import signing
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.sinks import CommandSinkConfig, DirectorySink, DirectorySinkConfig, SGLangSinkConfig
from pulsesync.sinks.base import Update
from pulsesync.sinks.directory import recorded
from pulsesync.sinks.vllm.engine.applier import WeightApplier
from pulsesync.sinks.vllm.engine.twins import LiveRebuilder
from pulsesync.sinks.vllm.wire.update_file import Region, WeightUpdate, build_update
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.verified import VerifiedState
from tests.support.helpers import assert_states_equal, copying_loader

transformers = pytest.importorskip("transformers")


def tiny_qwen2(seed: int = 0) -> Any:
    from tests.support.hf_trainer_proc import TINY_QWEN2

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**TINY_QWEN2)).to(torch.bfloat16)


def trained_states(steps: int) -> list[dict[str, torch.Tensor]]:
    """bf16 weights of a tiny Qwen2 trained in fp32 with AdamW, one state per step."""
    model = tiny_qwen2().float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    states = []
    for _ in range(steps):
        ids = torch.randint(0, 512, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append({n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()})
    return states


@pytest.fixture(scope="module")
def states() -> list[dict[str, torch.Tensor]]:
    return trained_states(4)


@pytest.fixture
async def published(tmp_path: Path, states: list[dict[str, torch.Tensor]]) -> AsyncIterator[tuple[FileStore, Any]]:
    """Steps 0..3 of the tiny Qwen2 in a filesystem store, anchors every 2, with its config.json."""
    key = Ed25519PrivateKey.generate()
    store = FileStore(tmp_path / "store")
    config_json = tiny_qwen2().config.to_json_string().encode()
    pub = AsyncPublisher(PublisherConfig(anchor_interval=2, on_backpressure="block"), store=store, signing_key=key)
    async with pub:
        for step, state in enumerate(states):
            await pub.publish(step, state, {"config.json": config_json})
    yield store, signing.trusted_keys([key.public_key()])


class StandIn:
    """A local HTTP server standing in for an inference engine; records (path, body) of each request."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies  # path -> JSON reply, or a callable(body) -> reply
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.auth: set[str] = set()

    def reply(self, path: str, body: dict[str, Any]) -> web.Response:
        reply = self.replies.get(path)
        if reply is None:
            return web.Response(status=404)
        return web.json_response(reply(body) if callable(reply) else reply)

    async def __aenter__(self) -> str:
        async def handle(request: web.Request) -> web.Response:
            body = await request.json() if request.can_read_body else {}
            self.requests.append((request.path, body))
            self.auth.add(request.headers.get("Authorization", ""))
            return self.reply(request.path, body)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(16).reshape(1, 16)).logits


async def test_directory_sink_output_opens_with_from_pretrained_and_gives_the_publishers_logits(
    published: tuple[FileStore, Any], states: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    store, trusted = published
    sub = Subscriber(SubscriberConfig(out_dir=tmp_path / "out"), store=store, trusted=trusted)
    await sub.sync(2)
    await sub.sync()
    current = tmp_path / "out" / "current"
    assert current.is_symlink() and current.resolve().name == "step-000000000003"
    assert [p.name for p in sorted((tmp_path / "out").glob("step-*"))] == ["step-000000000002", "step-000000000003"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(current, dtype=torch.bfloat16)
    assert_states_equal(dict(loaded.state_dict()), states[3])
    # The publisher's model, saved and loaded the same way (from_pretrained keeps rotary buffers in
    # fp32, a model cast with .to(bf16) does not, so both sides must be loaded alike to compare).
    trainer_model = tiny_qwen2()
    trainer_model.load_state_dict(states[3])
    trainer_model.save_pretrained(tmp_path / "trainer")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trainer", dtype=torch.bfloat16)
    assert torch.equal(logits(loaded).view(torch.int16), logits(reference).view(torch.int16))


class SGLang(StandIn):
    """SGLang 0.5.23's replies, read from its server source (it cannot run here: no CPU build of sgl-kernel).

    `/model_info` reports `weight_version`, set only after a load succeeded; a failed load answers
    HTTP 400 `{"success": false, "message": ...}`; with running requests holding the cache, the
    flush after a successful load fails and the reply says `success: false` although the weights
    changed. Replies to pause/continue are 200 with an empty body.
    """

    def __init__(self) -> None:
        self.version = "launch"
        self.fail: str | None = None  # "load" or "flush"
        super().__init__({})

    def reply(self, path: str, body: dict[str, Any]) -> web.Response:
        if path == "/model_info":
            return web.json_response({"model_path": "/launch", "weight_version": self.version})
        if path == "/update_weights_from_disk":
            if self.fail == "load":
                return web.json_response({"success": False, "message": "Failed to load weights"}, status=400)
            if self.fail == "flush":  # the weights changed, weight_version did not
                return web.json_response({"success": False, "message": "Cache flush failed after updating weights"})
            self.version = body["weight_version"]
            return web.json_response({"success": True, "message": "Succeeded to update model weights."})
        return web.Response(status=200)


async def test_sglang_sink_follows_sglangs_replies_and_knows_what_it_holds(
    published: tuple[FileStore, Any], tmp_path: Path
) -> None:
    store, trusted = published
    sglang = SGLang()
    async with sglang as url:
        out = DirectorySinkConfig(out_dir=tmp_path / "out", keep=1)
        config = SubscriberConfig(sinks=[out, SGLangSinkConfig(url=url, api_key="s3cret")])
        sub = Subscriber(config, store=store, trusted=trusted)
        await sub.sync(2)
        step2 = tmp_path / "out" / "step-000000000002"
        paths = [p for p, _ in sglang.requests]
        assert paths == ["/model_info", "/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert sglang.requests[1][1] == {"mode": "retract"}
        assert sub.digest is not None
        assert sglang.requests[2][1] == {
            "model_path": str(step2),
            "weight_version": f"pulsesync:2:{sub.digest.root}",
            "flush_cache": True,
        }
        assert sglang.auth == {"Bearer s3cret"}
        for fail in ("load", "flush"):
            sglang.fail = fail
            with pytest.raises(EngineError, match=r"failed step 3: .*weights are unknown"):
                await sub.sync(3)
            assert sglang.requests[-1][0] == "/continue_generation"  # never left paused
            assert sub.step == 2
        sglang.fail = None
        assert (await sub.sync(3)).step == 3
        assert not step2.exists()  # keep=1 once SGLang no longer reads it
        sglang.requests.clear()
        restarted = Subscriber(config, store=store, trusted=trusted)
        await restarted.sync(3)  # SGLang already reports this step and digest: nothing is loaded
        assert [p for p, _ in sglang.requests] == ["/model_info"]

        # SGLang restarts on its launch weights under the subscriber: a poll tick loads the served step again.
        assert await restarted.bring_back_engines() == 0
        sglang.version, sglang.requests = "launch", []
        assert await restarted.bring_back_engines() == 1
        loads = ["/model_info", "/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert [p for p, _ in sglang.requests] == ["/model_info", *loads]  # the check, then the sink's delivery
        assert sglang.requests[3][1]["model_path"] == str(tmp_path / "out" / "step-000000000003")
        assert sglang.version == f"pulsesync:3:{sub.digest.root}" and restarted.status.engine_restarts == 1


async def test_directory_sink_keeps_what_an_engine_serves_and_reuses_only_matching_steps(tmp_path: Path) -> None:
    state = {"w": torch.ones(4, dtype=torch.bfloat16)}
    other = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    pinned: set[Path] = set()
    sink = DirectorySink(DirectorySinkConfig(out_dir=tmp_path, keep=1), lambda: pinned)
    for s in (other, state):  # another run's step 5 first
        await sink.deliver(Update(VerifiedState(5, s, state_digest(s), {})))
    assert recorded(tmp_path / "step-000000000005") == {"step": 5, "digest": state_digest(state).root}
    loaded = load_file(str(next((tmp_path / "current").glob("*.safetensors"))))
    assert torch.equal(loaded["w"].view(torch.int16), state["w"].view(torch.int16))
    pinned.add(tmp_path / "step-000000000005")
    await sink.deliver(Update(VerifiedState(6, other, state_digest(other), {})))
    assert (tmp_path / "step-000000000005").exists()
    pinned.clear()
    await sink.deliver(Update(VerifiedState(7, state, state_digest(state), {})))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000000007"]


def test_weight_applier_validates_before_it_changes_anything(states: list[dict[str, torch.Tensor]]) -> None:
    from pulsesync.codec import UndoLog, apply_patch, encode_patch

    engine = tiny_qwen2(seed=1)
    applier = WeightApplier(engine, copying_loader(engine))
    assert applier.layout.aliases == {} and "model.norm.weight" in applier.layout.slots
    full = build_update(0, states[0], state_digest(states[0]), None, None)
    assert applier.apply(full, "full")["reloaded"] == len(states[0])
    assert_states_equal(dict(engine.state_dict()), states[0])
    undo = UndoLog()
    patched = {n: t.clone() for n, t in states[0].items()}
    digest = apply_patch(patched, encode_patch(states[0], states[1]), undo=undo)
    assert digest is not None
    delta = build_update(1, patched, digest, state_digest(states[0]), undo.changed())
    assert delta.sparse  # where patch records list positions; tensors the patch rewrote densely go whole
    changed = sum(int(i.numel()) for i, _ in delta.sparse.values())
    assert delta.nbytes == changed * (4 + 2) + sum(t.nbytes for t in delta.whole.values())  # int32 positions
    tensors, meta = delta.to_file()
    assert WeightUpdate.from_file(tensors, meta, "f").names == delta.names
    held = applier.held()
    norm = "model.norm.weight"
    bad = [
        (WeightUpdate(2, "x", held["digest"], whole={"nope.weight": torch.zeros(1)}), "does not hold"),
        (WeightUpdate(2, "x", held["digest"], whole={norm: torch.zeros(3)}), "the engine holds"),
        (WeightUpdate(2, "x", "another-state", whole={}), "the engine holds"),
        (WeightUpdate(2, "x", None, whole={norm: torch.zeros(64)}), "full update lacks"),
        (WeightUpdate(2, "x", held["digest"], sparse={norm: (torch.tensor([64]), torch.ones(1))}), "outside"),
    ]
    for update, message in bad:
        with pytest.raises(EngineError, match=message):
            applier.apply(update, "bad")
        assert applier.held() == held
        assert_states_equal(dict(engine.state_dict()), states[0])
    result = applier.apply(delta, "delta")
    assert result["written"] == len(delta.names) and result["reloaded"] == 0
    assert_states_equal(dict(engine.state_dict()), states[1])
    assert applier.held() == {"step": 1, "digest": digest.root, "kept_bytes": 0}  # every module in place
    with pytest.raises(EngineError, match="not a pulsesync update"):
        WeightUpdate.from_file(tensors, {}, "f")


def test_fused_tied_and_repacked_parameters_are_found_where_vllm_keeps_them() -> None:
    class Linear(torch.nn.Module):
        def __init__(self, rows: int, output_sizes: list[int] | None = None, packed: bool = False) -> None:
            super().__init__()
            self.input_size, self.output_size = 4, rows
            if output_sizes:
                self.output_sizes = output_sizes
            self.weight = torch.nn.Parameter(torch.zeros(0 if packed else rows, 4, dtype=torch.bfloat16))
            if packed:
                self.cpu_linear = None  # vLLM on CPU: the forward pass reads a packed copy

    class PackingMethod:  # vLLM's CPU lm_head: logits from a copy packed after loading
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.packed = layer.weight.detach().clone()

    class TiedHead(torch.nn.Module):
        def __init__(self, embed: torch.nn.Embedding) -> None:
            super().__init__()
            self.weight = embed.weight
            self.quant_method = PackingMethod()
            self.quant_method.process_weights_after_loading(self)

    class Model(torch.nn.Module):  # vLLM's naming: qkv_proj fused from q/k/v; lm_head tied to embed
        packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.qkv_proj = Linear(8, [4, 2, 2])
            self.o_proj = Linear(4, packed=True)
            self.lm_head = TiedHead(self.embed)

    model = Model()
    reloaded: list[list[str]] = []

    def reload(weights_iterator: Any) -> None:  # vLLM's loader: fused blocks by rows; o_proj repacked away
        weights = list(weights_iterator)
        reloaded.append([n for n, _ in weights])
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                slot = applier.layout.slots[name]
                if name != "o_proj.weight":
                    params[slot.param].narrow(0, slot.row_offset, slot.shape[0]).copy_(t)

    rebuilt: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []

    class Rebuilder(LiveRebuilder):  # records what a repacked module is rebuilt from
        def prepare(self, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
            rebuilt.append((module, dict(tensors)))
            return super().prepare(module, tensors)

    applier = WeightApplier(model, reload, Rebuilder())
    layout = applier.layout
    assert layout.aliases == {"lm_head.weight": "embed.weight"}
    assert (layout.slots["k_proj.weight"].row_offset, layout.slots["k_proj.weight"].shape) == (4, (2, 4))
    assert layout.slots["o_proj.weight"].shape == (4, 4) and "o_proj" not in layout.in_place
    state = {
        "embed.weight": torch.ones(8, 4),
        "q_proj.weight": torch.full((4, 4), 1.0, dtype=torch.bfloat16),
        "k_proj.weight": torch.full((2, 4), 2.0, dtype=torch.bfloat16),
        "v_proj.weight": torch.full((2, 4), 3.0, dtype=torch.bfloat16),
        "o_proj.weight": torch.full((4, 4), 4.0, dtype=torch.bfloat16),
    }
    applier.apply(WeightUpdate(0, "s0", None, whole=state), "full")
    assert [m for m, _ in rebuilt] == [model.o_proj]  # the full update rehearses the first delta's staging once
    rebuilt.clear()
    k_values = torch.tensor([9.0, 8.0], dtype=torch.bfloat16)
    sparse = {
        "k_proj.weight": (torch.tensor([1, 6]), k_values),
        "o_proj.weight": (torch.tensor([0]), torch.tensor([5.0], dtype=torch.bfloat16)),
        "embed.weight": (torch.tensor([3]), torch.tensor([7.0])),
    }
    result = applier.apply(WeightUpdate(1, "s1", "s0", sparse=sparse), "delta")
    assert (result["written"], result["reloaded"]) == (2, 1)
    assert len(reloaded) == 1  # only the full update went through vLLM's loader
    [(module, tensors)] = rebuilt  # the repacked module alone, whole, from the extension's copy
    assert module is model.o_proj and list(tensors) == ["weight"] and tensors["weight"].shape == (4, 4)
    expected = state["o_proj.weight"].clone()
    expected.view(-1)[0] = 5.0
    assert torch.equal(tensors["weight"].view(torch.int16), expected.view(torch.int16))
    fused = model.qkv_proj.weight.detach()
    assert torch.equal(fused[4:6].reshape(-1)[[1, 6]], k_values) and torch.equal(fused[0], state["q_proj.weight"][0])
    assert float(model.lm_head.weight.detach().view(-1)[3]) == 7.0
    # vLLM reprocesses only the module it loaded: the tied head's packed copy must be redone too
    assert torch.equal(model.lm_head.packed, model.embed.weight.detach())
    with pytest.raises(EngineError, match=r"tied to 'embed\.weight'"):
        applier.apply(WeightUpdate(2, "s2", "s1", whole={"lm_head.weight": torch.ones(8, 4)}), "alias")


def test_a_module_that_vllms_loader_places_otherwise_than_the_rules_is_refused_not_misupdated() -> None:
    class Processing:  # vLLM's CPU linear method: packs the weight after loading
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.packed = layer.weight.detach().clone()

    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16), requires_grad=False)
            self.quant_method, self.cpu_linear = Processing(), None  # computes from a packed copy

    model = torch.nn.Module()
    model.o_proj = Linear()

    def reload(weights_iterator: Any) -> None:  # a loader that flips rows, which no rule of the layout says
        launch = [("o_proj.weight", torch.zeros(4, 4, dtype=torch.bfloat16))]  # given None: the launch checkpoint
        for _, t in launch if weights_iterator is None else weights_iterator:
            model.o_proj.weight.data.copy_(t.flip(0))
            model.o_proj.quant_method.process_weights_after_loading(model.o_proj)

    applier = WeightApplier(model, reload)
    assert "o_proj" not in applier.layout.in_place
    weight = torch.arange(16, dtype=torch.float32).reshape(4, 4).to(torch.bfloat16)
    with pytest.raises(EngineError, match=r"module 'o_proj' \(vLLM's loader differs\)"):
        applier.apply(WeightUpdate(0, "s0", None, whole={"o_proj.weight": weight}), "full")
    assert applier.held()["digest"] is None
    assert "process_weights_after_loading" not in vars(model.o_proj.quant_method)  # the check unhooks itself
    delta = WeightUpdate(1, "s1", "s0", sparse={"o_proj.weight": (torch.tensor([0]), torch.ones(1))})
    with pytest.raises(EngineError, match="cannot place the weights of module 'o_proj'"):
        applier.apply(delta, "delta")


@given(
    rows=st.integers(1, 9),
    columns=st.integers(1, 9),
    dim=st.sampled_from([0, 1]),
    data=st.data(),
)
def test_a_delta_cut_for_a_rank_moves_its_region_exactly_as_the_whole_delta_moves_the_tensor(
    rows: int, columns: int, dim: int, data: st.DataObject
) -> None:
    shape = (rows, columns)
    size = data.draw(st.integers(1, shape[dim]))
    region = Region(shape, dim, data.draw(st.integers(0, shape[dim] - size)), size)
    old = torch.arange(rows * columns, dtype=torch.float32).reshape(shape).to(torch.bfloat16)
    positions = torch.tensor(sorted(data.draw(st.sets(st.integers(0, rows * columns - 1)))), dtype=torch.int32)
    new = old.clone()
    new.view(-1)[positions.long()] = -1.0
    norm = torch.ones(3)
    delta = WeightUpdate(1, "s1", "s0", whole={"norm": norm}, sparse={"w": (positions, new.view(-1)[positions.long()])})
    part = delta.for_rank(1, {"w": region})
    assert part.rank == 1 and part.whole["norm"] is norm  # tensors without a region go whole
    local = region.take(old)
    if "w" in part.sparse:
        index, values = part.sparse["w"]
        assert index.dtype == torch.int32
        local.view(-1)[index.long()] = values
    assert torch.equal(local.view(torch.int16), region.take(new).view(torch.int16))
    tensors, meta = part.to_file()
    assert WeightUpdate.from_file(tensors, meta, "f").rank == 1


def test_a_region_a_worker_reports_is_checked_before_it_cuts_anything() -> None:
    assert Region.from_reply([[4, 6], 1, 2, 3]) == Region((4, 6), 1, 2, 3)
    bad: list[object] = [[[4, 6], 2, 0, 1], [[4, 6], 0, 3, 2], [[4], 1, 0, 1], [[4, 6], 0, -1, 1], [[4, 6], 0, 0, 0]]
    for reply in [*bad, "abcd", None, {"shape": [4]}, [[4, "x"], 0, 0, 1]]:
        with pytest.raises(ValueError):
            Region.from_reply(reply)


def test_a_worker_refuses_a_model_whose_layout_it_does_not_know_and_a_file_cut_for_another_rank() -> None:
    class ExpertLinear(torch.nn.Module):  # sharded by a rule pulsesync does not know
        def __init__(self) -> None:
            super().__init__()
            self.tp_size, self.tp_rank = 2, 0
            self.weight = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
            self.weight.output_dim = 0  # type: ignore[attr-defined]

    model = torch.nn.Module()
    model.experts = ExpertLinear()
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    applier = WeightApplier(model, copying_loader(model))
    full = WeightUpdate(0, "s0", None, whole={"experts.weight": torch.ones(8, 4), "norm.weight": torch.ones(4)})
    with pytest.raises(EngineError, match=r"module 'experts'.*ExpertLinear"):
        applier.apply(full, "full")
    assert torch.equal(model.experts.weight, torch.zeros(4, 4)) and applier.held()["digest"] is None

    del model.experts
    applier = WeightApplier(model, copying_loader(model), rank=0)
    applier.apply(WeightUpdate(0, "s0", None, whole={"norm.weight": torch.ones(4)}), "full")
    other = WeightUpdate(1, "s1", "s0", whole={"norm.weight": torch.zeros(4)}, rank=1)
    with pytest.raises(EngineError, match="cut for rank 1, this worker is rank 0"):
        applier.apply(other, "misrouted")
    assert torch.equal(model.norm.weight, torch.ones(4))


async def test_command_sink_gets_step_and_directory(published: tuple[FileStore, Any], tmp_path: Path) -> None:
    store, trusted = published
    record = tmp_path / "record.txt"
    env = "os.environ['PULSESYNC_STEP'] + ' ' + os.environ['PULSESYNC_DIR']"
    script = f"import os; open({str(record)!r}, 'a').write({env} + '\\n')"
    command = CommandSinkConfig(argv=[sys.executable, "-c", script])
    sub = Subscriber(SubscriberConfig(out_dir=tmp_path / "out", sinks=[command]), store=store, trusted=trusted)
    await sub.sync()
    step, directory = record.read_text().split()
    assert step == "3" and Path(directory) == tmp_path / "out" / "step-000000000003"
    failing = CommandSinkConfig(argv=[sys.executable, "-c", "raise SystemExit(3)"])
    sub = Subscriber(SubscriberConfig(sinks=[failing]), store=store, trusted=trusted)
    with pytest.raises(EngineError, match="exited with 3 at step 3"):
        await sub.sync()
    assert sub.state is None


def test_subscribe_cli_once_prints_the_path_and_fails_cleanly(
    published: tuple[FileStore, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, trusted = published
    pub_file = tmp_path / "trusted.pub"
    signing_pub = next(iter(trusted.values()))
    from cryptography.hazmat.primitives import serialization

    pub_file.write_bytes(
        signing_pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    flags = ["subscribe", "--store", store.url, "--trusted-key", str(pub_file), "--cache-dir", str(tmp_path / "c")]
    assert main([*flags, "--once", "--step", "1"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["step"], first["path"]) == (1, "slow") and first["bytes_downloaded"] > 0
    assert main([*flags, "--once"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert (second["step"], second["path"]) == (3, "chain") and set(second) == {
        "step",
        "path",
        "digest",
        "seconds",
        "bytes_downloaded",
    }
    signing.write_keypair(tmp_path / "other")
    stranger = ["subscribe", "--store", store.url, "--trusted-key", str(tmp_path / "other" / "publisher.pub")]
    assert main([*stranger, "--once"]) == 12
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "UnknownKeyError" in err
    assert main(["subscribe", "--store", store.url, "--once"]) == 3
    assert "trusted_keys" in capsys.readouterr().err
