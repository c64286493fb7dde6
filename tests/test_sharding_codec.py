"""Sharded patches (pure): parts of a step, each encoded from one rank's pieces, apply to the whole state
bit for bit and compose to the digest of an unsharded publish; layouts are validated across ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pulsesync.codec import (
    ChunkHistory,
    CodecParams,
    EncodedPart,
    PatchHistory,
    StepHistory,
    apply_parts,
    apply_patch,
    encode,
    encode_part,
)
from pulsesync.codec import format as fmt
from pulsesync.codec.encoder import contiguous_chunks
from pulsesync.codec.parse import PatchDecoder, read_header
from pulsesync.digest import StateDigest, state_digest
from pulsesync.errors import ConfigError, CorruptPatchError, IntegrityError, MissingReferenceError
from pulsesync.sharding import Piece, Rows, local_pieces, validate
from pulsesync.synthetic import REAL_LIKE_NEAR_ZERO, REAL_LIKE_WEIGHT_STD, SyntheticTrainer, llm_like_shapes
from tests.support.helpers import assert_states_equal, clone_state, mutate, trainer_states


def split_rows(state: dict[str, torch.Tensor], world: int) -> list[dict[str, Rows | None]]:
    """Per rank, a declaration of uneven dim-0 row ranges (the last rank gets the remainder)."""
    per_rank: list[dict[str, Rows | None]] = [{} for _ in range(world)]
    for name, t in state.items():
        rows = t.shape[0]
        bounds = [min(rows, (rows // world + 1) * r) for r in range(world)] + [rows]
        for r in range(world):
            a, b = bounds[r], bounds[r + 1]
            per_rank[r][name] = Rows(a, b, tuple(t.shape)) if b > a else None
    return per_rank


def rank_view(state: dict[str, torch.Tensor], declared: dict[str, Rows | None]) -> dict[str, torch.Tensor]:
    """What one rank holds: its declared rows (views), or the whole tensor where nothing is declared."""
    held = {}
    for name, t in state.items():
        rows = declared.get(name, "whole")
        if rows is None:
            continue
        held[name] = t if rows == "whole" else t[rows.start : rows.stop]
    return held


@pytest.mark.parametrize("world", [2, 3])
def test_parts_compose_to_the_unsharded_patch_bit_for_bit(world: int) -> None:
    states = trainer_states(4)
    base, new = states[2], states[3]
    declared = split_rows(base, world)
    params = CodecParams()
    base_digest = state_digest(base)
    parts, per_rank = [], []
    for rank in range(world):
        pieces, old_local = local_pieces(rank_view(base, declared[rank]), rank, declared[rank])
        _, new_local = local_pieces(rank_view(new, declared[rank]), rank, declared[rank])
        per_rank.append(list(pieces.values()))
        part = encode_part(
            old_local, new_local, pieces, params, part=rank, base_root=base_digest.root, dense_bytes_total=0
        )
        parts.append(part.data)
    layout = validate(per_rank)
    assert set(layout) == set(base)
    held = clone_state(base)
    got = apply_parts(held, parts, base_digest=base_digest)
    assert_states_equal(held, new)
    unsharded = encode(base, new, params)
    assert got.root == unsharded.digest.root == state_digest(new).root


def _rows_parts(
    base: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    declared: list[dict[str, Rows | None]],
    references: list[PatchHistory | None],
) -> list[EncodedPart]:
    """Each rank's part of a step (its rows of every tensor), coded against its own part of the step before."""
    digest, parts = state_digest(base), []
    for rank, reference in enumerate(references):
        pieces, old_local = local_pieces(rank_view(base, declared[rank]), rank, declared[rank])
        _, new_local = local_pieces(rank_view(new, declared[rank]), rank, declared[rank])
        part = encode_part(
            old_local,
            new_local,
            pieces,
            CodecParams(),
            part=rank,
            base_root=digest.root,
            dense_bytes_total=0,
            reference=reference,
        )
        parts.append(part)
    return parts


def _rows_trainer_states(steps: int) -> list[dict[str, torch.Tensor]]:
    """A small Llama's bf16 states over `steps` AdamW steps at lr 1e-6 (real-like weights)."""
    trainer = SyntheticTrainer(
        llm_like_shapes(256, 2, vocab=96 * 256),
        lr=1e-6,
        master_dtype=torch.bfloat16,
        weight_std=REAL_LIKE_WEIGHT_STD,
        near_zero_fraction=REAL_LIKE_NEAR_ZERO,
    )
    states = [trainer.state()]
    for _ in range(steps):
        trainer.step()
        states.append(trainer.state())
    return states


