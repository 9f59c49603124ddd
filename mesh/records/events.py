"""TensorBoard event files, written on the caller's thread: one record per step.

torch's ``SummaryWriter`` writes from a background thread, so a write that fails there
(a full disk) prints that thread's traceback and comes back as an exception from a
later, unrelated call. Building each step's record here and appending it where the
step is logged makes a failure an ordinary exception of the step that was not logged.
"""

from __future__ import annotations

import io
import os
import socket
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter


def event_file(directory: Path) -> Path:
    """A new event file's path, named as TensorBoard looks for them."""
    return directory / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"


def header() -> bytes:
    """The record every event file starts with."""
    return _record(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))


def scalars(step: int, values: dict[str, float]) -> bytes:
    """One step's scalars as one record."""
    summary = summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=name, simple_value=value) for name, value in values.items()]
    )
    return _record(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))


def _record(event: event_pb2.Event) -> bytes:
    buffer = io.BytesIO()
    RecordWriter(buffer).write(event.SerializeToString())
    return buffer.getvalue()
