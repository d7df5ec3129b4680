"""Chunked routing end to end at Qwen3-30B-A3B's layout (48 MoE layers, top-8 of 128): the
worker's encoding in chunks, segments appended in parts, chunks stored one Redis value each,
PullChunks parts of at most one chunk, rebuilt groups equal to what was sent (issue 54)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from services.common.wire import routing_from_proto
from services.rollout.segments import SegmentRecord, segment_row_ranges
from services.rollout.sink import StoreSink
from services.rollout.spill import RoutingSpill
from services.rollout.trajectory_proto import RoutingLayout, segment_to_proto
from services.store import wirefmt
from services.store.client import StoreClient
from services.store.config import StoreConfig
from services.store.core import TrajectoryStoreCore
from services.store.parts import GroupAssembler, trajectory_requests
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import random_routing

LAYERS, TOPK, EXPERTS = 48, 8, 128
PROMPT, SEGMENTS, CHUNK_ROWS = 40, (100, 70, 30), 32  # 3 segments: a resume and a turn


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
def core(redis_url: str) -> TrajectoryStoreCore:
    cfg = StoreConfig(key_prefix=f"c{uuid.uuid4().hex[:8]}:")
    return TrajectoryStoreCore(redis.Redis.from_url(url=redis_url), cfg)


def rows_of(seed: int, prompt_TLK: np.ndarray) -> np.ndarray:
    resp = random_routing(sum(SEGMENTS) - 1, LAYERS, TOPK, EXPERTS, np.random.default_rng(seed))
    return np.concatenate([prompt_TLK, resp])


def trajectory(tid: str, gid: str, all_TLK: np.ndarray, chunk_rows: int
               ) -> trajectory_pb2.Trajectory:
    """As the worker builds it: each segment's rows (partial-rollout and multi-turn segments,
    policy versions 0, 1, 1) encoded in chunks of `chunk_rows`."""
    layout = RoutingLayout(EXPERTS, tuple(range(LAYERS)), chunk_rows=chunk_rows)
    ranges = segment_row_ranges(PROMPT, list(SEGMENTS))
    traj = trajectory_pb2.Trajectory(
        trajectory_id=tid, group_id=gid, group_size=2, prompt_id=gid,
        prompt_token_ids=list(range(1, PROMPT + 1)), reward=0.5,
        finish_reason=trajectory_pb2.FINISH_REASON_STOP)
    for j, (n, (a, b)) in enumerate(zip(SEGMENTS, ranges, strict=True)):
        rec = SegmentRecord(list(range(n)), [-0.5] * n, [int(j != 2)] * n, min(j, 1),
                            rows_TLK=all_TLK[a:b])
        traj.segments.append(segment_to_proto(rec, j, (a, b), PROMPT, layout))
    return traj


def decoded(traj: trajectory_pb2.Trajectory) -> np.ndarray:
    return np.concatenate([routing_from_proto(c) for s in traj.segments for c in s.routing])


@pytest.fixture(scope="module")
def group() -> tuple[list[trajectory_pb2.Trajectory], list[np.ndarray]]:
    prompt = random_routing(PROMPT, LAYERS, TOPK, EXPERTS, np.random.default_rng(0))
    rows = [rows_of(i + 1, prompt) for i in range(2)]
    return [trajectory(f"g/{i}", "g", r, CHUNK_ROWS) for i, r in enumerate(rows)], rows


def pull_parts(core: TrajectoryStoreCore) -> list[bytes]:
    [d] = core.pull("trainer", 1)
    return list(d.parts())


def assert_pulled_whole_is(core: TrajectoryStoreCore,
                           trajs: list[trajectory_pb2.Trajectory]) -> None:
    """The next group pulled whole (Pull's PulledGroup) is `trajs`, byte for byte."""
    [d] = core.pull("trainer", 1)
    got = store_pb2.PulledGroup.FromString(d.to_bytes())
    assert [t.SerializeToString(deterministic=True) for t in got.trajectories] == \
        [t.SerializeToString(deterministic=True) for t in trajs]


def test_worker_chunks_decode_to_the_rows_one_chunk_per_segment_gives(group) -> None:  # noqa: ANN001
    trajs, rows = group
    whole = trajectory("w", "g", rows[0], chunk_rows=1 << 20)  # today's: a chunk per segment
    assert [len(s.routing) for s in whole.segments] == [2, 1, 1]
    assert [len(s.routing) for s in trajs[0].segments] == [1 + 4, 3, 1]  # prompt + 99 rows
    assert np.array_equal(decoded(trajs[0]), decoded(whole))
    assert np.array_equal(decoded(trajs[0]), np.sort(rows[0], axis=-1))  # canonical: sorted
    assert rows[0].shape == (PROMPT + sum(SEGMENTS) - 1, LAYERS, TOPK)


def test_segments_in_parts_stored_per_chunk_and_streamed_back_equal(
        core: TrajectoryStoreCore, group) -> None:  # noqa: ANN001
    trajs, rows = group
    largest = max(c.ByteSize() for t in trajs for s in t.segments for c in s.routing)
    for t in trajs:
        reqs = trajectory_requests(t, part_bytes=largest)  # one chunk per part
        assert sum(r.part > 0 for r in reqs) >= 4 and max(r.ByteSize() for r in reqs) < 2 * largest
        for r in reqs:  # each message its own stream, as StoreClient.append_in_parts sends
            assert core.append([r]).accepted == 1
    fields = core.r.hkeys(core.keys.traj("g/0"))
    assert {f for f in fields if f.startswith(b"r:")} == {
        f"r:{j}:{c}".encode() for j, n in enumerate((4, 3, 1)) for c in range(n)}
    parts = pull_parts(core)
    assert max(len(p) for p in parts) < largest + 64  # no part carries more than one chunk
    asm = GroupAssembler()
    for p in parts:
        asm.add(store_pb2.PulledPart.FromString(p))
    [got] = asm.groups
    assert not asm.cut_short
    assert {t.trajectory_id: t for t in got.trajectories} == {t.trajectory_id: t for t in trajs}
    assert np.array_equal(decoded(got.trajectories[1]), np.sort(rows[1], axis=-1))
    assert sum(f.startswith(b"p:") for f in core.r.hkeys(core.keys.group("g"))) == 1


def test_whole_pull_of_chunked_storage_is_byte_for_byte_the_trajectory(
        core: TrajectoryStoreCore, group) -> None:  # noqa: ANN001
    trajs, _ = group
    for t in trajs:
        core.append(trajectory_requests(t))
    assert_pulled_whole_is(core, trajs)


def test_segments_stored_whole_before_chunking_are_still_delivered(
        core: TrajectoryStoreCore, group) -> None:  # noqa: ANN001
    trajs, _ = group
    for t in trajs:
        core.append(trajectory_requests(t))
    for t in trajs:  # rewrite into the layout of stores before chunked storage
        key = core.keys.traj(t.trajectory_id)
        for j, seg in enumerate(t.segments):
            stale = [f"r:{j}:{c}" for c in range(int(core.r.hget(key, f"rc:{j}")))]
            core.r.hdel(key, f"rc:{j}", *stale)
            if j == 0:
                payload, head_len = wirefmt.split_prompt_segment(seg)
                core.r.hset(key, mapping={"s:0": payload, "hl": head_len})
            else:
                core.r.hset(key, f"s:{j}", seg.SerializeToString())
    asm = GroupAssembler()
    for p in pull_parts(core):
        asm.add(store_pb2.PulledPart.FromString(p))
    assert list(asm.groups[0].trajectories) == trajs


def test_part_keys_are_exactly_once_and_gaps_name_the_field(
        core: TrajectoryStoreCore, group) -> None:  # noqa: ANN001
    reqs = trajectory_requests(group[0][0], part_bytes=1)  # begin, 5 + 3 + 1 parts, finish
    assert [(r.sequence_number, r.part, r.more_parts) for r in reqs[:7]] == [
        (0, 0, False), (1, 0, True), (1, 1, True), (1, 2, True), (1, 3, True), (1, 4, False),
        (2, 0, True)]
    assert core.append(reqs[:3]).accepted == 3
    assert core.append(reqs[:3]).duplicates == 3  # a retried stream of parts: no-ops
    with pytest.raises(ValueError, match=r"^part: got 3, expected 2"):
        core.append([reqs[4]])
    with pytest.raises(ValueError, match=r"^sequence_number: 1 is segment 0, still open"):
        core.append([store_pb2.AppendRequest(trajectory_id="g/0", sequence_number=1,
                                             finish=reqs[-1].finish)])
    res = core.append(reqs)
    assert (res.accepted, res.duplicates) == (len(reqs) - 3, 3)
    assert core.stats().counters["trajectories_complete"] == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.segment.token_ids.append(5), r"^segment.token_ids: part 1 may carry routing"),
    (lambda r: setattr(r.segment.routing[0], "start_row", 1), r"routing\[0\].start_row: 1, exp"),
    (lambda r: setattr(r, "more_parts", False), r"^segment.routing: 32 rows in part 1, expected"),
])
def test_bad_parts_are_refused_naming_the_field(core: TrajectoryStoreCore, group,  # noqa: ANN001
                                                mutate, message: str) -> None:  # noqa: ANN001
    reqs = trajectory_requests(group[0][0], part_bytes=1)
    core.append(reqs[:2])
    mutate(reqs[2])
    with pytest.raises(ValueError, match=message):
        core.append([reqs[2]])
    assert core.r.hget(core.keys.traj("g/0"), "part") == b"1"  # nothing of it written