def test_parts_are_history_coded_against_each_ranks_part_before_and_code_as_the_unsharded_patches() -> None:
    """Each rank codes its part against its own part of the step before (the subscriber holds every part's
    history, by SHA-256): bit-exact step after step; positions and values cost what the unsharded patch's
    do (framing is per record, and a split makes more of them: bench/sharded.py measures the whole)."""
    states = _rows_trainer_states(5)
    declared = split_rows(states[0], 2)
    held, history = clone_state(states[0]), StepHistory()
    references: list[PatchHistory | None] = [None, None]
    whole_reference: PatchHistory | None = None
    for step in range(1, len(states)):
        parts = _rows_parts(states[step - 1], states[step], declared, references)
        if step > 1:
            named = [read_header(p.data).reference_sha256 for p in parts]
            assert named == [r.sha256 if r else None for r in references]  # every part: its rank's part before
            assert any("HISTORY/" in coding for p in parts for coding in p.codings)
        got, collected = _apply_collecting(held, parts, state_digest(states[step - 1]), history)
        assert_states_equal(held, states[step])
        assert got.root == state_digest(states[step]).root
        assert [h.chunks.keys() for h in collected.patches.values()] == [p.history.chunks.keys() for p in parts]
        history, references = collected, [p.history for p in parts]
        whole = encode(states[step - 1], states[step], reference=whole_reference)
        whole_reference = whole.history
        coded = sum(p.wire["positions"] + p.wire["values"] for p in parts)
        assert coded <= 1.06 * (whole.wire["positions"] + whole.wire["values"]), (step, coded, whole.wire)
        if step > 1:  # against self-contained parts of the same step: what the history saves
            alone = sum(len(p.data) for p in _rows_parts(states[step - 1], states[step], declared, [None, None]))
            assert sum(len(p.data) for p in parts) < 0.95 * alone
    # A part whose reference is not held (a restart, a step missed) is refused before it writes.
    parts = _rows_parts(states[4], states[5], declared, [*references[:1], None])
    fresh = clone_state(states[4])
    with pytest.raises(MissingReferenceError, match="part 0 is history-coded against patch"):
        apply_parts(fresh, [p.data for p in parts], base_digest=state_digest(states[4]), reference=StepHistory())
    assert_states_equal(fresh, states[4])


def _overlapping(a: dict[str, Rows | None], b: dict[str, Rows | None]) -> bool:
    return any(
        r is not None and (o := b.get(n)) is not None and r.start < o.stop and o.start < r.stop for n, r in a.items()
    )


