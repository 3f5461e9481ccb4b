"""The torchrun backend's socket framing: exact, and the payload stays out of the pickle."""

import socket
import threading

import torch

from controller.runtime.wire import recv_message, send_message
from workers import DataProto


def test_dataproto_over_a_socket_is_exact_and_out_of_band():
    batch = DataProto(
        {"ids": torch.randint(0, 50_000, (1024, 512)), "mask": torch.ones(1024, 512, dtype=torch.bool)},
        {"uid": [f"u{i}" for i in range(1024)]},
        {"step": 7},
    )
    a, b = socket.socketpair()
    sent = {}
    sender = threading.Thread(target=lambda: sent.update(n=send_message(a, ("execute", (batch,)))))
    sender.start()
    op, (received,) = recv_message(b)
    sender.join()
    payload_bytes = 1024 * 512 * 8 + 1024 * 512
    # Framing and the pickle add only the non-tensor part on top of the raw bytes.
    assert payload_bytes < sent["n"] < payload_bytes + 64_000
    assert op == "execute"
    assert torch.equal(received["ids"], batch["ids"]) and torch.equal(received["mask"], batch["mask"])
    assert received["uid"].tolist() == batch["uid"].tolist() and received.meta_info == {"step": 7}
    a.close(), b.close()


def test_classes_defined_in_main_travel_by_value():
    namespace = {"__name__": "__main__"}
    exec("class Local:\n    def hello(self):\n        return 'hi'\n", namespace)
    a, b = socket.socketpair()
    send_message(a, namespace["Local"])
    cls = recv_message(b)
    assert cls().hello() == "hi"
    a.close(), b.close()


def test_main_classes_resolve_to_the_receivers_own_when_it_has_one():
    import sys

    main = sys.modules["__main__"]
    namespace = {"__name__": "__main__"}
    exec("class Shared:\n    pass\n", namespace)
    shared = namespace["Shared"]
    shared.__qualname__ = "Shared"
    a, b = socket.socketpair()
    had = hasattr(main, "Shared")
    setattr(main, "Shared", shared)
    try:
        send_message(a, shared)
        assert recv_message(b) is shared
    finally:
        if not had:
            delattr(main, "Shared")
        a.close(), b.close()
