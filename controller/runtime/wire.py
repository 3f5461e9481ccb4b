"""Message framing for the torchrun backend's sockets, with out-of-band buffers.

A message is a pickle (protocol 5) whose large buffers, the tensor payloads
of DataProtos and numpy arrays, travel after it as raw bytes: the sender
hands the tensors' own memory to the socket and the receiver reads each
buffer straight into the bytearray that backs the rebuilt tensor, so the
payload is never serialised into the pickle stream.

    header:  payload length (u64), buffer count (u32), buffer lengths (u64 each)
    body:    payload bytes, then each buffer's bytes
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
import sys
from typing import Any

import cloudpickle

__all__ = ["send_message", "recv_message"]

_HEAD = struct.Struct("!QI")


def _from_main(qualname: str, by_value: bytes) -> Any:
    """The receiver's own ``__main__.<qualname>`` when it has one, else the sent copy."""
    target: Any = sys.modules["__main__"]
    try:
        for part in qualname.split("."):
            target = getattr(target, part)
        return target
    except AttributeError:
        return pickle.loads(by_value)


class _Pickler(cloudpickle.Pickler):
    """Sends ``__main__`` classes and functions by name with a by-value fallback.

    Under torchrun every rank runs the same program, so a worker class from
    the launched script usually exists on the receiver too; using that one
    keeps real file names and line numbers in remote tracebacks.
    """

    def reducer_override(self, obj: Any) -> Any:
        if (
            isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__")
        ) and getattr(obj, "__module__", None) == "__main__" and "<locals>" not in obj.__qualname__:
            return _from_main, (obj.__qualname__, cloudpickle.dumps(obj, protocol=5))
        return super().reducer_override(obj)


def _dumps(obj: Any, buffer_callback) -> bytes:
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffer_callback).dump(obj)
    return stream.getvalue()


def send_message(sock: socket.socket, obj: Any) -> int:
    """Send ``obj``; returns the bytes written."""
    buffers: list[pickle.PickleBuffer] = []
    payload = _dumps(obj, buffers.append)
    raws = [buf.raw() for buf in buffers]
    header = _HEAD.pack(len(payload), len(raws)) + struct.pack(f"!{len(raws)}Q", *(r.nbytes for r in raws))
    sock.sendall(header)
    sock.sendall(payload)
    for raw in raws:
        sock.sendall(raw)
    return len(header) + len(payload) + sum(r.nbytes for r in raws)


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    received = 0
    while received < size:
        n = sock.recv_into(view[received:], size - received)
        if n == 0:
            raise ConnectionError(f"connection closed after {received} of {size} bytes")
        received += n
    return data


def recv_message(sock: socket.socket) -> Any:
    payload_len, n_buffers = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    sizes = struct.unpack(f"!{n_buffers}Q", _recv_exact(sock, 8 * n_buffers)) if n_buffers else ()
    payload = _recv_exact(sock, payload_len)
    buffers = [_recv_exact(sock, size) for size in sizes]
    return pickle.loads(payload, buffers=buffers)
