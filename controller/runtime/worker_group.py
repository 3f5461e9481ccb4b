"""WorkerGroup: the controller's handle on one worker class placed on a resource pool.

    group = WorkerGroup(pool, MyWorker, role="actor", kwargs={"lr": 1e-5})
    out = group.compute_log_prob(batch)          # dispatch, run on every rank, collect
    fut = group.update_actor.submit(batch)       # returns at once
    critic_metrics = critic.update_critic(batch) # runs while the actor updates
    actor_metrics = fut.result()

Every check that can fail without the workers (unknown method, input that
does not fit the dispatch mode, a group that lost a rank) fails before
anything is sent.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from controller.errors import CallTimeoutError, HostLostError, RemoteWorkerError, WorkerDiedError
from controller.runtime.hosts import FutureCalls, RankCalls
from controller.runtime.resource_pool import ResourcePool
from hybridengine.parallel.layout import ParallelLayout
from workers.base_worker import BaseWorker
from workers.dispatch import GroupView, get_dispatch_rule
from workers.host import Reply
from workers.keywords import check_constructor
from workers.register import MethodSpec, registered_methods

__all__ = ["WorkerGroup", "GroupFuture", "GroupMethod"]


class GroupFuture:
    """A pending group call: the ranks' replies, collected on ``result()``."""

    def __init__(self, group: "WorkerGroup", method: str, calls: RankCalls | dict[int, Future], collect, timeout_s,
                 watch=None):
        self._group = group
        self._method = method
        self._calls = calls if isinstance(calls, RankCalls) else FutureCalls(calls)
        self._collect = collect
        self._timeout_s = timeout_s
        self._watch = watch  # a HangWatch: the deadline counts from the submit, a pass is a hang
        self._submitted = time.monotonic()
        self._outcome: tuple[bool, Any] | None = None

    def done(self) -> bool:
        return self._outcome is not None or self._calls.done()

    def result(self, timeout: float | None = None) -> Any:
        if self._outcome is None:
            self._outcome = self._resolve(self._timeout_s if timeout is None else timeout)
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def _resolve(self, timeout: float | None) -> tuple[bool, Any]:
        watched = self._watch is not None and timeout == self._timeout_s and timeout is not None
        wait = max(0.0, self._submitted + timeout - time.monotonic()) if watched else timeout
        outcome = self._calls.wait(wait)
        if outcome.failure is not None:
            return False, self._group._rank_error(outcome.failure[0], self._method, outcome.failure[1])
        if outcome.late:
            if watched:
                return False, self._watch.hung(self._group, self._method, list(outcome.late), timeout)
            return False, CallTimeoutError(list(outcome.late), self._method, timeout, self._group._where(outcome.late))
        if self._watch is not None:
            self._watch.record(self._group.role, self._method, time.monotonic() - self._submitted)
        replies = outcome.replies
        for rank, reply in sorted(replies.items()):
            if not reply.ok:
                return False, RemoteWorkerError(rank, self._method, reply.error_type, reply.remote_traceback)
        self._group._note_layout(replies)
        try:
            return True, self._collect({rank: reply.value for rank, reply in replies.items()})
        except Exception as exc:  # noqa: BLE001 - a collect rule's error belongs to this call
            return False, exc


