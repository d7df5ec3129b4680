"""The store sink waits out backpressure (never drops a group) and fails on real refusals; a
group goes in one Append stream, a group above GROUP_STREAM_MAX_BYTES one trajectory after
another, in parts; groups finishing while a stream is in flight share the next one, each answered on
its own (a refused stream of several groups is sent again one group per stream)."""

import asyncio
import threading

import grpc
import pytest

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.rollout import sink as sink_module
from services.rollout.sink import MemorySink, StoreRejected, StoreSink, wait_for_room
from services.store.wire_metadata import RETRY_AFTER_KEY


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, metadata=()) -> None:  # noqa: ANN001
        self._code, self._metadata = code, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "segment.routing: 3 rows, expected 4"

    def trailing_metadata(self):  # noqa: ANN201
        return self._metadata


class FlakyClient:
    """Refuses the first `refusals` Append streams with `error`, then accepts."""

    def __init__(self, refusals: int, error: grpc.RpcError) -> None:
        self.refusals, self.error, self.appended = refusals, error, []
        self.streams: list[list[str]] = []

    def append_trajectories(self, trajs: list[trajectory_pb2.Trajectory]) -> None:
        if self.refusals:
            self.refusals -= 1
            raise self.error
        self.streams.append([t.trajectory_id for t in trajs])
        self.appended += self.streams[-1]

    def append_in_parts(self, traj: trajectory_pb2.Trajectory, part_bytes: int = 0) -> None:
        self.append_trajectories([traj])


def group(n: int, name: str = "t") -> list[trajectory_pb2.Trajectory]:
    return [trajectory_pb2.Trajectory(trajectory_id=f"{name}{i}") for i in range(n)]


class RefusingClient:
    """Refuses as invalid every stream holding a trajectory named `bad*`; can hold streams."""

    def __init__(self) -> None:
        self.streams: list[list[str]] = []
        self.release, self.holding = threading.Event(), threading.Event()
        self.release.set()

    def append_trajectories(self, trajs: list[trajectory_pb2.Trajectory]) -> None:
        self.holding.set()
        self.release.wait(10)
        ids = [t.trajectory_id for t in trajs]
        self.streams.append(ids)
        if any(i.startswith("bad") for i in ids):
            raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT)


async def send_all(sink: StoreSink, *groups: list[trajectory_pb2.Trajectory]) -> list:
    return await asyncio.gather(*[sink.send_group(g) for g in groups], return_exceptions=True)


def test_groups_finishing_together_share_one_stream():
    client = RefusingClient()
    sink = StoreSink(client)
    assert asyncio.run(send_all(sink, group(2, "a"), group(2, "b"), group(1, "c"))) == \
        [None] * 3
    assert client.streams == [["a0", "a1", "b0", "b1", "c0"]] and sink.streams_sent == 1


def test_a_stream_refused_as_invalid_is_resent_one_group_each():
    """Only the bad group fails, naming its own trajectories; the others are stored."""
    client = RefusingClient()
    results = asyncio.run(send_all(StoreSink(client), group(2, "a"), group(2, "bad"),
                                   group(1, "c")))
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], StoreRejected)
    assert str(results[1]).startswith("store rejected bad0, bad1: ")
    assert client.streams == [["a0", "a1", "bad0", "bad1", "c0"], ["a0", "a1"],
                              ["bad0", "bad1"], ["c0"]]


def test_groups_queue_behind_the_stream_in_flight_in_order():
    client = RefusingClient()
    client.release.clear()
    sink = StoreSink(client)

    async def main() -> list:
        first = asyncio.ensure_future(sink.send_group(group(1, "a")))
        assert await asyncio.to_thread(client.holding.wait, 10)  # "a" is in flight, held
        rest = [asyncio.ensure_future(sink.send_group(group(1, n))) for n in "bcd"]
        await asyncio.sleep(0)  # one loop turn: b, c and d queue behind it
        rest[1].cancel()  # "c" is abandoned while queued: never sent
        client.release.set()
        return await asyncio.gather(first, *rest, return_exceptions=True)

    results = asyncio.run(main())
    assert results[0] is None and results[1] is None and results[3] is None
    assert isinstance(results[2], asyncio.CancelledError)
    assert client.streams == [["a0"], ["b0", "d0"]]


