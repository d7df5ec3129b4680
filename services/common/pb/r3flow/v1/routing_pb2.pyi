from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutingCodec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTING_CODEC_UNSPECIFIED: _ClassVar[RoutingCodec]
    ROUTING_CODEC_R3C: _ClassVar[RoutingCodec]
ROUTING_CODEC_UNSPECIFIED: RoutingCodec
ROUTING_CODEC_R3C: RoutingCodec

class RoutedExperts(_message.Message):
    __slots__ = ("shape", "num_experts", "codec", "data", "start_row", "checksum", "layer_ids")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    START_ROW_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_experts: int
    codec: RoutingCodec
    data: bytes
    start_row: int
    checksum: int
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., num_experts: _Optional[int] = ..., codec: _Optional[_Union[RoutingCodec, str]] = ..., data: _Optional[bytes] = ..., start_row: _Optional[int] = ..., checksum: _Optional[int] = ..., layer_ids: _Optional[_Iterable[int]] = ...) -> None: ...
