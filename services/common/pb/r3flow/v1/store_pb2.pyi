from services.common.pb.r3flow.v1 import routing_pb2 as _routing_pb2
from services.common.pb.r3flow.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrajectoryBegin(_message.Message):
    __slots__ = ("group_id", "group_size", "prompt_token_ids", "worker_id", "prompt_id", "epoch", "run_id")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    group_size: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    worker_id: str
    prompt_id: str
    epoch: int
    run_id: str
    def __init__(self, group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., worker_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., epoch: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class TrajectoryFinish(_message.Message):
    __slots__ = ("num_segments", "reward", "reward_components", "finish_reason")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NUM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    num_segments: int
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    finish_reason: _trajectory_pb2.FinishReason
    def __init__(self, num_segments: _Optional[int] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., finish_reason: _Optional[_Union[_trajectory_pb2.FinishReason, str]] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("trajectory_id", "sequence_number", "begin", "segment", "finish", "part", "more_parts")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    MORE_PARTS_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    sequence_number: int
    begin: TrajectoryBegin
    segment: _trajectory_pb2.Segment
    finish: TrajectoryFinish
    part: int
    more_parts: bool
    def __init__(self, trajectory_id: _Optional[str] = ..., sequence_number: _Optional[int] = ..., begin: _Optional[_Union[TrajectoryBegin, _Mapping]] = ..., segment: _Optional[_Union[_trajectory_pb2.Segment, _Mapping]] = ..., finish: _Optional[_Union[TrajectoryFinish, _Mapping]] = ..., part: _Optional[int] = ..., more_parts: _Optional[bool] = ...) -> None: ...

class AppendBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[AppendRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[AppendRequest, _Mapping]]] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("accepted", "duplicates", "policy_version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    policy_version: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("consumer", "max_groups", "lease_seconds", "wait_ms", "session")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    max_groups: int
    lease_seconds: int
    wait_ms: int
    session: str
    def __init__(self, consumer: _Optional[str] = ..., max_groups: _Optional[int] = ..., lease_seconds: _Optional[int] = ..., wait_ms: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class PulledGroup(_message.Message):
    __slots__ = ("delivery_id", "group_id", "trajectories", "delivery_count")
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    delivery_id: str
    group_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    delivery_count: int
    def __init__(self, delivery_id: _Optional[str] = ..., group_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ..., delivery_count: _Optional[int] = ...) -> None: ...

class PulledPart(_message.Message):
    __slots__ = ("group", "trajectory", "segment", "routing", "parts")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    group: PulledGroup
    trajectory: _trajectory_pb2.Trajectory
    segment: _trajectory_pb2.Segment
    routing: _routing_pb2.RoutedExperts
    parts: int
    def __init__(self, group: _Optional[_Union[PulledGroup, _Mapping]] = ..., trajectory: _Optional[_Union[_trajectory_pb2.Trajectory, _Mapping]] = ..., segment: _Optional[_Union[_trajectory_pb2.Segment, _Mapping]] = ..., routing: _Optional[_Union[_routing_pb2.RoutedExperts, _Mapping]] = ..., parts: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("consumer", "delivery_ids", "dropped")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    delivery_ids: _containers.RepeatedScalarFieldContainer[str]
    dropped: _containers.RepeatedCompositeFieldContainer[DroppedDelivery]
    def __init__(self, consumer: _Optional[str] = ..., delivery_ids: _Optional[_Iterable[str]] = ..., dropped: _Optional[_Iterable[_Union[DroppedDelivery, _Mapping]]] = ...) -> None: ...

class DroppedDelivery(_message.Message):
    __slots__ = ("delivery_id", "reason", "trajectories")
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    delivery_id: str
    reason: str
    trajectories: int
    def __init__(self, delivery_id: _Optional[str] = ..., reason: _Optional[str] = ..., trajectories: _Optional[int] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class PolicyVersion(_message.Message):
    __slots__ = ("version", "run_id", "run_start_version", "trainer_gone")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_START_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_GONE_FIELD_NUMBER: _ClassVar[int]
    version: int
    run_id: str
    run_start_version: int
    trainer_gone: bool
    def __init__(self, version: _Optional[int] = ..., run_id: _Optional[str] = ..., run_start_version: _Optional[int] = ..., trainer_gone: _Optional[bool] = ...) -> None: ...

class TrainerPresence(_message.Message):
    __slots__ = ("consumer", "run_id", "leaving")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    run_id: str
    leaving: bool
    def __init__(self, consumer: _Optional[str] = ..., run_id: _Optional[str] = ..., leaving: _Optional[bool] = ...) -> None: ...

class TrainerPresenceResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    def __init__(self, ttl_seconds: _Optional[int] = ...) -> None: ...

class WatchPolicyVersionRequest(_message.Message):
    __slots__ = ("known_version",)
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    known_version: int
    def __init__(self, known_version: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("trajectories_appended", "trajectories_complete", "groups_ready", "groups_delivered", "groups_acked", "backlog_tokens", "dropped_stale", "redeliveries", "policy_version", "dropped_by_reason", "groups_leased", "groups_open", "max_groups_ahead", "groups_dead_lettered", "run_id", "run_start_version", "trainer_gone")
    class DroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRAJECTORIES_APPENDED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_READY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_ACKED_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    REDELIVERIES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    GROUPS_LEASED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_OPEN_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_START_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_GONE_FIELD_NUMBER: _ClassVar[int]
    trajectories_appended: int
    trajectories_complete: int
    groups_ready: int
    groups_delivered: int
    groups_acked: int
    backlog_tokens: int
    dropped_stale: int
    redeliveries: int
    policy_version: int
    dropped_by_reason: _containers.ScalarMap[str, int]
    groups_leased: int
    groups_open: int
    max_groups_ahead: int
    groups_dead_lettered: int
    run_id: str
    run_start_version: int
    trainer_gone: bool
    def __init__(self, trajectories_appended: _Optional[int] = ..., trajectories_complete: _Optional[int] = ..., groups_ready: _Optional[int] = ..., groups_delivered: _Optional[int] = ..., groups_acked: _Optional[int] = ..., backlog_tokens: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., redeliveries: _Optional[int] = ..., policy_version: _Optional[int] = ..., dropped_by_reason: _Optional[_Mapping[str, int]] = ..., groups_leased: _Optional[int] = ..., groups_open: _Optional[int] = ..., max_groups_ahead: _Optional[int] = ..., groups_dead_lettered: _Optional[int] = ..., run_id: _Optional[str] = ..., run_start_version: _Optional[int] = ..., trainer_gone: _Optional[bool] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "host", "world_size", "policy_version", "device_uuid", "run_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    world_size: int
    policy_version: int
    device_uuid: str
    run_id: str
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., world_size: _Optional[int] = ..., policy_version: _Optional[int] = ..., device_uuid: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    def __init__(self, ttl_seconds: _Optional[int] = ...) -> None: ...

class UnregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class UnregisterWorkerResponse(_message.Message):
    __slots__ = ("was_registered",)
    WAS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    was_registered: bool
    def __init__(self, was_registered: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerList(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class WeightSyncPlan(_message.Message):
    __slots__ = ("version", "master_addr", "master_port", "members", "backend", "wire_dtype", "bucket_bytes", "run_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    master_addr: str
    master_port: int
    members: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    backend: str
    wire_dtype: str
    bucket_bytes: int
    run_id: str
    def __init__(self, version: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., members: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., backend: _Optional[str] = ..., wire_dtype: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class WatchWeightSyncRequest(_message.Message):
    __slots__ = ("worker_id", "known_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    known_version: int
    def __init__(self, worker_id: _Optional[str] = ..., known_version: _Optional[int] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