def test_a_store_error_answers_every_group_of_its_stream():
    down = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    client = FlakyClient(1, down)
    results = asyncio.run(send_all(StoreSink(client), group(1, "a"), group(1, "b")))
    assert results == [down, down] and client.appended == []


def test_backpressure_slows_down_and_sends_everything():
    busy = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, ((RETRY_AFTER_KEY, "5"),))
    client = FlakyClient(3, busy)
    sink = StoreSink(client, backpressure_sleep_s=0.01)
    asyncio.run(sink.send_group(group(2)))
    assert sorted(client.appended) == ["t0", "t1"] and sink.backpressure_waits == 3
    assert client.streams == [["t0", "t1"]]  # the group in one stream, sent again whole


def test_a_large_group_goes_in_parts_one_trajectory_after_another(monkeypatch):
    monkeypatch.setattr(sink_module, "GROUP_STREAM_MAX_BYTES", 0)
    busy = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, ((RETRY_AFTER_KEY, "5"),))
    client = FlakyClient(1, busy)
    sink = StoreSink(client, backpressure_sleep_s=0.01)
    asyncio.run(sink.send_group(group(3)))
    assert client.streams == [["t0"], ["t1"], ["t2"]] and sink.backpressure_waits == 1


def test_size_limit_refusal_raises():
    error = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)  # a size limit: no retry hint
    sink = StoreSink(FlakyClient(1, error), backpressure_sleep_s=0.01)
    with pytest.raises(grpc.RpcError):
        asyncio.run(sink.send_group(group(1)))


def test_invalid_argument_is_a_rejection_naming_the_trajectory():
    sink = StoreSink(FlakyClient(1, FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT)))
    with pytest.raises(StoreRejected, match="store rejected t0: segment.routing: 3 rows"):
        asyncio.run(sink.send_group(group(1)))


class StatsClient:
    """Answers GetStats from a list of StoreStats (the last one repeats); None = store down."""

    def __init__(self, *stats) -> None:  # noqa: ANN002
        self.stats_seq, self.calls = list(stats), 0

    def stats(self):  # noqa: ANN201
        self.calls += 1
        s = self.stats_seq.pop(0) if len(self.stats_seq) > 1 else self.stats_seq[0]
        if s is None:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
        return s


def test_room_is_the_budget_less_ready_and_open_groups():
    from services.common.pb.r3flow.v1 import store_pb2

    full = store_pb2.StoreStats(max_groups_ahead=4, groups_ready=3, groups_open=1)
    sink = StoreSink(StatsClient(full, store_pb2.StoreStats(max_groups_ahead=4, groups_ready=1),
                                 None))
    assert [asyncio.run(sink.room()) for _ in range(3)] == [0, 3, 0]  # down: no room


def test_a_store_without_budget_is_asked_again_only_later():
    from services.common.pb.r3flow.v1 import store_pb2

    client = StatsClient(store_pb2.StoreStats())
    sink = StoreSink(client)
    assert asyncio.run(sink.room()) is None and asyncio.run(sink.room()) is None
    assert client.calls == 1


def test_a_worker_waits_while_the_budget_has_no_room_for_its_unsent_groups():
    """The hold ends when the trainer takes groups, not when a new version comes."""
    class Sink(MemorySink):
        def __init__(self, rooms: list[int]) -> None:
            super().__init__()
            self.rooms, self.asked = rooms, 0

        async def room(self) -> int | None:
            self.asked += 1
            return self.rooms.pop(0)

    sink = Sink([1, 1, 0, 2])  # one unsent group: room 1 holds it, 2 lets the next start
    asyncio.run(wait_for_room(sink, lambda: 1, 0.001))
    assert sink.asked == 4
    assert asyncio.run(wait_for_room(MemorySink(), lambda: 10**6, 0.001)) is None  # no budget