def test_a_part_on_another_layout_is_coded_against_the_step_befores_parts_joined_by_position() -> None:
    """A job relaunched on another world size (rows cut for 2 ranks, then for 3): each new part is coded
    against the histories of the step before's parts its rows overlap, joined by global position and cut
    into its own chunks (`StepHistory.joined`, named in a format-5 header's `reference_parts`). A subscriber
    that holds every part's history decodes it bit for bit; the step costs what the same step on the old
    layout does, not what self-contained parts do."""
    states = _rows_trainer_states(3)
    two, three = split_rows(states[0], 2), split_rows(states[0], 3)
    held, history = clone_state(states[0]), StepHistory()
    references: list[PatchHistory | None] = [None, None]
    for step in (1, 2):
        parts = _rows_parts(states[step - 1], states[step], two, references)
        _, history = _apply_collecting(held, parts, state_digest(states[step - 1]), history)
        references = [p.history for p in parts]
    same_layout = _rows_parts(states[2], states[3], two, references)  # the step uninterrupted
    # Each new rank holds only the histories of the parts it overlaps, as a relaunched rank rebuilds them.
    joined: list[PatchHistory | None] = []
    for rank in range(3):
        pieces, _ = local_pieces(rank_view(states[2], three[rank]), rank, three[rank])
        read = [references[k] for k in range(2) if _overlapping(three[rank], two[k])]
        keys = contiguous_chunks(pieces, CodecParams().chunk_elements)
        mine = StepHistory.of(*[r for r in read if r is not None]).joined([r.sha256 for r in read if r], keys)
        everyone = history.joined([r.sha256 for r in references if r], keys)  # what a subscriber cuts
        assert mine is not None and everyone is not None and mine.chunks.keys() == everyone.chunks.keys()
        for key, chunk in mine.chunks.items():
            assert np.array_equal(chunk.positions, everyone.chunks[key].positions)
            assert np.array_equal(chunk.deltas, everyone.chunks[key].deltas)
        joined.append(mine)
    relaunched = _rows_parts(states[2], states[3], three, joined)
    headers = [read_header(p.data) for p in relaunched]
    assert [h.reference_parts for h in headers] == [list(j.parts) if j else None for j in joined]
    assert all(h.reference_sha256 is None for h in headers) and headers[1].reference_parts is not None
    assert len(headers[1].reference_parts) == 2  # the middle rank's rows straddle both old ranks'
    assert all(any("HISTORY/" in coding for coding in p.codings) for p in relaunched)
    base = clone_state(held)
    got = apply_parts(held, [p.data for p in relaunched], base_digest=state_digest(states[2]), reference=history)
    assert_states_equal(held, states[3])
    assert got.root == state_digest(states[3]).root
    # Its records code as a job that always ran on 3 ranks codes them: the same chunks, the same changes in them.
    native: list[PatchHistory | None] = [None, None, None]
    for step in (1, 2):
        native = [p.history for p in _rows_parts(states[step - 1], states[step], three, native)]
    size = sum(len(p.data) for p in relaunched)
    assert [p.wire["positions"] + p.wire["values"] for p in relaunched] == [
        p.wire["positions"] + p.wire["values"] for p in _rows_parts(states[2], states[3], three, native)
    ]
    assert size <= 1.1 * sum(len(p.data) for p in same_layout)  # 3 parts' framing against 2's, on a small model
    alone = _rows_parts(states[2], states[3], three, [None, None, None])
    assert size < 0.9 * sum(len(p.data) for p in alone)
    # A subscriber that lacks one of the joined parts' histories refuses the part before anything is written.
    partial = StepHistory.of(*[h for h in history.patches.values()][1:])  # not rank 0's, which the first part joins
    with pytest.raises(MissingReferenceError, match="part 0 is history-coded against the step before's parts"):
        apply_parts(base, [p.data for p in relaunched], base_digest=state_digest(states[2]), reference=partial)
    assert_states_equal(base, states[2])
    # Format 4 has no header field for joined parts: those parts are coded without a reference.
    rank = 1
    pieces, old_local = local_pieces(rank_view(states[2], three[rank]), rank, three[rank])
    _, new_local = local_pieces(rank_view(states[3], three[rank]), rank, three[rank])
    old_format = encode_part(
        old_local,
        new_local,
        pieces,
        CodecParams(format_version=4),
        part=rank,
        base_root=state_digest(states[2]).root,
        dense_bytes_total=0,
        reference=joined[rank],
    )
    assert read_header(old_format.data).reference_parts is None
    assert not any("HISTORY/" in coding for coding in old_format.codings)


def test_reference_parts_only_in_a_format_5_part_that_names_no_single_reference() -> None:
    """A header that names joined parts anywhere else is refused by name."""
    states = _rows_trainer_states(2)
    declared = split_rows(states[0], 2)
    first = _rows_parts(states[0], states[1], declared, [None, None])
    part = _rows_parts(
        states[1],
        states[2],
        declared,
        [StepHistory.of(first[0].history).joined([first[0].history.sha256], [("x", 0, 1)]), None],
    )[0].data
    header = read_header(part)
    for version, fields, problem in [
        (4, {"reference_parts": ["a" * 64]}, "reference_parts in a format-4 part"),
        (5, {"reference_parts": ["a" * 64], "reference_sha256": "b" * 64}, "also names reference_sha256"),
        (5, {"reference_parts": ["a" * 64], "part": None}, "patch that is not a part"),
    ]:
        data = fmt.encode_header(header.model_copy(update=fields), version)
        with pytest.raises(CorruptPatchError, match=problem):
            fmt.parse_header(data)


