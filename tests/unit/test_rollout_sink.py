"""The store sink waits out backpressure (never drops a group) and fails on real refusals."""

import asyncio

import grpc
import pytest

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.rollout.sink import StoreRejected, StoreSink
from services.store.client import RETRY_AFTER_KEY


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
    """Refuses the first `refusals` appends with `error`, then accepts."""

    def __init__(self, refusals: int, error: grpc.RpcError) -> None:
        self.refusals, self.error, self.appended = refusals, error, []

    def append_trajectory(self, traj: trajectory_pb2.Trajectory) -> None:
        if self.refusals:
            self.refusals -= 1
            raise self.error
        self.appended.append(traj.trajectory_id)


def group(n: int) -> list[trajectory_pb2.Trajectory]:
    return [trajectory_pb2.Trajectory(trajectory_id=f"t{i}") for i in range(n)]


def test_backpressure_slows_down_and_sends_everything():
    busy = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, ((RETRY_AFTER_KEY, "5"),))
    client = FlakyClient(3, busy)
    sink = StoreSink(client, backpressure_sleep_s=0.01)
    asyncio.run(sink.send_group(group(2)))
    assert sorted(client.appended) == ["t0", "t1"] and sink.backpressure_waits == 3


def test_size_limit_refusal_raises():
    error = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)  # a size limit: no retry hint
    sink = StoreSink(FlakyClient(1, error), backpressure_sleep_s=0.01)
    with pytest.raises(grpc.RpcError):
        asyncio.run(sink.send_group(group(1)))


def test_invalid_argument_is_a_rejection_naming_the_trajectory():
    sink = StoreSink(FlakyClient(1, FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT)))
    with pytest.raises(StoreRejected, match="store rejected t0: segment.routing: 3 rows"):
        asyncio.run(sink.send_group(group(1)))
