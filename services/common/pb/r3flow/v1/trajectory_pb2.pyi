from services.common.pb.r3flow.v1 import routing_pb2 as _routing_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "loss_mask", "policy_version", "routing", "sampling")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: bytes
    policy_version: int
    routing: _containers.RepeatedCompositeFieldContainer[_routing_pb2.RoutedExperts]
    sampling: SamplingParams
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[bytes] = ..., policy_version: _Optional[int] = ..., routing: _Optional[_Iterable[_Union[_routing_pb2.RoutedExperts, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "group_size", "prompt_token_ids", "segments", "reward", "reward_components", "finish_reason", "worker_id", "prompt_id", "epoch", "run_id")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    group_size: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    finish_reason: FinishReason
    worker_id: str
    prompt_id: str
    epoch: int
    run_id: str
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., worker_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., epoch: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...
