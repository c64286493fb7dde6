"""Shared test helpers: bit-exact comparison, Hypothesis strategies for random states, small trained chains."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from hypothesis import strategies as st
from safetensors.torch import save_file

from pulsesync.codec import PatchDecoder
from pulsesync.codec.format import FORMAT_VERSION, PatchHeader, RecordHeader, assemble
from pulsesync.dtypes import DTYPES, NP_INT_OF_WIDTH, DTypeInfo
from pulsesync.protocol import layout
from pulsesync.protocol.chain import ChainClient
from pulsesync.publisher.config import PublisherConfig
from pulsesync.store import Store
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes

# Bit patterns every float codec must survive: NaNs (quiet, signalling, negative), +-Inf, -0.0,
# smallest denormals, largest finite values.
SPECIAL_FLOATS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-45, -1e-45, 5e-324, 3.4e38, -3.4e38]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes as a flat uint8 tensor (C order)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, name: str = "") -> None:
    """Same dtype, shape and raw bytes: the codec's contract, never a tolerance."""
    assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits_of(a), bits_of(b)), f"{name}: raw bytes differ"


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names and bitwise-equal tensors."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert_bits_equal(a[name], b[name], name)


def random_bits(rng: np.random.Generator, info: DTypeInfo, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `info`'s dtype with uniformly random bit patterns (any NaN payload included)."""
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=info.torch_dtype)
    raw = rng.integers(0, 256, size=n * info.width, dtype=np.uint8)
    t = torch.from_numpy(raw).view(info.torch_dtype).reshape(shape)
    if info.torch_dtype == torch.bool:
        t = torch.from_numpy(raw % 2 == 1).reshape(shape)  # bool storage must hold 0 or 1
    return t


def mutate(rng: np.random.Generator, base: torch.Tensor, density: float) -> torch.Tensor:
    """A copy of base with about `density` of its elements changed: ULP moves, specials, random bits."""
    info = next(d for d in DTYPES if d.torch_dtype == base.dtype)
    new = base.clone()
    flat = new.reshape(-1)
    n = flat.numel()
    if n == 0:
        return new
    mask = torch.from_numpy(rng.random(n) < density)
    if info.torch_dtype == torch.bool:
        flat[mask] = ~flat[mask]
        return new
    ints = flat.view(info.int_dtype)
    moves = torch.from_numpy(rng.choice([-2, -1, 1, 2, 7], size=n).astype(NP_INT_OF_WIDTH[info.width]))
    kind = torch.from_numpy(rng.integers(0, 4, size=n))
    ulp = mask & (kind < 2)
    ints[ulp] = ints[ulp] + moves[ulp]  # wraps in the integer type: still a valid bit pattern
    rand = mask & (kind == 2)
    ints[rand] = random_bits(rng, info, (n,)).view(info.int_dtype)[rand]
    special = mask & (kind == 3)
    if info.is_float and bool(special.any()):
        values = torch.tensor(rng.choice(SPECIAL_FLOATS, size=int(special.sum())), dtype=torch.float64)
        ints[special] = values.to(info.torch_dtype).view(info.int_dtype)  # fp8 has no masked_fill
    return new


@st.composite
def shapes(draw: st.DrawFn, max_numel: int = 4096) -> tuple[int, ...]:
    """0-d, empty and small multi-dimensional shapes."""
    ndim = draw(st.integers(0, 3))
    dims = draw(st.lists(st.integers(0, 64), min_size=ndim, max_size=ndim))
    while dims and int(np.prod(dims)) > max_numel:
        dims[dims.index(max(dims))] //= 2
    return tuple(dims)


