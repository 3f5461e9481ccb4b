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

``generate`` serves for one call (``trainer.mode`` sync, and one_step_off on the rollout's own pool);
``controller.serving.served_stream`` keeps the replicas serving across steps (``trainer.mode`` async) through
the same pieces: ``ServedReplicas`` (start, update in flight, stop), ``server`` and ``assemble``.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from controller.serving.server import RolloutServer
from controller.serving.trajectories import ServedSample, session_samples
from controller.serving.agent_failures import failure_report
from controller.serving.user_agents import AGENT_STATUSES, SessionOutcome, agent_row, load_agent, run_sessions
from workers.data_proto import DataProto
from workers.rollout.serving.api_key import bearer, new_api_key

__all__ = ["ServedPart", "ServedReplicas", "ServedRollout", "joined_prompts"]


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


def _post(address: str, path: str, body: dict, api_key: str, timeout: float = 600) -> dict:
    request = urllib.request.Request(address + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **bearer(api_key)})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read() or b"{}")


def joined_prompts(rows: list[DataProto], pad_token_id: int) -> DataProto:
    """Prompt rows as one batch, left-padded to the longest (as the loader pads a batch)."""
    width = max(r.batch["input_ids"].shape[1] for r in rows)
    padded = []
    for r in rows:
        missing = width - r.batch["input_ids"].shape[1]
        ids = torch.nn.functional.pad(r.batch["input_ids"], (missing, 0), value=pad_token_id)
        mask = torch.nn.functional.pad(r.batch["attention_mask"], (missing, 0), value=0)
        padded.append(DataProto({"input_ids": ids, "attention_mask": mask}, r.non_tensor_batch, r.meta_info))
    return DataProto.concat(padded)


SERVE_STOP_TIMEOUT_S = 600.0  # from POST /stop to the end of the replicas' serve calls


class ServedReplicas:
    """The rollout's replicas serving: each rank's engine behind its token-in, token-out endpoint."""

    def __init__(self, rollout_group, api_key: str) -> None:
        self.group, self.api_key = rollout_group, api_key
        self.started: list[dict[str, Any]] = []
        self.serving = None

    def start(self) -> "ServedReplicas":
        """Every rank takes the policy's current weights (where the rollout pulls them) and serves."""
        self.started = self.group.start_serving(self.api_key)
        self.serving = self.group.serve.submit()
        return self

    @property
    def addresses(self) -> list[str]:
        return [s["address"] for s in self.started]

    @property
    def max_model_len(self) -> int:
        return self.started[0]["max_model_len"]

    def update(self, policy: str) -> list[dict[str, Any]]:
        """``POST /update`` on every replica at once (the transfer is collective); each one's answer: its new
        version and the transfer's metrics."""
        with ThreadPoolExecutor(len(self.addresses)) as pool:
            return list(pool.map(lambda address: _post(address, "/update", {"policy": policy}, self.api_key), self.addresses))

    def stop(self) -> list[dict[str, Any]]:
        """End the serving (requests in flight finish first); each replica's counts and metrics."""
        for address in self.addresses:
            _post(address, "/stop", {}, self.api_key, timeout=60)
        # Its own limit: a serving lasts as long as the sessions do, which no deadline of the call's
        # durations bounds (the sessions have their own timeouts); once stopped it ends at once.
        replicas, self.serving = self.serving.result(timeout=SERVE_STOP_TIMEOUT_S), None
        return replicas


@dataclass
class ServedPart:
    """Prompt rows (each sample's own row: the prompts repeated n times) and their sessions' outcomes."""

    rows: DataProto
    outcomes: list[SessionOutcome]