def test_joined_parts_that_changed_one_element_twice_are_refused_by_name() -> None:
    """Each element belongs to one rank: a step's parts whose histories both changed it give no one reference."""
    one = PatchHistory("a" * 64, {("w", 0, 8): ChunkHistory(np.array([1, 5]), np.array([3, -2], np.int16))})
    other = PatchHistory("b" * 64, {("w", 4, 8): ChunkHistory(np.array([2]), np.array([7], np.int16))})
    joined = StepHistory.of(one, other).joined([one.sha256, other.sha256], [("w", 0, 4), ("w", 4, 4)])
    assert joined is not None and joined.parts == (one.sha256, other.sha256)
    assert {k: (c.positions.tolist(), c.deltas.tolist()) for k, c in joined.chunks.items()} == {
        ("w", 0, 4): ([1], [3]),
        ("w", 4, 4): ([1, 2], [-2, 7]),  # element 5 from the first part, 6 from the second
    }
    twice = PatchHistory("c" * 64, {("w", 4, 4): ChunkHistory(np.array([1]), np.array([1], np.int16))})
    with pytest.raises(IntegrityError, match="tensor 'w': two parts of the step before changed the same element"):
        StepHistory.of(one, twice).joined([one.sha256, twice.sha256], [("w", 0, 8)])


def _apply_collecting(
    held: dict[str, torch.Tensor], parts: list[Any], base_digest: StateDigest, history: StepHistory
) -> tuple[StateDigest, StepHistory]:
    """Apply a step's parts to `held` as a subscriber does: against the step before's histories, collecting
    each part's own under its SHA-256."""
    collected = StepHistory()
    histories = [collected.add(p.history.sha256) for p in parts]
    got = apply_parts(held, [p.data for p in parts], base_digest=base_digest, reference=history, histories=histories)
    return got, collected


def test_strided_parts_history_coded_where_chunk_keys_repeat_across_ranks() -> None:
    """A dim-1 split: both ranks have records of the same global chunks; each part's history is its own."""
    rng = np.random.default_rng(11)
    rows, cols = 48, 100
    states = [{"w": torch.from_numpy(rng.standard_normal((rows, cols), np.float32)).bfloat16()}]
    for _ in range(3):  # the same weights move again, as under Adam's momentum
        states.append({"w": mutate(np.random.default_rng(5), states[-1]["w"], 0.05)})
    params = CodecParams(chunk_elements=1024)
    held, history = clone_state(states[0]), StepHistory()
    references: list[PatchHistory | None] = [None, None]
    for step in range(1, len(states)):
        base, new = states[step - 1], states[step]
        digest = state_digest(base)
        parts = [
            _columns_part(base, new, "w", columns, rank, params, digest.root, references[rank])[1]
            for rank, columns in enumerate([(0, 50), (50, 100)])
        ]
        assert parts[0].history.chunks.keys() == parts[1].history.chunks.keys()  # the same global chunks
        if step > 1:
            assert all(any(c.startswith("HISTORY/") for c in p.codings) for p in parts)
        got, collected = _apply_collecting(held, parts, digest, history)
        assert_states_equal(held, new)
        assert got.root == state_digest(new).root
        history, references = collected, [p.history for p in parts]


def test_a_part_never_applies_alone_out_of_order_or_against_another_base() -> None:
    states = trainer_states(4)
    base, new = states[1], states[2]
    params = CodecParams()
    digest = state_digest(base)
    names = sorted(base)
    halves = [{n: base[n] for n in names[::2]}, {n: base[n] for n in names[1::2]}]
    parts = []
    for rank, held in enumerate(halves):
        pieces, old_local = local_pieces(held, rank)
        parts.append(
            encode_part(
                old_local,
                {n: new[n] for n in held},
                pieces,
                params,
                part=rank,
                base_root=digest.root,
                dense_bytes_total=0,
            ).data
        )
    with pytest.raises(CorruptPatchError, match="part 0 of a sharded step"):
        apply_patch(clone_state(base), parts[0], base_digest=digest)
    with pytest.raises(CorruptPatchError, match="says part 1"):
        apply_parts(clone_state(base), parts[::-1], base_digest=digest)
    with pytest.raises(IntegrityError, match="made against state digest"):
        apply_parts(clone_state(new), parts, base_digest=state_digest(new))
    # A whole (non-part) patch in a part's place is refused before anything is written.
    whole = encode(base, new, params).data
    held = clone_state(base)
    with pytest.raises(CorruptPatchError):
        apply_parts(held, [whole, parts[1]], base_digest=digest)
    assert_states_equal(held, base)


