"""HangWatch's deadlines without a process group: from each call's own recent durations, or fixed."""

from controller.runtime.hang_watch import HangWatch


def test_a_call_gets_ten_times_its_slowest_recent_duration_at_least_a_minute_a_first_call_twenty_five():
    watch = HangWatch(None)
    assert watch.deadline_s("actor", "update_actor") == 1500.0  # never seen: it compiles and warms up
    for seconds in (2.0, 9.0, 3.0):
        watch.record("actor", "update_actor", seconds)
    assert watch.deadline_s("actor", "update_actor") == 90.0  # 10 x the slowest of the recent ones
    watch.record("rollout", "generate_sequences", 0.5)
    assert watch.deadline_s("rollout", "generate_sequences") == 60.0  # never under a minute
    for _ in range(8):  # the slow one leaves the window of the last 8
        watch.record("actor", "update_actor", 1.0)
    assert watch.deadline_s("actor", "update_actor") == 60.0
    assert HangWatch(None, fixed_s=8.0).deadline_s("actor", "update_actor") == 8.0  # trainer.hang_timeout_s