def test_a_finish_or_a_begin_cannot_be_sent_in_parts() -> None:
    from services.store import validate

    req = store_pb2.AppendRequest(trajectory_id="t", sequence_number=3, part=1,
                                  finish=store_pb2.TrajectoryFinish(num_segments=2))
    with pytest.raises(ValueError, match=r"^part: only a segment"):
        validate.check_envelope(req)


def test_assembler_keeps_whole_groups_of_a_stream_cut_short(core: TrajectoryStoreCore,
                                                            group) -> None:  # noqa: ANN001
    for t in group[0]:
        core.append(trajectory_requests(t))
    parts = [store_pb2.PulledPart.FromString(p) for p in pull_parts(core)]
    asm = GroupAssembler()
    for p in parts[:-1]:
        asm.add(p)
    assert asm.groups == [] and asm.cut_short
    with pytest.raises(ValueError, match=r"^PulledPart: group 'g' began before group 'g'"):
        asm.add(parts[0])
    out_of_order = GroupAssembler()
    out_of_order.add(parts[0])
    with pytest.raises(ValueError, match=r"^PulledPart: a segment part where none is due"):
        out_of_order.add(parts[2])


def test_a_pull_cap_below_what_appends_store_is_refused_at_boot() -> None:
    with pytest.raises(ValueError, match=r"max_pull_message_bytes: 4096 < 2 x max_message_bytes"):
        StoreConfig(max_message_bytes=2048, max_pull_message_bytes=4096)
    assert StoreConfig(max_message_bytes=2048, max_pull_message_bytes=5120)


