"""State digest: canonical, machine-independent, sensitive to every byte, dtype, shape and name."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import xxhash

from pulsesync.digest import StateDigest, root_digest, state_digest, tensor_digest

STATE = {
    "b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "a.bias": torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
    "scalar": torch.tensor(7, dtype=torch.int64),
}


def test_known_answer_is_the_documented_canonical_form() -> None:
    # Recompute the digest from the definition: raw little-endian bytes, sorted names, compact JSON.
    entries = []
    for name in sorted(STATE):
        t = STATE[name]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}[t.dtype]
        entries.append([name, dtype, list(t.shape), xxhash.xxh3_128_hexdigest(raw)])
    expected = xxhash.xxh3_128_hexdigest(json.dumps(entries, separators=(",", ":")).encode())
    digest = state_digest(STATE, "xxh3-128")
    assert digest.root == expected
    # Pinned value: the same on every machine, every run.
    assert digest.tensors["a.bias"].digest == xxhash.xxh3_128_hexdigest(bytes([0xC0, 0x3F, 0x00, 0x80]))


def test_sha256_is_selectable() -> None:
    digest = state_digest(STATE, "sha256")
    raw = STATE["scalar"].reshape(-1).view(torch.uint8).numpy().tobytes()
    assert digest.tensors["scalar"].digest == hashlib.sha256(raw).hexdigest()
    assert len(digest.root) == 64


def test_insertion_order_threads_and_contiguity_do_not_matter() -> None:
    reordered = {n: STATE[n] for n in reversed(list(STATE))}
    transposed = {**STATE, "b.weight": STATE["b.weight"].t().contiguous().t()}
    assert not transposed["b.weight"].is_contiguous()
    roots = {state_digest(s, threads=t).root for s in (STATE, reordered, transposed) for t in (1, 2)}
    assert len(roots) == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["b.weight"].view(torch.int32).view(-1).__setitem__(0, 1),  # one bit
        lambda s: s.__setitem__("b.weight", s["b.weight"].reshape(3, 2)),  # shape only
        lambda s: s.__setitem__("b.weight", s["b.weight"].view(torch.int32)),  # dtype only
        lambda s: s.__setitem__("c", s.pop("scalar")),  # name only
        lambda s: s.__setitem__("a.bias", torch.tensor([1.5, 0.0], dtype=torch.bfloat16)),  # -0.0 vs 0.0
    ],
)
def test_every_kind_of_difference_changes_the_root(change) -> None:
    other = {n: t.clone() for n, t in STATE.items()}
    change(other)
    a, b = state_digest(STATE), state_digest(other)
    assert a.root != b.root
    assert a.mismatches(b)


def test_mismatch_names_the_tensor() -> None:
    other = {n: t.clone() for n, t in STATE.items()}
    other["a.bias"][0] = 2.0
    a, b = state_digest(STATE), state_digest(other)
    assert a.mismatches(b) == ["a.bias"]
    assert "'a.bias'" in a.describe_mismatch(b)


def test_digest_model_round_trips_json() -> None:
    digest = state_digest(STATE)
    again = StateDigest.model_validate_json(digest.model_dump_json())
    assert again == digest
    assert root_digest(dict(again.tensors), digest.algorithm) == digest.root


def test_empty_and_zero_dim_tensors() -> None:
    d = tensor_digest(torch.empty(0, 3, dtype=torch.float16), "xxh3-128")
    assert d.shape == (0, 3) and d.digest == xxhash.xxh3_128_hexdigest(b"")
    assert tensor_digest(torch.empty(0, 3, dtype=torch.float16)).digest == "0" * 32  # mixsum: the empty sum
    assert state_digest({}).root == xxhash.xxh3_128_hexdigest(b"[]")
