"""AgentLoop: each sample a conversation on the rollout engine, turn by turn, samples advancing independently.

    loop = AgentLoop(ChatFormat(tokenizer, tools=box.schemas()), lambda sample: ToolEnvironment(box, "hermes"),
                     AgentLimits(max_turns=4, max_response_length=256))
    results = loop.run(samples, generate, sampling)    # generate(requests, sampling) -> completions
    results[0].trajectory.response_ids, results[0].trajectory.response_mask, results[0].finish_reason

A turn: the engine generates for the sample; the environment reads the reply
(a ToolEnvironment parses its tool calls and runs them); what it answers is
appended as ids in the chat template's delimiters; the engine generates
again. A sample stops when the environment says done (a reply without tool
calls), at ``max_turns`` model turns (the last turn's reply still gets its
step, since it may be the answer and the step may reward it; an observation
it returns is dropped), or when the response (model tokens and observations
together) reaches ``max_response_length`` tokens; its
``finish_reason`` says which: ``stop``, ``max_turns``, ``length``, or
``environment_error`` when the environment itself raised.

Scheduling: the engines' interface is a synchronous batch call, so the loop
batches every *ready* sample per engine call. Environment steps (tool calls)
run on the loop's own threads, at most ``max_concurrent_steps`` at once;
the loop generates for whichever samples are ready as soon as the engine is
free, and only waits when no sample is ready, for the first step to finish.
A sample whose tool is slow never holds up the others: they keep taking turns
and the slow one rejoins when its tool answers. (An asynchronous engine
interface would also let samples join a generation already running; vLLM's
offline ``LLM`` class and megatron's static engine have none, and one batched
call per ready set keeps both engines on their fast path.)
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

from workers.rollout.agent.tool import TOOL_ERROR_KINDS, ToolBox, error_counts
from workers.rollout.agent.tool_calls import parse_tool_calls
from workers.rollout.agent.trajectory import ChatFormat, Trajectory
from workers.rollout.batch import Completion, GenerationRequest

__all__ = ["AgentLimits", "AgentLoop", "AgentResult", "Conversations", "Environment", "StepResult", "ToolEnvironment",
           "FINISH_REASONS", "agent_metrics"]

FINISH_REASONS = ("stop", "max_turns", "length", "environment_error")


class StepResult(NamedTuple):
    observation: list[dict] | None  # messages to append (tool results, the environment's reply); None: nothing
    reward: float
    done: bool
    info: dict = {}  # counts for the metrics: "tool_calls", "tool_errors" ({kind: n})


class Environment:
    """What answers the model between turns: a game, a verifier, a simulated user, or tools (ToolEnvironment).

    ``reset(sample)`` gives the first messages; ``step(messages, reply)`` reads the
    model's reply (``messages`` ends with it) and returns (observation messages or
    None, reward, done), or a StepResult with counts for the metrics.
    """

    def reset(self, sample: dict[str, Any]) -> list[dict]:
        return list(sample["messages"])

    def step(self, messages: list[dict], reply: str) -> StepResult | tuple:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """The tools answer: every tool call in the reply runs, its result (or error) becomes a tool message.

    A reply without tool calls ends the conversation (its text is the answer the reward reads).
    """

    def __init__(self, box: ToolBox, tool_format: str = "hermes", tokenizer=None) -> None:
        self.box, self.tool_format, self.tokenizer = box, tool_format, tokenizer

    def step(self, messages: list[dict], reply: str) -> StepResult:
        parsed = parse_tool_calls(reply, self.tool_format, self.tokenizer)
        if not parsed.blocks:
            return StepResult(None, 0.0, True, {"tool_calls": 0})
        outcomes = self.box.run_reply(parsed)
        return StepResult([outcome.message() for outcome in outcomes], 0.0, False,
                          {"tool_calls": len(outcomes), "tool_errors": error_counts(outcomes)})


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4  # model turns per sample
    max_response_length: int = 256  # tokens after the prompt: model turns and observations together
    max_concurrent_steps: int = 16  # environment steps (tool calls) running at once

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_response_length", "max_concurrent_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"agent limit {name} must be a positive integer, got {value!r}")


@dataclass
class AgentResult:
    trajectory: Trajectory
    messages: list[dict]
    reward: float = 0.0  # the environment's, summed over turns
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOOL_ERROR_KINDS, 0))
    error: str | None = None  # the environment's exception, when finish_reason is environment_error

    @property
    def finish_reason(self) -> str | None:
        return self.trajectory.finish_reason


Generate = Callable[[list[GenerationRequest], Any], list[Completion]]


class Conversations(NamedTuple):
    environments: list[Environment]
    results: list[AgentResult]


class AgentLoop:
    def __init__(self, chat: ChatFormat, environment: Callable[[dict], Environment], limits: AgentLimits,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.chat = chat
        self.environment = environment  # sample -> a fresh Environment for it
        self.limits = limits
        self.decode = decode or (lambda ids: chat.tokenizer.decode(ids, skip_special_tokens=True))

    def run(self, samples: list[dict], generate: Generate, sampling, seeds: list[int | None] | None = None
            ) -> list[AgentResult]:
        """Every sample's conversation to its end; ``generate(requests, sampling)`` is the engine's batch call.

        ``sampling.max_new_tokens`` bounds one turn; each turn asks for no more than what the sample's
        response budget has left. ``seeds``: one per sample (turn t draws from seed + t), or None.
        """
        return self.converse(self.begin(samples), generate, sampling, seeds)

    def begin(self, samples: list[dict]) -> "Conversations":
        """Each sample's environment and first prompt (no generation yet: the prompts can be checked first)."""
        envs = [self.environment(sample) for sample in samples]
        results = []
        for sample, env in zip(samples, envs):
            messages = env.reset(sample)
            results.append(AgentResult(Trajectory(self.chat.prompt_ids(messages)), list(messages)))
        return Conversations(envs, results)

    def converse(self, conversations: "Conversations", generate: Generate, sampling,
                 seeds: list[int | None] | None = None) -> list[AgentResult]:
        """Run begun conversations to their ends (see ``run``)."""
        envs, results = conversations
        ready = list(range(len(results)))
        pending: dict[Future, int] = {}
        with ThreadPoolExecutor(self.limits.max_concurrent_steps, thread_name_prefix="hybridflow-agent") as pool:
            while ready or pending:
                if ready:
                    batch, ready = ready, []
                    for index, reply in self._generate_turn(batch, results, generate, sampling, seeds):
                        result = results[index]
                        messages = result.messages + [{"role": "assistant", "content": reply}]
                        result.messages = messages
                        pending[pool.submit(envs[index].step, list(messages), reply)] = index
                else:
                    wait(list(pending), return_when=FIRST_COMPLETED)
                for future in [f for f in pending if f.done()]:
                    index = pending.pop(future)
                    if self._after_step(results[index], future):
                        ready.append(index)
        return results

    def _generate_turn(self, batch: list[int], results: list[AgentResult], generate: Generate, sampling, seeds):
        """Engine calls for the ready samples; yields (index, reply text) of those that go on to a step.

        Samples whose response budget has less left than a turn's ``max_new_tokens`` get a call of their own
        at that size, so no request asks for more tokens than its sample may still take.
        """
        by_size: dict[int, list[int]] = {}
        for index in batch:
            left = self.limits.max_response_length - len(results[index].trajectory.response_ids)
            by_size.setdefault(max(1, min(sampling.max_new_tokens, left)), []).append(index)
        for size, group in by_size.items():
            requests = [GenerationRequest(tuple(results[i].trajectory.context_ids),
                                          None if seeds is None or seeds[i] is None else seeds[i] + results[i].trajectory.turns)
                        for i in group]
            completions = generate(requests, replace(sampling, max_new_tokens=size, n=1))
            for index, completion in zip(group, completions):
                trajectory = results[index].trajectory
                trajectory.add_model_turn(completion.token_ids[:size], completion.log_probs[:size])
                if len(trajectory.response_ids) >= self.limits.max_response_length:
                    trajectory.finish("length")
                else:  # at the last allowed turn too: the reply may be the final answer
                    yield index, self.decode(completion.token_ids[:size])

    def _after_step(self, result: AgentResult, future: Future) -> bool:
        """Apply one environment step's answer; True if the sample takes another turn."""
        trajectory = result.trajectory
        try:
            step = future.result()
            observation, reward, done, *rest = step
            info = rest[0] if rest else {}
        except Exception as exc:  # noqa: BLE001 - a user's environment failing ends this sample, not the step
            result.error = f"{type(exc).__name__}: {exc}"
            trajectory.finish("environment_error")
            return False
        result.reward += float(reward)
        result.tool_calls += int(info.get("tool_calls", 0))
        for kind, count in (info.get("tool_errors") or {}).items():
            result.tool_errors[kind] = result.tool_errors.get(kind, 0) + count
        if done or not observation:
            trajectory.finish("stop")
            return False
        if trajectory.turns >= self.limits.max_turns:
            trajectory.finish("max_turns")
            return False
        closed = trajectory.response_ids[-1:] == [self.chat.end_of_turn_id]
        ids = self.chat.observation_ids(observation, closed=closed)
        if len(trajectory.response_ids) + len(ids) >= self.limits.max_response_length:
            trajectory.finish("length")  # no room left for the observation and a reply to it
            return False
        trajectory.add_observation(ids)
        result.messages = result.messages + list(observation)
        return True


def agent_metrics(results: list[AgentResult]) -> dict[str, float]:
    """``agent/num_turns/mean``, ``agent/tool_calls/mean``, ``agent/tool_errors`` (and per kind),
    ``agent/finish_reason/<reason>`` (the share of samples), ``agent/model_tokens/mean``."""
    count = max(1, len(results))
    errors = {kind: sum(r.tool_errors.get(kind, 0) for r in results) for kind in TOOL_ERROR_KINDS}
    metrics = {
        "agent/num_turns/mean": sum(r.trajectory.turns for r in results) / count,
        "agent/tool_calls/mean": sum(r.tool_calls for r in results) / count,
        "agent/tool_errors": float(sum(errors.values())),
        "agent/model_tokens/mean": sum(r.trajectory.model_tokens for r in results) / count,
    }
    metrics.update({f"agent/tool_errors/{kind}": float(n) for kind, n in errors.items()})
    metrics.update({f"agent/finish_reason/{reason}": sum(r.finish_reason == reason for r in results) / count
                    for reason in FINISH_REASONS})
    return metrics