@st.composite
def state_pairs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, new): random tensors of every dtype, random densities 0..1, plus added, removed
    and re-shaped/re-typed tensors."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    names = draw(st.lists(st.text("abcxyz._0123", min_size=1, max_size=8), min_size=1, max_size=5, unique=True))
    base: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for name in names:
        info = draw(st.sampled_from(DTYPES))
        shape = draw(shapes())
        fate = draw(st.sampled_from(["patch"] * 6 + ["add", "remove", "replace"]))
        tensor = random_bits(rng, info, shape)
        if fate != "add":
            base[name] = tensor
        if fate == "patch":
            density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.3, 0.7, 1.0]))
            new[name] = mutate(rng, tensor, density)
        elif fate in ("add", "replace"):
            info2 = draw(st.sampled_from(DTYPES))
            new[name] = random_bits(rng, info2, draw(shapes()))
            if fate == "replace" and new[name].dtype == tensor.dtype and new[name].shape == tensor.shape:
                new[name] = random_bits(rng, info2, (*new[name].shape, 2))
    return base, new


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A deep copy (the working copy a subscriber patches)."""
    return {n: t.clone() for n, t in state.items()}


@functools.cache
def trainer_states(n: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], ...]:
    """States 0..n-1 of a small synthetic model (deterministic: other processes regenerate them)."""
    trainer = SyntheticTrainer(llm_like_shapes(hidden=64, layers=2, vocab=96 * 64), lr=1e-5, seed=seed)
    states = []
    for step in range(n):
        if step:
            trainer.step()
        states.append(trainer.state())
    return tuple(states)


def publisher_config(**overrides: object) -> PublisherConfig:
    """Small shards (several per anchor) and no skipping unless a test asks for it."""
    defaults: dict[str, object] = {"anchor_interval": 10, "shard_size": 256 << 10, "on_backpressure": "block"}
    return PublisherConfig.model_validate(defaults | overrides)


def copying_loader(model: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]] | None], None]:
    """A stand-in for vLLM's reload_weights on a plain module: copy each tensor into its parameter.

    Given no weights, it loads the launch checkpoint again (the parameters when it was made), as vLLM reads its files.
    """
    params = dict(model.named_parameters())
    launch = {n: p.detach().clone() for n, p in params.items()}

    def reload(weights_iterator: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        with torch.no_grad():
            for name, t in launch.items() if weights_iterator is None else weights_iterator:
                params[name].data.copy_(t)

    return reload


def flip_byte(data: bytes) -> bytes:
    """The bytes with one bit of byte 100 flipped."""
    return data[:100] + bytes([data[100] ^ 0x20]) + data[101:]


def write_checkpoint(path: Path, state: dict[str, torch.Tensor], files: dict[str, str] | None = None) -> None:
    """A trainer's checkpoint directory: model.safetensors and the given text files."""
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name, text in (files or {}).items():
        (path / name).write_text(text)


def settled(path: Path) -> None:
    """Date every file under `path` a minute back: a checkpoint a trainer finished earlier, which
    `publish --watch --once` reads at once (it skips one written under `settle_seconds` ago)."""
    back = time.time() - 60
    for p in [path, *path.rglob("*")]:
        os.utime(p, (back, back))


def patch_records(patch: bytes) -> tuple[PatchHeader, list[tuple[RecordHeader, bytes]]]:
    """A patch's header and its records as (header, compressed payload)."""
    decoder = PatchDecoder()
    records = [(h, bytes(p)) for h, p in decoder.split(patch)]
    return decoder.finish(), records


def assemble_patch(
    header: PatchHeader, records: list[tuple[RecordHeader, bytes]], end_count: int | None = None
) -> bytes:
    """Re-serialize a patch from (possibly lying) fields, with correct checksums, in the format its header names
    (`end_count`: what a format 3 patch's end record says)."""
    return assemble(header, records, FORMAT_VERSION if header.indexed else 3, end_count)


async def ready_kinds(chain: ChainClient) -> dict[int, set[str]]:
    """Every ready step's kinds, each commit read to learn its own (a listing alone does not say it)."""
    for step in list(await chain.ready()):
        await chain.resolve(step)
    return {step: set(kinds) for step, kinds in chain.listed.items()}


async def anchor_marker(store: Store, step: int) -> str:
    """The key of a step's anchor marker: beside its patch commit, or the commit itself (an anchor-only step)."""
    beside = layout.anchor_ready_key(step)
    return beside if await store.exists(beside) else layout.commit_key(step)


def anchor_marker_path(root: Path, step: int) -> Path:
    """anchor_marker in a file store's directory."""
    beside = root / layout.anchor_ready_key(step)
    return beside if beside.exists() else root / layout.commit_key(step)
