"""The step's phases as a dataflow over pools (``controller.rl.phase_flow``), with no process: phases on
disjoint pools overlap, a shared pool takes turns in the given order, a phase waits for what it reads, a
failure stops the flow and is raised as it was; the timeline's metrics against the interval union by hand."""

import threading
import time

import pytest

from controller.algorithms import StepState
from controller.rl.phase_flow import Phase, PhaseFlow, check_phases, startable
from controller.rl.step_metrics import timeline_metrics

NAP = 0.15


def sleeper(log: list, name: str, seconds: float = NAP, result=None):
    def run():
        log.append(("start", name, threading.get_ident()))
        time.sleep(seconds)
        log.append(("end", name, threading.get_ident()))
        return result if result is not None else name
    return run


def intervals(state: StepState) -> dict[str, tuple[float, float]]:
    return {phase: (start, end) for _, phase, start, end in state.phases}


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_phases_on_disjoint_pools_run_at_the_same_time_and_a_shared_pool_takes_turns():
    log, state = [], StepState(0)
    phases = [Phase("old_log_prob", "default", sleeper(log, "old_log_prob"), reads=("responses",)),
              Phase("ref", "default", sleeper(log, "ref"), reads=("responses",)),
              Phase("values", "critic", sleeper(log, "values"), reads=("responses",))]
    start = time.perf_counter()
    out = PhaseFlow(overlap=True).run(phases, state, ready=("responses",))
    wall = time.perf_counter() - start
    assert out == {"old_log_prob": "old_log_prob", "ref": "ref", "values": "values"}
    spans = intervals(state)
    assert overlaps(spans["values"], spans["old_log_prob"])  # the critic's pool beside the actor's
    assert spans["ref"][0] >= spans["old_log_prob"][1]  # the shared pool: in the order given
    assert 2 * NAP <= wall < 3 * NAP  # the two turns of "default"; "values" hidden behind them
    assert {pool for pool, *_ in state.phases} == {"default", "critic"}


def test_without_overlap_the_phases_run_in_order_on_the_calling_thread():
    log, state = [], StepState(0)
    phases = [Phase(name, pool, sleeper(log, name, 0.02)) for name, pool in (("a", "x"), ("b", "y"), ("c", "z"))]
    PhaseFlow(overlap=False).run(phases, state)
    assert [(kind, name) for kind, name, _ in log] == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b"),
                                                       ("start", "c"), ("end", "c")]
    assert {thread for *_, thread in log} == {threading.get_ident()}
    spans = intervals(state)
    assert spans["a"][1] <= spans["b"][0] and spans["b"][1] <= spans["c"][0]


def test_a_phase_starts_once_what_it_reads_is_written_even_on_a_free_pool():
    log, state = [], StepState(0)
    phases = [Phase("values", "critic", sleeper(log, "values"), writes=("values",)),
              Phase("old_log_prob", "default", sleeper(log, "old_log_prob", 2 * NAP), writes=("old_log_probs",)),
              Phase("adv", "driver", sleeper(log, "adv", 0.01), reads=("values", "old_log_probs"), writes=("advantages",)),
              Phase("update_critic", "critic", sleeper(log, "update_critic"), reads=("advantages",))]
    PhaseFlow().run(phases, state)
    spans = intervals(state)
    assert spans["adv"][0] >= max(spans["values"][1], spans["old_log_prob"][1])
    assert spans["update_critic"][0] >= spans["adv"][1]  # its pool was free long before; its input was not


def test_a_failing_phase_stops_the_flow_and_its_error_is_raised_as_it_was():
    class WorkerDied(RuntimeError):
        pass

    log = []

    def dies():
        time.sleep(0.02)
        raise WorkerDied("rank 0 of critic")

    phases = [Phase("values", "critic", dies, writes=("values",)),
              Phase("old_log_prob", "default", sleeper(log, "old_log_prob")),
              Phase("update_critic", "critic", sleeper(log, "update_critic"), reads=("values",))]
    with pytest.raises(WorkerDied, match="rank 0 of critic"):
        PhaseFlow().run(phases, StepState(0))
    # the running phase was waited for (it ended), the one after the failure never started
    assert [(kind, name) for kind, name, _ in log] == [("start", "old_log_prob"), ("end", "old_log_prob")]


def test_a_miswired_flow_is_refused_before_any_phase_runs():
    ran = []
    with pytest.raises(ValueError, match=r"phase 'adv' reads \['values'\], which no earlier phase writes"):
        PhaseFlow().run([Phase("adv", "driver", lambda: ran.append(1), reads=("values",)),
                         Phase("values", "critic", lambda: ran.append(2), writes=("values",))])
    with pytest.raises(ValueError, match="phase 'ref' is listed twice"):
        check_phases([Phase("ref", "a", print), Phase("ref", "b", print)], ())
    assert ran == []


def test_startable_keeps_a_shared_pools_order_and_one_phase_a_pool():
    a1, a2 = Phase("a1", "a", print, reads=("x",)), Phase("a2", "a", print)
    b1, b2 = Phase("b1", "b", print), Phase("b2", "b", print)
    # a1 waits for x, so a2 may not jump ahead of it; b1 starts, b2 waits for b's turn
    assert startable([a1, a2, b1, b2], written=set(), busy=set()) == [b1]
    assert startable([a1, a2, b1, b2], written={"x"}, busy={"b"}) == [a1]


def test_timeline_metrics_are_each_phases_span_and_each_pools_idle_time():
    phases = [("default", "rollout", 0.0, 2.0), ("default", "old_log_prob", 2.5, 3.0), ("critic", "values", 2.5, 3.5),
              ("driver", "adv", 3.5, 3.6), ("default", "update_actor", 3.6, 5.0), ("critic", "update_critic", 3.6, 4.0),
              ("default", "reward", 2.0, 2.5), ("default", "reward", 5.0, 5.5)]  # run twice: one span over both
    metrics = timeline_metrics(phases, 6.0, {"default", "critic"})
    assert metrics["timing_s/phase/critic/values/start"] == 2.5 and metrics["timing_s/phase/critic/values/end"] == 3.5
    assert (metrics["timing_s/phase/default/reward/start"], metrics["timing_s/phase/default/reward/end"]) == (2.0, 5.5)
    # busy: default [0, 3] and [3.6, 5.5] -> 4.9 s; critic [2.5, 3.5] and [3.6, 4.0] -> 1.4 s
    assert metrics["timing_s/idle/default"] == pytest.approx(6.0 - 4.9)
    assert metrics["timing_s/idle/critic"] == pytest.approx(6.0 - 1.4)
    assert "timing_s/idle/driver" not in metrics  # the controller is not a pool
