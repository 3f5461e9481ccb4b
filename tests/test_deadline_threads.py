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
        assert 0.09 <= time.monotonic() - start < 5.0 and held.hung == 2

        abandoned = DeadlineThreads(2, "test", max_abandoned=4)  # rewards: it gives its slot up
        for _ in range(4):  # 4 calls that never return, 2 at a time: each pair waits out the other's deadline
            assert abandoned.submit(never.wait, timeout_s=0.1) is not None
        time.sleep(0.15)  # all 4 past their deadlines: abandoned, and their slots free
        assert abandoned.hung == 4 and abandoned.submit(lambda: 7, timeout_s=5.0).result(timeout=5.0) == 7
        assert abandoned.submit(never.wait, timeout_s=0.05) is not None
        time.sleep(0.1)
        with pytest.raises(RuntimeError, match="5 test calls passed their deadline and never returned "
                                               r"\(more than 4\): the function hangs"):
            abandoned.submit(lambda: 7, timeout_s=1.0)
        with pytest.raises(ValueError, match="max_threads must be a positive integer, got 0"):
            DeadlineThreads(0)
    finally:
        never.set()
