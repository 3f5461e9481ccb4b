"""A step's generation through the rollout server, with the user's agent as the environment.

For each prompt row and each of its ``n`` samples the user's ``async def agent(client, row)`` runs on a
session of its own (``user_agents.run_sessions``), while the rollout's replicas serve (``Rollout.start_serving``
and ``serve``: the policy's current weights, then continuous batching). Each session's samples
(``trajectories.session_samples``: the ids served, the engine's tokens masked in) become rows of the
training batch, laid out as the built-in agent loop lays them out (``workers.rollout.agent.batch``):

- a session split where its history was rewritten adds a row (same prompt group, same reward);
- a session whose agent failed (raised, timed out, returned something else, or never asked the model)
  keeps its row with nothing masked in, in a group of its own, so it changes no gradient;
- rows with nothing masked in pad the batch to a multiple of ``pad_to`` (the PPO mini-batch), which the
  extra rows would otherwise break.

The sampling is the rollout's whatever the agent asks (``RolloutServer(fixed_sampling=True)``): the
log-probs served are those the update compares with.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from controller.serving.server import RolloutServer
from controller.serving.trajectories import ServedSample, session_samples
from controller.serving.user_agents import AGENT_STATUSES, load_agent, run_sessions
from workers.data_proto import DataProto

__all__ = ["ServedRollout"]


def _run(coroutine):
    """``asyncio.run``, or on a thread of its own when this thread already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _plain(value: Any) -> Any:
    """A non-tensor batch value as plain Python (what an agent's row holds)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


class ServedRollout:
    def __init__(self, rollout_group, tokenizer, rollout_config, pad_to: int = 1) -> None:
        agent = rollout_config.agent
        if agent is None or agent.entrypoint is None:
            raise ValueError("a served rollout runs the user's agent: set rollout.agent.entrypoint")
        self.group, self.tokenizer, self.config, self.pad_to = rollout_group, tokenizer, rollout_config, pad_to
        self.agent = load_agent(agent.entrypoint)
        self.steps = 0

    def generate(self, prompts: DataProto, overrides: dict[str, Any], pad: bool = True) -> DataProto:
        """The training batch of ``prompts`` (each ``n`` times), with the rollout's metrics in
        ``meta_info["metrics"]``; ``pad``: to a multiple of ``pad_to`` rows."""
        from workers.rollout.agent.batch import build_agent_batch

        cfg, agent_cfg = self.config, self.config.agent
        sampling = cfg.sampling.updated({**prompts.meta_info.get("sampling", {}), **overrides})
        repeated = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        rows = [{k: _plain(v[i]) for k, v in repeated.non_tensor_batch.items()} for i in range(len(repeated))]
        seeds = [None if sampling.seed is None else sampling.seed + i * agent_cfg.max_turns for i in range(len(rows))]
        start = time.perf_counter()
        started = self.group.start_serving()
        serving = self.group.serve.submit()
        server = RolloutServer(self.tokenizer, [s["address"] for s in started], replace(sampling, seed=None, n=1),
                               started[0]["max_model_len"], agent_cfg.tool_format, fixed_sampling=True)
        try:
            server.start()
            outcomes = _run(run_sessions(
                self.agent, rows, server, seeds, agent_cfg.max_concurrent_sessions, agent_cfg.session_timeout_s,
                {"max_prompt_length": cfg.max_prompt_length, "max_response_length": agent_cfg.max_response_length},
                prefix=f"step{self.steps}"))
        finally:
            server.close()
            for s in started:
                urllib.request.urlopen(urllib.request.Request(s["address"] + "/stop", data=b"{}"), timeout=60).read()
            replicas = serving.result()
        seconds = time.perf_counter() - start
        self.steps += 1
        results, source, uids = [], [], []
        uid = repeated.non_tensor_batch.get("uid")
        splits = 0
        for outcome in outcomes:
            samples = session_samples(outcome.turns) if outcome.status == "ok" else []
            splits += max(0, len(samples) - 1)
            for sample in samples or [self._empty(repeated, outcome.row, f"agent_{outcome.status}")]:
                results.append(self._result(sample, outcome))
                source.append(outcome.row)
                group = uid[outcome.row] if uid is not None else str(outcome.row)
                uids.append(group if samples else f"failed/{outcome.session_id}")
        padding = -len(results) % self.pad_to if pad else 0
        for k in range(padding):
            row = k % len(repeated)
            results.append(self._result(self._empty(repeated, row, "padding"), None))
            source.append(row)
            uids.append(f"padding/{self.steps}/{k}")
        batch = build_agent_batch(repeated[source], results, self.tokenizer.pad_token_id or 0,
                                  agent_cfg.max_response_length, cfg.max_prompt_length)
        batch.non_tensor_batch["uid"] = np.asarray(uids, dtype=object)
        batch.meta_info["temperature"] = sampling.logprob_temperature
        batch.meta_info["metrics"] = self._metrics(outcomes, results, splits, padding, seconds, replicas, started)
        return batch

    def _empty(self, repeated: DataProto, row: int, reason: str) -> ServedSample:
        """A row that trains nothing: the prompt as the loader tokenized it, one end-of-turn token masked out."""
        ids = repeated.batch["input_ids"][row][repeated.batch["attention_mask"][row].bool()].tolist()
        sample = ServedSample(ids[-self.config.max_prompt_length:], [self.tokenizer.eos_token_id], [0], [0.0], [-1])
        sample.finish_reason = reason
        return sample

    @staticmethod
    def _result(sample: ServedSample, outcome):
        from workers.rollout.agent.loop import AgentResult
        from workers.rollout.agent.trajectory import Trajectory

        trajectory = Trajectory(list(sample.prompt_ids), list(sample.response_ids), list(sample.response_mask),
                                list(sample.log_probs), sample.turns, sample.finish_reason)
        turns = outcome.turns if outcome is not None else []
        last = turns[-1] if turns else None
        messages = (list(last.messages) + [last.reply]) if last is not None and last.reply is not None else []
        calls = sum(len((t.reply or {}).get("tool_calls") or ()) for t in turns)
        # A failed session or a padding row scores 0 (and trains nothing); an agent's None is reward.fn's to score.
        reward = 0.0 if outcome is None or outcome.status != "ok" else outcome.reward
        result = AgentResult(trajectory, messages, reward=reward, tool_calls=calls,
                             error=None if outcome is None else outcome.error)
        return result

    def _metrics(self, outcomes, results, splits, padding, seconds, replicas, started) -> dict[str, float]:
        statuses = Counter(o.status for o in outcomes)
        sessions = len(outcomes)
        tokens = sum(sum(r.trajectory.response_mask) for r in results)
        out: dict[str, float] = {
            "timing_s/gen": seconds, "agent/sessions": sessions, "agent/samples": len(results) - padding,
            "agent/trajectory_splits": splits, "agent/padding_samples": padding,
            "agent/requests_per_session": sum(len(o.turns) for o in outcomes) / max(sessions, 1),
            "agent/tool_calls/mean": sum(r.tool_calls for r in results) / max(sessions, 1),
            "agent/sessions_per_s": sessions / seconds if seconds > 0 else 0.0,
            "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "rollout/response_tokens": tokens,
        }
        out.update({f"agent/{status}": float(statuses.get(status, 0)) for status in AGENT_STATUSES if status != "ok"})
        for key in ("timing_s/weight_sync", "weight_sync/bytes", "reshard/bytes_received", "timing_s/reshard"):
            values = [r[key] for r in replicas if key in r] + [s[key] for s in started if key in s]
            if values:
                out[key] = float(max(values))
        return out

    def describe(self) -> str:
        return json.dumps({"entrypoint": self.config.agent.entrypoint})
