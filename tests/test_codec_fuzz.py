"""A lying encoder's payloads: whatever bytes a record decompresses to, both decoders refuse or agree.

The patch format's checksums and hashes catch accidents; a publisher whose signing key is in the
trusted set (compromised, or buggy) can still ship any decompressed payload with valid framing.
These tests change the payload bytes of real patches (a real-like bf16 fine-tune's first patch
after an anchor, and the history-coded patch after it), re-frame them with valid checksums and
apply them with the batch kernel (numba, nogil, bounds unchecked: an index it fails to check is
memory it writes) and with the per-record numpy path. Every outcome must be one of:
- both refuse with an error of pulsesync.errors, and rolling back the undo log restores the
  state bit for bit, or
- both apply it, to the same bits.
Either way no byte outside the state's tensors changes: each tensor lives between guard bytes.

FUZZ_EXAMPLES=2000 runs more examples than the suite's 100 (about 5 s here). Removing the batch
kernel's check that a gap-coded position stays inside its chunk, or its one-pass path's check of
the reference bitmap's marked count, fails this test within 400 examples.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pulsesync.codec import CodecParams, PatchDecoder, RecordKind, UndoLog, apply_patch, batch, jit
from pulsesync.codec.encoder import encode
from pulsesync.codec.format import (
    PositionCoding,
    RecordHeader,
    payload_hash,
)
from pulsesync.codec.history import PatchHistory
from pulsesync.codec.parse import decompress_payload
from pulsesync.digest import StateDigest, state_digest
from pulsesync.errors import PulseSyncError
from pulsesync.synthetic import real_like_trainer
from tests.support.helpers import assemble_patch, patch_records

pytestmark = pytest.mark.skipif(batch.apply_batch is None, reason="no numba: only one decoder to compare")

GUARD = 64  # bytes before and after each tensor
GUARD_BYTE = 0xA5


@dataclass
class Target:
    """A patch to corrupt, the state it applies to, and what applying it needs."""

    patch: bytes
    base: dict[str, torch.Tensor]
    digest: StateDigest
    reference: PatchHistory | None


def _guarded(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A copy of `state` whose tensors are views into one buffer, each between GUARD bytes of GUARD_BYTE."""
    sizes = [t.numel() * t.element_size() for t in state.values()]
    buffer = torch.full((sum(sizes) + GUARD * (len(sizes) + 1),), GUARD_BYTE, dtype=torch.uint8)
    copy, at = {}, GUARD
    for (name, t), size in zip(state.items(), sizes, strict=True):
        view = buffer[at : at + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        copy[name] = view
        at += size + GUARD
    return copy, buffer


def _guards_intact(state: dict[str, torch.Tensor], buffer: torch.Tensor) -> bool:
    """Whether every byte of `buffer` outside the state's tensors still holds GUARD_BYTE."""
    inside = torch.zeros(buffer.numel(), dtype=torch.bool)
    origin = buffer.data_ptr()
    for t in state.values():
        start = t.data_ptr() - origin
        inside[start : start + t.numel() * t.element_size()] = True
    return bool((buffer[~inside] == GUARD_BYTE).all())


@pytest.fixture(scope="module")
def targets() -> dict[str, Target]:
    """A real-like fine-tune's anchor state, its first patch (no reference) and the history-coded one after it."""
    trainer = real_like_trainer(hidden=64, layers=2, seed=5, lr=1e-5)
    states = [trainer.state()]
    for _ in range(2):
        trainer.step()
        states.append(trainer.state())
    params = CodecParams(chunk_elements=2048)
    first = encode(states[0], states[1], params)
    second = encode(states[1], states[2], params, reference=first.history)
    # Each decoder path is met: positions by magnitude class (the first patch) and history-coded
    # records with new positions coded as gaps (the second, whose values the kernel applies in one pass).
    assert (RecordKind.SPARSE, PositionCoding.CLASS_MASKS) in _codings(first.data)
    assert (RecordKind.HISTORY, PositionCoding.GAP_CODES) in _codings(second.data)
    # The subscriber's history of the first patch: the batch kernel's, which keeps the values it wrote.
    held = {n: t.clone() for n, t in states[0].items()}
    reference = PatchHistory(hashlib.sha256(first.data).hexdigest())
    digest0 = state_digest(states[0])
    digest1 = apply_patch(held, first.data, base_digest=digest0, reference=None, history=reference)
    assert digest1 is not None and any(c.values is not None for c in reference.chunks.values())
    return {
        "first": Target(first.data, states[0], digest0, None),
        "history": Target(second.data, states[1], digest1, reference),
    }


def _codings(patch: bytes) -> set[tuple[RecordKind, PositionCoding]]:
    """The (kind, position coding) pairs of a patch's records."""
    return {(h.kind, h.positions) for h, _ in PatchDecoder().split(patch)}


EDITS = ("set", "add", "swap")  # a byte set to a value; a value added to it (mod 256); swapped with another


def _reframed(patch: bytes, index: int, edits: list[tuple[str, int, int]]) -> bytes:
    """The patch with record `index`'s decompressed payload edited (EDITS, offsets modulo its size),
    recompressed and re-framed with valid checksums and payload hash.

    A swap keeps the payload's multiset of bytes (of codes, of value symbols), so the counts a
    decoder checks first still hold and the edit reaches its later checks and its writes."""
    header, records = patch_records(patch)
    h, compressed = records[index % len(records)]
    raw = bytearray(decompress_payload(h, compressed))
    for edit, offset, value in edits:
        at = offset % len(raw)
        if edit == "set":
            raw[at] = value
        elif edit == "add":
            raw[at] = (raw[at] + value) % 256
        else:
            other = (at + 1 + value) % len(raw)
            raw[at], raw[other] = raw[other], raw[at]
    payload = zstandard.ZstdCompressor(level=1).compress(bytes(raw))
    edited: RecordHeader = h._replace(comp_len=len(payload), payload_hash=payload_hash(payload))
    records[index % len(records)] = (edited, payload)
    return assemble_patch(header, records)


def _outcome(target: Target, patch: bytes, kernels: bool, threads: int) -> tuple[str, dict[str, torch.Tensor]]:
    """Apply `patch` to a guarded copy of the target's base: 'applied' or the error (its class and record),
    and the state (rolled back on error); fails the test if a guard byte changed or a rollback is not exact."""
    state, buffer = _guarded(target.base)
    undo = UndoLog()
    previous = jit.enabled
    jit.enabled = kernels
    try:
        apply_patch(
            state, patch, base_digest=target.digest, threads=threads, undo=undo, reference=target.reference,
            history=PatchHistory("cd" * 32),
        )  # fmt: skip
        outcome = "applied"
    except PulseSyncError as e:
        # The error's class and the record it names: a record with two faults may be refused for
        # either (the batch kernel checks positions first, the per-record path values first).
        named = re.search(r"record for tensor '[^']*' at element \d+", str(e))
        outcome = f"{type(e).__name__}: {named.group(0) if named else e}"
        undo.rollback(state)
        for name, t in target.base.items():
            assert torch.equal(state[name].view(torch.uint8), t.view(torch.uint8)), f"{name} not rolled back"
    finally:
        jit.enabled = previous
    assert _guards_intact(state, buffer), "a byte outside the state's tensors changed"
    return outcome, state


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    which=st.sampled_from(["first", "history"]),
    index=st.integers(0, 10**6),
    edits=st.lists(
        st.tuples(st.sampled_from(EDITS), st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=4
    ),
    threads=st.sampled_from([1, 2]),
)
def test_an_edited_payload_is_refused_or_applied_alike_by_both_decoders(
    targets: dict[str, Target], which: str, index: int, edits: list[tuple[str, int, int]], threads: int
) -> None:
    target = targets[which]
    patch = _reframed(target.patch, index, edits)
    batch, batch_state = _outcome(target, patch, kernels=True, threads=threads)
    per_record, per_record_state = _outcome(target, patch, kernels=False, threads=threads)
    assert batch == per_record
    if batch == "applied":
        for name in target.base:
            assert torch.equal(batch_state[name].view(torch.uint8), per_record_state[name].view(torch.uint8)), name