def test_layout_validation_names_overlaps_gaps_and_disagreements() -> None:
    t = torch.zeros(10, 4, dtype=torch.bfloat16)
    ok = [[Piece("w", 0, 24, (10, 4), "BF16", 0)], [Piece("w", 24, 16, (10, 4), "BF16", 1)]]
    assert [p.rank for p in validate(ok)["w"]] == [0, 1]
    with pytest.raises(ConfigError, match="overlap at element 20"):
        validate([[Piece("w", 0, 24, (10, 4), "BF16", 0)], [Piece("w", 20, 20, (10, 4), "BF16", 1)]])
    with pytest.raises(ConfigError, match=r"elements 24\.\.28 are owned by no rank"):
        validate([[Piece("w", 0, 24, (10, 4), "BF16", 0)], [Piece("w", 28, 12, (10, 4), "BF16", 1)]])
    with pytest.raises(ConfigError, match=r"elements 24\.\.40 are owned by no rank"):
        validate([[Piece("w", 0, 24, (10, 4), "BF16", 0)], []])
    with pytest.raises(ConfigError, match="disagree on shape/dtype"):
        validate([[Piece("w", 0, 24, (10, 4), "BF16", 0)], [Piece("w", 24, 16, (10, 4), "F32", 1)]])
    # A plain tensor held whole by several ranks is replicated: the lowest rank publishes it.
    replicas = validate([list(local_pieces({"w": t}, r)[0].values()) for r in (2, 0, 1)])
    assert [(p.rank, p.start, p.length) for p in replicas["w"]] == [(0, 0, 40)]
    with pytest.raises(ConfigError, match=r"overlap at element 0 \(declare what a rank holds"):
        validate([list(local_pieces({"w": t}, 0)[0].values()), [Piece("w", 0, 24, (10, 4), "BF16", 1)]])
    with pytest.raises(ConfigError, match="do not describe"):
        local_pieces({"w": t[:3]}, 0, {"w": Rows(0, 4, (10, 4))})


