"""StoreClient: the one client of the TrajectoryStore, used by rollout workers and trainers.

Appends are idempotent per (trajectory_id, sequence_number), so on a transient failure
(UNAVAILABLE, DEADLINE_EXCEEDED, a dropped connection, or RESOURCE_EXHAUSTED with a
`retry-after-ms` hint from backpressure) the client simply re-sends the whole stream; what the
store already has counts as duplicates. Other errors (INVALID_ARGUMENT, ...) raise at once.

    client = StoreClient("127.0.0.1:50051")
    client.wait_ready(30)
    client.append_trajectory(traj)                        # rollout worker
    groups = client.pull("trainer-0", max_groups=4, lease_seconds=600, wait_ms=1000)
    ...train on [t for g in groups for t in g.trajectories]...
    client.ack("trainer-0", [g.delivery_id for g in groups])
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import ClientAuth
from services.common.errors import UserError
from services.common.pb.r3flow.v1 import store_pb2, store_pb2_grpc, trajectory_pb2
from services.store.errors import RateLimit, UnackedFull
from services.store.parts import GroupAssembler, iter_trajectory_requests, trajectory_requests
from services.store.wire_metadata import APPEND_MESSAGES_KEY, REFUSAL_REASON_KEY, RETRY_AFTER_KEY

log = logging.getLogger(__name__)

T = TypeVar("T")
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.ABORTED}


class StoreNotReady(UserError, TimeoutError):
    """The store did not turn SERVING in time: at start, most often a wrong address."""

_MAX_MESSAGE = 1 << 30
# Trajectories up to this many bytes go as one AppendBatch message, larger ones as an Append
# stream (per-message costs weigh nothing next to their payload there); well under the store's
# transport cap (4 x max_message_bytes + 1 MiB) for any max_message_bytes >= 1 MiB.
BATCH_MESSAGE_MAX_BYTES = 4 << 20
# Routing bytes per part of a segment appended in parts (append_in_parts).
PART_BYTES = 4 << 20


REFUSAL_LOG_EVERY_S = 60.0  # a limit that keeps refusing is logged again this often


def _trailer(err: grpc.RpcError, name: str) -> str | None:
    for key, value in (err.trailing_metadata() or ()):
        if key == name:
            return value
    return None


def _retry_after_ms(err: grpc.RpcError) -> int | None:
    value = _trailer(err, RETRY_AFTER_KEY)
    return None if value is None else int(value)


class StoreClient:
    """Blocking client with retries; thread-safe (one gRPC channel)."""

    def __init__(self, address: str, *, timeout_s: float = 60.0, max_retries: int = 10,
                 backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 max_backpressure_wait_s: float = 600.0, auth: ClientAuth | None = None,
                 pull_chunks: bool = True) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_backpressure_wait_s = max_backpressure_wait_s
        self._refusals = RateLimit(REFUSAL_LOG_EVERY_S)
        self.retries = 0  # transient failures retried so far (for tests and worker metrics)
        self._append_batch = True  # False once the store answered UNIMPLEMENTED
        # PullChunks (parts of one routing chunk each); False: whole groups (Pull), as before
        # PullChunks existed, and once a store answered UNIMPLEMENTED
        self._pull_chunks = pull_chunks
        auth = auth or ClientAuth()  # no TLS, no token: local mode
        self._metadata = auth.metadata
        self._channel = auth.channel(address, options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE)])
        self._stub = store_pb2_grpc.TrajectoryStoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- retry machinery ------------------------------------------------------------------
    def _with_retry(self, call: Callable[[], T], what: str) -> T:
        failures, waited = 0, 0.0
        while True:
            try:
                result = call()
            except grpc.RpcError as err:
                delay = self._retry_delay(err, failures, waited)
                if delay is None:
                    raise
                if err.code() in _TRANSIENT:
                    failures += 1
                waited += delay
                self.retries += 1
                self._log_retry(what, err, delay)
                time.sleep(delay)
            else:
                return result

    def _log_retry(self, what: str, err: grpc.RpcError, delay: float) -> None:
        """A refusal is a WARNING naming the limit and what the store holds (its message) the
        first time a limit refuses and then at most every REFUSAL_LOG_EVERY_S (a budget that
        throttles the rollouts refuses all the time); other retries are DEBUG."""
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            reason = _trailer(err, REFUSAL_REASON_KEY) or ""
            if self._refusals.due(reason):
                log.warning("%s refused by the store at %s: %s; retrying for up to %.0f s",
                            what, self.address, err.details(), self.max_backpressure_wait_s)
                return
        log.debug("%s failed (%s); retrying in %.2fs", what, err.code().name, delay)

    def _retry_delay(self, err: grpc.RpcError, failures: int, waited: float) -> float | None:
        code = err.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            hint = _retry_after_ms(err)
            if hint is None or waited >= self.max_backpressure_wait_s:
                return None  # a size limit, not backpressure: retrying cannot help
            return hint / 1000 * random.uniform(1.0, 1.5)
        if code not in _TRANSIENT or failures >= self.max_retries:
            return None
        return min(self.max_backoff_s, self.backoff_s * 2 ** failures) * random.uniform(0.5, 1.0)

    # ---- append -------------------------------------------------------------------------
    def append_trajectory(self, traj: trajectory_pb2.Trajectory) -> store_pb2.AppendResponse:
        """Append a complete trajectory (begin, segments, finish) in one retried stream."""
        return self.append(trajectory_requests(traj))

    def append_trajectories(self, trajs: Sequence[trajectory_pb2.Trajectory]
                            ) -> store_pb2.AppendResponse:
        """Append several complete trajectories (finished GRPO groups) as one Append stream:
        in one AppendBatch message when they are small (up to BATCH_MESSAGE_MAX_BYTES)."""
        reqs = [req for t in trajs for req in trajectory_requests(t)]
        if self._append_batch and sum(t.ByteSize() for t in trajs) <= BATCH_MESSAGE_MAX_BYTES:
            batch = store_pb2.AppendBatchRequest(requests=reqs)
            try:
                return self._with_retry(lambda: self._stub.AppendBatch(
                    batch, timeout=self.timeout_s, metadata=self._metadata), "append batch")
            except grpc.RpcError as err:
                if not self._stream_instead(err):
                    raise
        return self.append(reqs)

    def append_in_parts(self, traj: trajectory_pb2.Trajectory,
                        part_bytes: int = PART_BYTES) -> int:
        """Append a long trajectory one message per Append stream, its segments in parts of
        about `part_bytes` (neither side holds more than a part in a message); each message is
        retried alone (the store dedups). Returns the messages the store accepted."""
        accepted = 0
        for req in iter_trajectory_requests(traj, part_bytes):
            accepted += self.append([req]).accepted
        return accepted

    def _stream_instead(self, err: grpc.RpcError) -> bool:
        """An AppendBatch refusal that an Append stream of the same requests may not get: a
        store without the method (older), or a message over its transport cap (a size
        refusal without retry hint: the stream meets the store's own size checks instead)."""
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            log.warning("store at %s has no AppendBatch: appending as streams", self.address)
            self._append_batch = False
            return True
        return err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _retry_after_ms(err) is None

    def append(self, requests: Sequence[store_pb2.AppendRequest]) -> store_pb2.AppendResponse:
        """Stream `requests` (re-sent whole on transient failure; the store dedups)."""
        reqs = list(requests)
        # The count lets the store tell a stream cut short from a whole one (wire_metadata).
        metadata = (*self._metadata, (APPEND_MESSAGES_KEY, str(len(reqs))))
        return self._with_retry(
            lambda: self._stub.Append(iter(reqs), timeout=self.timeout_s, metadata=metadata),
            "append")

    # ---- trainer side ---------------------------------------------------------------------
    def pull(self, consumer: str, max_groups: int = 1, lease_seconds: int = 0,
             wait_ms: int = 0, session: str = "") -> list[store_pb2.PulledGroup]:
        """Lease up to `max_groups` complete groups; ack them with `ack` after training.
        `session` (one per puller process): its own expired leases are renewed, not counted
        as redeliveries toward the store's dead-letter limit."""
        req = store_pb2.PullRequest(consumer=consumer, max_groups=max_groups,
                                    lease_seconds=lease_seconds, wait_ms=wait_ms,
                                    session=session)
        return self._with_retry(lambda: self._pull_once(req), "pull")

    def _pull_once(self, req: store_pb2.PullRequest) -> list[store_pb2.PulledGroup]:
        if self._pull_chunks:
            try:
                return self._pull_parts(req)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.warning("store at %s has no PullChunks: pulling whole groups", self.address)
                self._pull_chunks = False
        got: list[store_pb2.PulledGroup] = []
        try:
            for group in self._stub.Pull(req, timeout=self.timeout_s + req.wait_ms / 1000,
                                         metadata=self._metadata):
                got.append(group)
        except grpc.RpcError as err:
            self._keep_received(err, got)
        return got

    def _pull_parts(self, req: store_pb2.PullRequest) -> list[store_pb2.PulledGroup]:
        """PullChunks: every message at most one routing chunk (services/store/parts.py)."""
        asm = GroupAssembler()
        try:
            for part in self._stub.PullChunks(req, timeout=self.timeout_s + req.wait_ms / 1000,
                                              metadata=self._metadata):
                asm.add(part)
        except grpc.RpcError as err:
            self._keep_received(err, asm.groups)
        if asm.cut_short:  # an OK end inside a group: never hand over half a group
            log.warning("pull: the store's stream ended inside a group; it is redelivered "
                        "after its lease")
        return asm.groups

    @staticmethod
    def _keep_received(err: grpc.RpcError, got: list[store_pb2.PulledGroup]) -> None:
        """Re-raise a failed pull unless whole groups were received before it failed."""
        if not got and _trailer(err, REFUSAL_REASON_KEY) == "unacked":
            raise UnackedFull(err.details()) from None  # only an ack helps: no retry
        if not got:
            raise err
        # Groups received are leased to us: hand them over rather than lose them until their
        # lease expires.

    def ack(self, consumer: str, delivery_ids: Sequence[str],
            dropped: Sequence[tuple[str, str, int]] = ()) -> int:
        """Ack delivered groups, and `dropped` (delivery id, reason, trajectories) ones as
        quarantined; returns how many were acked now (0 for repeats)."""
        req = store_pb2.AckRequest(consumer=consumer, delivery_ids=list(delivery_ids), dropped=[
            store_pb2.DroppedDelivery(delivery_id=d, reason=r, trajectories=n)
            for d, r, n in dropped])
        return self._with_retry(lambda: self._stub.Ack(
            req, timeout=self.timeout_s, metadata=self._metadata).acked, "ack")

    # ---- versions, stats, workers ---------------------------------------------------------
    def publish_policy_version(self, version: int) -> int:
        """Publish a new policy version; returns the store's current (max) version."""
        req = store_pb2.PolicyVersion(version=version)
        return self._with_retry(lambda: self._stub.PublishPolicyVersion(
            req, timeout=self.timeout_s, metadata=self._metadata).version, "publish version")

    def start_run(self, run_id: str, version: int) -> store_pb2.PolicyVersion:
        """Start (or resume) training run `run_id` at `version` (run fencing, docs/store.md);
        returns the store's version and the run's start version."""
        if not run_id:
            raise ValueError("run_id: required (an empty one only publishes a version)")
        req = store_pb2.PolicyVersion(version=version, run_id=run_id)
        return self._with_retry(lambda: self._stub.PublishPolicyVersion(
            req, timeout=self.timeout_s, metadata=self._metadata), "start run")

    def watch_policy_version(self, known_version: int = -1
                             ) -> Iterator[store_pb2.PolicyVersion]:
        """Yield each policy version newer than `known_version`, and each change of
        `trainer_gone` (reconnects on failure)."""
        yield from self._watch(lambda known: self._stub.WatchPolicyVersion(
            store_pb2.WatchPolicyVersionRequest(known_version=known),
            metadata=self._metadata), known_version)

    def trainer_heartbeat(self, consumer: str, run_id: str = "", leaving: bool = False) -> int:
        """The trainer is present (renew within the returned TTL in seconds) or leaving."""
        req = store_pb2.TrainerPresence(consumer=consumer, run_id=run_id, leaving=leaving)
        return self._with_retry(lambda: self._stub.TrainerHeartbeat(
            req, timeout=self.timeout_s, metadata=self._metadata).ttl_seconds, "heartbeat")

    def stats(self) -> store_pb2.StoreStats:
        return self._with_retry(lambda: self._stub.GetStats(
            store_pb2.StatsRequest(), timeout=self.timeout_s, metadata=self._metadata), "stats")

    def register_worker(self, worker_id: str, host: str, world_size: int = 1,
                        policy_version: int = 0, device_uuid: str = "", run_id: str = "") -> int:
        """Register (or renew) a rollout worker (`device_uuid`: its single-rank engine's GPU;
        `run_id`: the run whose weights it serves); returns the TTL in seconds."""
        info = store_pb2.WorkerInfo(worker_id=worker_id, host=host, world_size=world_size,
                                    policy_version=policy_version, device_uuid=device_uuid,
                                    run_id=run_id)
        return self._with_retry(lambda: self._stub.RegisterWorker(
            info, timeout=self.timeout_s, metadata=self._metadata).ttl_seconds, "register")

    def unregister_worker(self, worker_id: str, timeout_s: float = 5.0) -> bool:
        """Withdraw a worker's registration (graceful shutdown); False if it had none. One
        attempt, no retries: it runs while shutting down, when the store may be gone (the
        registration then expires with its TTL)."""
        req = store_pb2.UnregisterWorkerRequest(worker_id=worker_id)
        return self._stub.UnregisterWorker(req, timeout=min(timeout_s, self.timeout_s),
                                           metadata=self._metadata).was_registered

    def list_workers(self) -> list[store_pb2.WorkerInfo]:
        return list(self._with_retry(lambda: self._stub.ListWorkers(
            store_pb2.ListWorkersRequest(), timeout=self.timeout_s,
            metadata=self._metadata).workers, "list workers"))

    def publish_weight_sync(self, plan: store_pb2.WeightSyncPlan) -> None:
        self._with_retry(lambda: self._stub.PublishWeightSync(
            plan, timeout=self.timeout_s, metadata=self._metadata), "publish weight sync")

    def watch_weight_sync(self, worker_id: str, known_version: int = -1
                          ) -> Iterator[store_pb2.WeightSyncPlan]:
        """Yield each weight-sync plan newer than `known_version` (reconnects on failure)."""
        yield from self._watch(lambda known: self._stub.WatchWeightSync(
            store_pb2.WatchWeightSyncRequest(worker_id=worker_id, known_version=known),
            metadata=self._metadata), known_version)

    def _watch(self, open_stream: Callable[[int], Iterator[T]], known: int) -> Iterator[T]:
        failures = 0
        while True:
            try:
                for msg in open_stream(known):
                    failures = 0
                    known = msg.version  # type: ignore[attr-defined]
                    yield msg
                # The server ended the stream (it is shutting down): reconnect like a failure.
                if failures >= self.max_retries:
                    return
            except grpc.RpcError as err:
                if err.code() not in _TRANSIENT or failures >= self.max_retries:
                    raise
                failures += 1
                self.retries += 1
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** failures))

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the store reports SERVING on grpc.health.v1 (TimeoutError otherwise)."""
        deadline = time.monotonic() + timeout_s
        req = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                resp = self._health.Check(req, timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not up yet
            if time.monotonic() > deadline:
                raise StoreNotReady(f"store at {self.address} not SERVING after {timeout_s}s",
                                    hint="check the store address (--store) and that the "
                                    "store is running")
            time.sleep(0.05)