@pytest.mark.parametrize("read_bytes", [1, 1 << 30])  # a chunk per read, a segment per read
def test_chunks_read_in_batches_arrive_in_order(core: TrajectoryStoreCore, group, monkeypatch,  # noqa: ANN001
                                                read_bytes: int) -> None:
    from services.store import assemble

    monkeypatch.setattr(assemble, "READ_BYTES", read_bytes)
    for t in group[0]:
        core.append(trajectory_requests(t))
    asm = GroupAssembler()
    for p in pull_parts(core):
        asm.add(store_pb2.PulledPart.FromString(p))
    assert list(asm.groups[0].trajectories) == group[0]


def test_a_chunk_gone_mid_delivery_stops_the_stream(core: TrajectoryStoreCore, group) -> None:  # noqa: ANN001
    from services.store.errors import ChunkMissing

    for t in group[0]:
        core.append(trajectory_requests(t))
    [d] = core.pull("trainer", 1)
    parts = d.parts()
    next(parts)
    core.r.hdel(core.keys.traj("g/1"), "r:1:0")
    with pytest.raises(ChunkMissing, match=r"^group g: routing chunk .*r:1:0.* is gone"):
        list(parts)


def test_a_spilled_group_reaches_the_store_byte_for_byte(core: TrajectoryStoreCore, group,  # noqa: ANN001
                                                         tmp_path) -> None:  # noqa: ANN001
    """The worker's spill (every trajectory's chunks on disk, spill_routing_bytes 0) sent by
    StoreSink through StoreClient.append_in_parts: the store holds what an unspilled send
    would have, byte for byte, and pulls it back whole."""
    trajs, _ = group
    spill = RoutingSpill(0, str(tmp_path))
    for t in trajs:
        spill.keep(trajectory_pb2.Trajectory.FromString(t.SerializeToString()))
    sent = spill.trajectories([t.trajectory_id for t in trajs])
    assert spill.spilled() and not any(s.routing for t in sent for s in t.segments)
    client = StoreClient("127.0.0.1:1")
    client.append = core.append  # type: ignore[method-assign] (the store core, no server)
    largest = max(c.ByteSize() for t in trajs for s in t.segments for c in s.routing)
    sink = StoreSink(client, part_bytes=largest)
    asyncio.run(sink.send_group(sent, spill))
    spill.close()
    assert sink.streams_sent == 2 and list(tmp_path.iterdir()) == []
    assert not any(s.routing for t in sent for s in t.segments)  # read back into copies
    assert_pulled_whole_is(core, trajs)