class GroupMethod:
    """``group.name``: call it to run the method on the group; ``.submit`` never blocks."""

    def __init__(self, group: "WorkerGroup", spec: MethodSpec) -> None:
        self._group = group
        self.spec = spec
        self.__name__ = spec.name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        future = self.submit(*args, **kwargs)
        return future.result() if self.spec.blocking else future

    def submit(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._group._submit(self.spec, args, kwargs)

    def __repr__(self) -> str:
        return f"<group method {self._group.role}.{self.spec.name} ({self.spec.dispatch_mode})>"


class WorkerGroup:
    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type,
        *,
        args: tuple = (),
        kwargs: dict | None = None,
        role: str | None = None,
        call_timeout_s: float | None = None,
        watch=None,
    ) -> None:
        """``call_timeout_s``: each call's limit (CallTimeoutError past it); ``watch``: a HangWatch instead,
        whose deadline follows each method's own durations and whose pass is a HangError with every rank's
        stack (``controller.runtime.hang_watch``)."""
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, BaseWorker)):
            raise TypeError(f"worker class must subclass workers.BaseWorker, got {worker_cls!r}")
        # A keyword the worker does not take, or a bad config section, fails here, not in every worker process;
        # a section given as a dict reaches the workers built (the constructor takes its typed config as it is).
        kwargs = check_constructor(worker_cls, dict(kwargs or {}))
        self.pool = pool
        self.worker_cls = worker_cls
        self.role = role or worker_cls.__name__
        self.world_size = pool.world_size
        self.call_timeout_s = call_timeout_s
        self.watch = watch
        self.layout: ParallelLayout | None = None
        self._methods = registered_methods(worker_cls)
        pool.claim_role(self.role)
        hosts = pool.hosts
        shared = (self.role, worker_cls, tuple(args), kwargs)
        calls = hosts.submit_calls("create_worker", {
            rank: (*shared, rank, tuple(hosts.global_ranks), pool.process_group_key) for rank in range(self.world_size)
        })
        GroupFuture(self, f"{worker_cls.__name__}.__init__", calls, lambda outputs: None, None).result()
        if watch is not None:
            watch.note_pool(pool)  # the ranks' pids, while they answer

    # ------------------------------------------------------------ methods
    def __getattr__(self, name: str) -> GroupMethod:
        methods = self.__dict__.get("_methods")
        if methods is None or name.startswith("__"):
            raise AttributeError(name)
        if name not in methods:
            raise AttributeError(
                f"{self.worker_cls.__name__} has no group method {name!r}; registered methods: "
                f"{sorted(methods)} (mark a method with @register(...) to call it on the group)"
            )
        return GroupMethod(self, methods[name])

    # -------------------------------------------------------- internals
    def _submit(self, spec: MethodSpec, args: tuple, kwargs: dict) -> GroupFuture:
        lost = self.pool.hosts.lost
        if lost:
            rank = min(lost)
            raise WorkerDiedError(rank, spec.name, f"the pool lost this rank earlier: {lost[rank]}")
        rule = get_dispatch_rule(spec.dispatch_mode)
        view = GroupView(self.world_size, self.layout)
        calls, context = rule.dispatch(view, args, kwargs)
        if len(calls) != self.world_size:
            raise ValueError(f"dispatch mode {rule.name!r} produced {len(calls)} calls for {self.world_size} ranks")
        per_rank = {rank: (self.role, spec.name, call.args, call.kwargs) for rank, call in enumerate(calls)
                    if call is not None}
        with self.pool.submit_lock:
            pending = self.pool.hosts.submit_calls("execute", per_rank, private_inputs=spec.writes_inputs)
        timeout = self.watch.deadline_s(self.role, spec.name) if self.watch is not None else self.call_timeout_s
        return GroupFuture(self, spec.name, pending, lambda outputs: rule.collect(view, outputs, context), timeout,
                           self.watch)

    def _rank_error(self, rank: int, method: str, error: BaseException) -> BaseException:
        if isinstance(error, HostLostError):
            return WorkerDiedError(rank, method, f"{error.detail}; {self._where([rank])}")
        return error

    def _where(self, ranks) -> str:
        return self.pool.hosts.describe_ranks(ranks)

    def _note_layout(self, replies: dict[int, Reply]) -> None:
        first = replies[min(replies)]
        if first.layout is not None:
            self.layout = first.layout

    def __repr__(self) -> str:
        return f"WorkerGroup({self.role}: {self.worker_cls.__name__} x {self.world_size} on {self.pool.name})"
