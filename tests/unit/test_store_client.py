"""StoreClient's request split and retry policy (no server needed)."""

from __future__ import annotations

import grpc
import pytest

from services.store.client import StoreClient
from services.store.parts import trajectory_requests
from services.store.synthetic import small_group


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, trailers: tuple = ()) -> None:
        self._code, self._trailers = code, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self) -> tuple:
        return self._trailers


def test_trajectory_is_split_into_begin_segments_finish() -> None:
    traj = small_group("g", 1, segment_lengths=(2, 3, 4))[0]
    reqs = trajectory_requests(traj)
    assert [r.sequence_number for r in reqs] == [0, 1, 2, 3, 4]
    assert [r.WhichOneof("body") for r in reqs] == ["begin", "segment", "segment", "segment",
                                                    "finish"]
    assert reqs[-1].finish.num_segments == 3 and reqs[0].begin.group_size == 1
    assert list(reqs[0].begin.prompt_token_ids) == list(traj.prompt_token_ids)


def test_retry_policy() -> None:
    client = StoreClient("127.0.0.1:1", max_retries=3, backoff_s=0.1, max_backoff_s=0.3,
                         max_backpressure_wait_s=5)
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    assert 0.05 <= client._retry_delay(unavailable, 0, 0.0) <= 0.1
    assert client._retry_delay(unavailable, 5, 0.0) is None           # out of retries
    assert client._retry_delay(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT), 0, 0) is None
    hinted = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after-ms", "200"),))
    assert 0.2 <= client._retry_delay(hinted, 9, 0.0) <= 0.3          # not counted as failure
    assert client._retry_delay(hinted, 0, 6.0) is None                # waited long enough
    too_big = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)         # size limit: no hint
    assert client._retry_delay(too_big, 0, 0.0) is None
    client.close()


def test_append_retries_transient_failures_then_succeeds() -> None:
    client = StoreClient("127.0.0.1:1", backoff_s=0.01)
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    assert client._with_retry(flaky, "test") == "ok"
    assert client.retries == 2
    client.close()


class BatchStub:
    """AppendBatch answers with `batch_error` (None: accepts); Append records the stream."""

    def __init__(self, batch_error: grpc.RpcError | None) -> None:
        self.batch_error, self.calls = batch_error, []

    def AppendBatch(self, batch, **_):  # noqa: ANN001, ANN003, ANN201, N802
        self.calls.append(("batch", len(batch.requests)))
        if self.batch_error is not None:
            raise self.batch_error
        return "batch"

    def Append(self, it, **_):  # noqa: ANN001, ANN003, ANN201, N802
        self.calls.append(("stream", len(list(it))))
        return "stream"


def test_small_trajectories_go_as_one_message_larger_as_a_stream(monkeypatch) -> None:  # noqa: ANN001
    import services.store.client as client_module

    group = small_group("g", 2)  # 2 x (begin, 2 segments, finish)
    client = StoreClient("127.0.0.1:1")
    client._stub = BatchStub(None)
    assert client.append_trajectories(group) == "batch"
    monkeypatch.setattr(client_module, "BATCH_MESSAGE_MAX_BYTES", 1)
    assert client.append_trajectories(group) == "stream"
    assert client._stub.calls == [("batch", 8), ("stream", 8)]
    client.close()


def test_a_store_without_append_batch_or_over_its_cap_gets_a_stream() -> None:
    group = small_group("g", 1)
    for error, again in ((FakeRpcError(grpc.StatusCode.UNIMPLEMENTED), "stream"),
                         (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED), "batch")):
        client = StoreClient("127.0.0.1:1")
        client._stub = BatchStub(error)
        assert client.append_trajectories(group) == "stream"
        assert client._stub.calls == [("batch", 4), ("stream", 4)]
        client._stub.calls.clear()
        client.append_trajectories(group)  # an older store is not asked again
        assert client._stub.calls[0][0] == again
        client.close()
    client = StoreClient("127.0.0.1:1")
    client._stub = BatchStub(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT))
    with pytest.raises(grpc.RpcError):  # a refusal of the content: no second try
        client.append_trajectories(group)
    client.close()
