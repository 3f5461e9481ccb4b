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

import pickle
import socket
import struct
from typing import Any

import cloudpickle

__all__ = ["send_message", "recv_message"]

_HEAD = struct.Struct("!QI")


def send_message(sock: socket.socket, obj: Any) -> int:
    """Send ``obj``; returns the bytes written. Classes defined in ``__main__`` travel by value."""
    buffers: list[pickle.PickleBuffer] = []
    payload = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
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