def test_a_piece_at_an_offset_with_dense_chunks_applies_to_the_whole_tensor() -> None:
    """DENSE records inside a piece that starts mid-tensor and mid-chunk: global starts, bit-exact."""
    rng = np.random.default_rng(0)
    shape = (64, 96)
    whole = torch.from_numpy(rng.integers(0, 2**16, shape, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    rows = Rows(37, 64, shape)
    old = whole[37:].clone()
    new = torch.cat([mutate(rng, old[:11], 0.9), mutate(rng, old[11:], 0.01)])  # dense, then sparse chunks
    pieces, old_local = local_pieces({"w": old}, 1, {"w": rows})
    _, new_local = local_pieces({"w": new}, 1, {"w": rows})
    assert pieces["w"].start == 37 * 96
    digest = state_digest({"w": whole})
    part = encode_part(
        old_local,
        new_local,
        pieces,
        CodecParams(chunk_elements=1024),
        part=0,
        base_root=digest.root,
        dense_bytes_total=0,
    )
    assert any(k.startswith("DENSE/") for k in part.codings) and any(k.startswith("SPARSE/") for k in part.codings)
    held = {"w": whole.clone()}
    got = apply_parts(held, [part.data], base_digest=digest)
    expected = whole.clone()
    expected[37:] = new
    assert_states_equal(held, {"w": expected})
    assert got.root == state_digest({"w": expected}).root


def test_dtensor_placements_become_pieces_and_a_split_of_two_dimensions_is_refused_by_name() -> None:
    """Shard(0) and Replicate describe one run, Shard(1) one run per row; a split of two dimensions is refused."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        t = torch.arange(40, dtype=torch.float32).reshape(10, 4).bfloat16()
        state = {
            "cols": distribute_tensor(t, mesh, [Shard(0)]),
            "rows": distribute_tensor(t, mesh, [Shard(1)]),
            "norm": distribute_tensor(t[0], mesh, [Replicate()]),
        }
        pieces, local = local_pieces(state, 0)
        assert pieces["cols"] == Piece("cols", 0, 40, (10, 4), "BF16", 0) and pieces["norm"].length == 4
        assert pieces["rows"] == Piece("rows", 0, 40, (10, 4), "BF16", 0, runs=10, stride=4)
        assert torch.equal(local["cols"].view(torch.int16), t.view(torch.int16))
        grid = init_device_mesh("cpu", (1, 1))
        with pytest.raises(ConfigError, match=r"tensor 'both': split along dimensions \[0, 1\]"):
            local_pieces({"both": distribute_tensor(t, grid, [Shard(0), Shard(1)])}, 0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_row_wise_parts_split_along_dim_1_compose_bit_for_bit(world: int) -> None:
    """Row-wise tensor parallelism: each rank owns columns of every row (one run per row), uneven at 3."""
    rng = np.random.default_rng(world)
    rows, cols = 48, 100
    base = {"o_proj": torch.from_numpy(rng.standard_normal((rows, cols), np.float32)).bfloat16()}
    new = {"o_proj": mutate(rng, base["o_proj"], 0.05)}
    new["o_proj"][:, 3] = mutate(rng, base["o_proj"][:, 3], 1.0)  # a column that changes everywhere
    digest = state_digest(base)
    params = CodecParams(chunk_elements=1024)  # chunks of ~10 rows: records group runs of several rows
    size = -(-cols // world)
    parts, per_rank = [], []
    for rank in range(world):
        columns = (rank * size, min(cols, (rank + 1) * size))
        piece, part = _columns_part(base, new, "o_proj", columns, rank, params, digest.root)
        per_rank.append([piece])
        assert not any(k.startswith("DENSE/") for k in part.codings)  # other ranks' columns share every chunk
        parts.append(part.data)
    validate(per_rank)
    held = clone_state(base)
    got = apply_parts(held, parts, base_digest=digest)
    assert_states_equal(held, new)
    assert got.root == state_digest(new).root
    overlapping = [
        [Piece("w", 0, 6, (3, 4), "BF16", 0, runs=3, stride=4)],
        [Piece("w", 1, 9, (3, 4), "BF16", 1, runs=3, stride=4)],
    ]
    with pytest.raises(ConfigError, match="pieces overlap at element 1"):
        validate(overlapping)


def test_a_strided_pieces_short_tail_joins_the_chunk_before_it() -> None:
    """A dim-1 split of a tensor of 2 chunks and 100 elements: the tail's changes go in the last chunk's record,
    as in an unsharded patch (codec.encoder.chunk_bounds), and apply bit for bit."""
    rows, cols = 43, 50  # 2,150 elements: chunks of 1,024 leave a tail of 102
    rng = np.random.default_rng(7)
    base = {"w": torch.from_numpy(rng.standard_normal((rows, cols), np.float32)).bfloat16()}
    new = {"w": base["w"].clone()}
    new["w"].view(-1).view(torch.int16)[[5, 1500, 2060, 2147]] += 1  # in both chunks, and in the tail
    digest = state_digest(base)
    params = CodecParams(chunk_elements=1024)
    parts = [
        _columns_part(base, new, "w", columns, rank, params, digest.root)[1].data
        for rank, columns in enumerate([(0, 25), (25, 50)])
    ]
    records = [h for part in parts for h, _ in PatchDecoder().records(part)]
    assert sorted((h.start, h.length) for h in records) == [(0, 1024), (1024, 1126), (1024, 1126)]
    held = clone_state(base)
    assert apply_parts(held, parts, base_digest=digest).root == state_digest(new).root
    assert_states_equal(held, new)


def _columns_part(
    base: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    name: str,
    columns: tuple[int, int],
    rank: int,
    params: CodecParams,
    base_root: str,
    reference: PatchHistory | None = None,
) -> tuple[Piece, EncodedPart]:
    """The part of rank `rank`, which owns columns [a, b) of every row of tensor `name` (a split of dim 1)."""
    (rows, cols), (a, b) = base[name].shape, columns
    piece = Piece(name, a, rows * (b - a), (rows, cols), "BF16", rank, runs=rows, stride=cols)
    old_local, new_local = base[name][:, a:b].contiguous(), new[name][:, a:b].contiguous()
    part = encode_part(
        {name: old_local},
        {name: new_local},
        {name: piece},
        params,
        part=rank,
        base_root=base_root,
        dense_bytes_total=0,
        reference=reference,
    )
    return piece, part