def test_128k_across_a_pause_and_a_turn_reaches_each_microbatch_row_for_row(
        core: TrajectoryStoreCore, tmp_path) -> None:  # noqa: ANN001
    """Issue 54 end to end at 131,072 tokens (16k prompt; segments: 50,000 tokens at v0, the
    weight-update pause, 30,000 resumed at v1, a 2,000-token environment turn, 32,688 more):
    the worker's chunked encoding, its spill (spill_routing_bytes 0), StoreSink's parts into
    the store on Redis, PullChunks, the trainer's intake keeping the routing encoded and each
    micro-batch decoding its own: every row equal, the turn masked, one agreement unit per
    segment."""
    from trainer.replay import ReplayMode
    from trainer.samples.alignment import LayerMap
    from trainer.samples.batch import split_microbatches
    from trainer.samples.intake import group_samples

    layers, prompt, segments = 4, 16_384, (50_000, 30_000, 2_000, 32_688)
    versions, masks = (0, 1, 1, 1), (1, 1, 0, 1)
    rows = prompt + sum(segments) - 1
    rng = np.random.default_rng(54)
    spread = np.arange(TOPK, dtype=np.int64) * (EXPERTS // TOPK)  # 8 distinct ids a row
    layout = RoutingLayout(EXPERTS, tuple(range(layers)), chunk_rows=4096)
    spill, truth = RoutingSpill(0, str(tmp_path)), []
    prompt_TLK = None
    for i in range(2):
        all_TLK = ((rng.integers(0, EXPERTS, (rows, layers, 1)) + spread) % EXPERTS
                   ).astype(np.uint8)
        if prompt_TLK is None:
            prompt_TLK = all_TLK[:prompt].copy()
        all_TLK[:prompt] = prompt_TLK  # the group shares its prompt
        truth.append(np.sort(all_TLK, axis=-1))
        traj = trajectory_pb2.Trajectory(
            trajectory_id=f"long/{i}", group_id="long", group_size=2, prompt_id="long",
            prompt_token_ids=list(range(prompt)), reward=float(i),
            finish_reason=trajectory_pb2.FINISH_REASON_STOP)
        for j, (n, (a, b)) in enumerate(zip(segments, segment_row_ranges(prompt, list(segments)),
                                            strict=True)):
            rec = SegmentRecord(list(range(n)), [-0.5 * masks[j]] * n, [masks[j]] * n,
                                versions[j], rows_TLK=all_TLK[a:b])
            traj.segments.append(segment_to_proto(rec, j, (a, b), prompt, layout))
        spill.keep(traj)
    client = StoreClient("127.0.0.1:1")
    client.append = core.append  # type: ignore[method-assign] (the store core, no server)
    sink = StoreSink(client, part_bytes=4 << 20)
    asyncio.run(sink.send_group(spill.trajectories(["long/0", "long/1"]), spill))
    spill.close()
    assert list(tmp_path.iterdir()) == []
    asm = GroupAssembler()
    for p in pull_parts(core):
        asm.add(store_pb2.PulledPart.FromString(p))
    [pulled] = asm.groups
    samples = group_samples(pulled, ReplayMode.R3,
                            lambda ids: LayerMap.build(tuple(range(layers)), ids), EXPERTS, TOPK)
    assert all(s.routing_TLK is None and s.tokens.size == 131_072 for s in samples)
    assert samples[0].segment_lens == segments and samples[0].policy_version == 0
    assert [u[0] for u in samples[0].agreement_units()] == \
        ["prompt", "segment 0", "segment 1", "segment 2", "segment 3"]
    for mb in split_microbatches(samples, 1, 8):
        [s] = mb.samples
        got = mb.routing_BSLK[0, :rows].numpy()
        assert np.array_equal(np.sort(got, axis=-1), truth[int(s.reward)])
        turn = prompt - 1 + sum(segments[:2])  # the environment turn's positions: not trained
        assert mb.loss_mask_BS[0, turn:turn + segments[2]].sum() == 0
        assert mb.loss_mask_BS[0, turn - 1] == 1 and mb.loss_mask_BS[0, turn + segments[2]] == 1
