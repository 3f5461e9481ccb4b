"""DeadlineThreads without a process group: the bound on calls at once, and what an overrun call does to it."""

import threading
import time

import pytest

from workers.deadline_threads import DeadlineThreads


def test_overrun_calls_keep_their_slots_or_are_abandoned_up_to_a_limit():
    never = threading.Event()
    try:
        held = DeadlineThreads(2, "test")  # tools: an overrun call keeps its slot
        assert [held.submit(never.wait, timeout_s=0.1) is not None for _ in range(2)] == [True, True]
        start = time.monotonic()
        assert held.submit(lambda: 1, timeout_s=1.0) is None  # waited for the deadlines, then refused
        assert 0.1 <= time.monotonic() - start < 1.0 and held.hung == 2

        abandoned = DeadlineThreads(2, "test", max_abandoned=3)  # rewards: it gives its slot up
        for _ in range(4):  # 4 calls that never return, 2 at a time: each pair waits out the other's deadline
            assert abandoned.submit(never.wait, timeout_s=0.1) is not None
        assert abandoned.submit(lambda: 7, timeout_s=1.0).result(timeout=1.0) == 7  # 2 of 4 past: slots free
        time.sleep(0.15)
        with pytest.raises(RuntimeError, match="4 test calls passed their deadline and never returned "
                                               r"\(more than 3\): the function hangs"):
            abandoned.submit(lambda: 7, timeout_s=1.0)
        with pytest.raises(ValueError, match="max_threads must be a positive integer, got 0"):
            DeadlineThreads(0)
    finally:
        never.set()
