"""TensorBoard event files, written and read without the tensorboard package.

An event file is TensorFlow's TFRecord framing (length, masked CRC-32C of the length, the
record, masked CRC-32C of the record) around `Event` protos; a scalar is an Event whose Summary
holds one `Value(tag, simple_value)`. The two messages are declared here with the field numbers
of tensorflow/core/util/event.proto and tensorflow/core/framework/summary.proto (a private
descriptor pool, so a tensorboard installed beside us never sees a clash), and TensorBoard's own
reader (tensorboard.backend.event_processing) loads the files as it loads its own writer's.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

FILE_VERSION = "brain.Event:2"
_F = descriptor_pb2.FieldDescriptorProto


def _messages() -> tuple[Any, Any]:
    """(Event, Summary) message classes with TensorFlow's field numbers (scalars only)."""
    fd = descriptor_pb2.FileDescriptorProto(name="r3flow_tb_event.proto", package="r3flow.tb")
    summary = fd.message_type.add(name="Summary")
    value = summary.nested_type.add(name="Value")
    value.field.add(name="tag", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=_F.TYPE_FLOAT, label=_F.LABEL_OPTIONAL)
    summary.field.add(name="value", number=1, type=_F.TYPE_MESSAGE, label=_F.LABEL_REPEATED,
                      type_name=".r3flow.tb.Summary.Value")
    event = fd.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=_F.TYPE_DOUBLE, label=_F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=_F.TYPE_INT64, label=_F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=_F.TYPE_MESSAGE, label=_F.LABEL_OPTIONAL,
                    type_name=".r3flow.tb.Summary")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("r3flow.tb.Event")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("r3flow.tb.Summary")))


Event, Summary = _messages()


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use it."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the record, its masked CRC."""
    head = struct.pack("<Q", len(record))
    return (head + struct.pack("<I", _masked(head)) + record
            + struct.pack("<I", _masked(record)))


class EventWriter:
    """Appends scalar events to a new `events.out.tfevents.<time>.<host>` file in `log_dir`."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}"
        self._write(Event(wall_time=time.time(), file_version=FILE_VERSION))

    def _write(self, event: Any) -> None:
        # opened per step: a reader (TensorBoard, the run report) sees every step at once, and
        # there is no handle to leak (one event per step)
        with self.path.open("ab") as f:
            f.write(frame(event.SerializeToString()))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event holding every (tag, value) of a step."""
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._write(Event(wall_time=time.time(), step=step, summary=summary))


def read_records(path: Path) -> list[bytes]:
    """The records of a TFRecord file; ValueError on a bad CRC or a cut record."""
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        if at + 12 > len(data):
            raise ValueError(f"{path}: record header cut at byte {at}")
        head = data[at:at + 8]
        (n,), (crc,) = struct.unpack("<Q", head), struct.unpack("<I", data[at + 8:at + 12])
        record = data[at + 12:at + 12 + n]
        tail = data[at + 12 + n:at + 16 + n]
        if crc != _masked(head) or len(tail) < 4 or struct.unpack("<I", tail)[0] != _masked(record):
            raise ValueError(f"{path}: bad record at byte {at}")
        out.append(record)
        at += 16 + n
    return out


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in `log_dir`, in file and write order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for record in read_records(path):
            event = Event.FromString(record)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out