class ServedRollout:
    def __init__(self, rollout_group, tokenizer, rollout_config, pad_to: int = 1) -> None:
        agent = rollout_config.agent
        if agent is None or agent.entrypoint is None:
            raise ValueError("a served rollout runs the user's agent: set rollout.agent.entrypoint")
        self.group, self.tokenizer, self.config, self.pad_to = rollout_group, tokenizer, rollout_config, pad_to
        self.agent = load_agent(agent.entrypoint)
        self.api_key = rollout_config.server_api_key or new_api_key()  # the job's, for every endpoint; never logged
        self.steps = 0

    def generate(self, prompts: DataProto, overrides: dict[str, Any], pad: bool = True) -> DataProto:
        """The training batch of ``prompts`` (each ``n`` times), with the rollout's metrics in
        ``meta_info["metrics"]``; ``pad``: to a multiple of ``pad_to`` rows. The replicas serve for this call."""
        start = time.perf_counter()
        replicas = ServedReplicas(self.group, self.api_key).start()
        try:
            part, sampling = self.run(prompts, overrides, replicas, f"step{self.steps}")
        finally:
            replica_metrics = replicas.stop()
        self.steps += 1
        batch = self.assemble([part], pad, sampling)
        metrics = batch.meta_info["metrics"]
        metrics.update(self.serving_metrics(time.perf_counter() - start, metrics, replica_metrics, replicas.started))
        return batch

    def sampling(self, prompts: DataProto, overrides: dict[str, Any]):
        """The rollout's sampling, with the prompts' and the call's overrides."""
        return self.config.sampling.updated({**prompts.meta_info.get("sampling", {}), **overrides})

    def server(self, replicas: ServedReplicas, sampling) -> RolloutServer:
        """The OpenAI-compatible endpoint over ``replicas``, serving every request with ``sampling``."""
        cfg = self.config
        return RolloutServer(self.tokenizer, replicas.addresses, replace(sampling, seed=None, n=1),
                             replicas.max_model_len, self.api_key, cfg.agent.tool_format, host=cfg.server_host,
                             port=cfg.server_port, fixed_sampling=True, max_sessions=cfg.server_max_sessions,
                             max_n=cfg.server_max_n)

    def sessions(self, prompts: DataProto, sampling, server: RolloutServer, prefix: str,
                 gate: asyncio.Semaphore | None = None):
        """The coroutine running the agent once per sample of ``prompts`` (each ``sampling.n`` times) on
        ``server``: it returns their ``ServedPart``. ``gate`` bounds the sessions at once across calls."""
        agent_cfg = self.config.agent
        repeated = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        rows = [agent_row({k: _plain(v[i]) for k, v in repeated.non_tensor_batch.items()}) for i in range(len(repeated))]
        seeds = [None if sampling.seed is None else sampling.seed + i * agent_cfg.max_turns for i in range(len(rows))]
        limits = {"max_prompt_length": self.config.max_prompt_length,
                  "max_response_length": agent_cfg.max_response_length}

        async def run() -> ServedPart:
            outcomes = await run_sessions(self.agent, rows, server, seeds, agent_cfg.max_concurrent_sessions,
                                          agent_cfg.session_timeout_s, limits, prefix=prefix, gate=gate)
            return ServedPart(repeated, outcomes)

        return run()

    def run(self, prompts: DataProto, overrides: dict[str, Any], replicas: ServedReplicas,
            prefix: str) -> tuple[ServedPart, Any]:
        """The sessions of ``prompts`` on serving ``replicas``, behind an endpoint of their own (closed after)."""
        sampling = self.sampling(prompts, overrides)
        server = self.server(replicas, sampling).start()
        try:
            return _run(self.sessions(prompts, sampling, server, prefix)), sampling
        finally:
            server.close()

    def assemble(self, parts: list[ServedPart], pad: bool, sampling, versioned: bool = False,
                 default_version: int = 0) -> DataProto:
        """The training batch of ``parts`` (in order), padded to a multiple of ``pad_to`` rows when ``pad``,
        its metrics in ``meta_info["metrics"]``. ``versioned``: the turns' versions are the trainer's policy
        versions (``ServedStream`` maps them), and the batch gets ``token_versions`` [B, R] (-1 where the engine
        sampled nothing) and ``policy_version`` [B] (the row's oldest token's; ``default_version`` for a row
        with none)."""
        from workers.rollout.agent.batch import build_agent_batch

        agent_cfg = self.config.agent
        results, samples, source, uids, outcomes = [], [], [], [], []
        splits, offset = 0, 0
        for part in parts:
            uid = part.rows.non_tensor_batch.get("uid")
            for outcome in part.outcomes:
                found = session_samples(outcome.turns) if outcome.status == "ok" else []
                splits += max(0, len(found) - 1)
                for sample in found or [self._empty(part.rows, outcome.row, f"agent_{outcome.status}")]:
                    results.append(self._result(sample, outcome))
                    samples.append(sample)
                    source.append(offset + outcome.row)
                    group = uid[outcome.row] if uid is not None else f"{offset}/{outcome.row}"
                    uids.append(group if found else f"failed/{outcome.session_id}")
            outcomes += part.outcomes
            offset += len(part.rows)
        rows = parts[0].rows if len(parts) == 1 else joined_prompts([part.rows for part in parts],
                                                                     self.tokenizer.pad_token_id or 0)
        padding = -len(results) % self.pad_to if pad else 0
        for k in range(padding):
            row = k % len(rows)
            sample = self._empty(rows, row, "padding")
            results.append(self._result(sample, None))
            samples.append(sample)
            source.append(row)
            uids.append(f"padding/{self.steps}/{len(uids)}")
        batch = build_agent_batch(rows[source], results, self.tokenizer.pad_token_id or 0,
                                  agent_cfg.max_response_length, self.config.max_prompt_length)
        batch.non_tensor_batch["uid"] = np.asarray(uids, dtype=object)
        batch.meta_info["temperature"] = sampling.logprob_temperature
        batch.meta_info["metrics"] = self._metrics(outcomes, results, splits, padding)
        report = failure_report(outcomes)
        if report is not None:
            print(report, flush=True)
        if versioned:
            versions = torch.full((len(samples), agent_cfg.max_response_length), -1, dtype=torch.long)
            oldest = torch.full((len(samples),), default_version, dtype=torch.long)
            for i, sample in enumerate(samples):
                versions[i, :len(sample.versions)] = torch.tensor(sample.versions, dtype=torch.long)
                sampled = [v for v in sample.versions if v >= 0]
                if sampled:
                    oldest[i] = min(sampled)
            batch.batch["token_versions"], batch.batch["policy_version"] = versions, oldest
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

    @staticmethod
    def _metrics(outcomes, results, splits, padding) -> dict[str, float]:
        statuses = Counter(o.status for o in outcomes)
        sessions = len(outcomes)
        tokens = sum(sum(r.trajectory.response_mask) for r in results)
        out: dict[str, float] = {
            "agent/sessions": sessions, "agent/samples": len(results) - padding,
            "agent/trajectory_splits": splits, "agent/padding_samples": padding,
            "agent/requests_per_session": sum(len(o.turns) for o in outcomes) / max(sessions, 1),
            "agent/tool_calls/mean": sum(r.tool_calls for r in results) / max(sessions, 1),
            "rollout/response_tokens": tokens,
        }
        out.update({f"agent/{status}": float(statuses.get(status, 0)) for status in AGENT_STATUSES if status != "ok"})
        return out

    @staticmethod
    def serving_metrics(seconds: float, metrics: dict[str, float], replicas: list[dict],
                        started: list[dict]) -> dict[str, float]:
        """The rates of ``metrics``' sessions and tokens over ``seconds`` of serving, and the weights' sync
        (each key's largest over the replicas, as they started and as they stopped)."""
        out: dict[str, float] = {
            "timing_s/gen": seconds,
            "agent/sessions_per_s": metrics["agent/sessions"] / seconds if seconds > 0 else 0.0,
            "rollout/tokens_per_s": metrics["rollout/response_tokens"] / seconds if seconds > 0 else 0.0}
        for key in ("timing_s/weight_sync", "weight_sync/bytes", "reshard/bytes_received", "timing_s/reshard"):
            values = [r[key] for r in replicas if key in r] + [s[key] for s in started if key in s]
            if values:
                out[key] = float(max(values))
        return out

    def describe(self) -> str:
        return json.dumps({"entrypoint": self.config.agent.entrypoint})
