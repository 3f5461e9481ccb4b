"""A step's metrics under the field's names, from its batch and from the workers' update statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from controller.metrics.timeline import IDLE_PREFIX, PHASE_PREFIX, busy_seconds
from workers.data_proto import DataProto
from workers.policy_losses import masked_mean, zero_padding

if TYPE_CHECKING:
    from controller.algorithms.algorithm import StepState

__all__ = ["ROLLOUT_METRICS", "actor_update_metrics", "batch_metrics", "kl_metrics", "nothing_to_train", "phase_lines", "record_rollout_metrics",
           "reduce_update_metrics", "timeline_metrics"]

# |kl_div| below this is rounding noise: the ratio loss / kl_div would be too (the unit probe is exact)
_KL_DIV_FLOOR = 1e-6


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


def batch_metrics(batch: DataProto) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of a finished step's batch."""
    b = batch.batch
    mask = b["response_mask"].bool()
    response_length = b["response_mask"].sum(-1).float()
    prompt_length = b["attention_mask"][:, : b["prompts"].shape[1]].sum(-1).float()
    metrics = {
        **_stats("critic/score", b["scores"]),
        **_stats("critic/rewards", zero_padding(b["token_level_rewards"], mask).sum(-1)),
        **_stats("response_length", response_length),
        **_stats("prompt_length", prompt_length),
        "response_length/clip_ratio": float((response_length >= b["responses"].shape[1]).float().mean()),
    }
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if key in b:
            values = b[key][mask]
            metrics.update(_stats(name, values) if values.numel() else {})
    if "reward_timed_out" in b:  # samples whose reward call passed reward.timeout_s (scored 0)
        metrics["reward/timeouts"] = float(b["reward_timed_out"].sum())
    if "entropys" in b:
        metrics["actor/entropy_rollout"] = float(masked_mean(b["entropys"], b["response_mask"]))
    if "judged" in b and bool(b["judged"].any()):  # a generative judge's samples (controller.rl.judge_scores)
        judged = b["judged"].bool()
        metrics.update({"reward/judge/score/mean": float(b["judge_scores"][judged].mean()),
                        "reward/judge/samples": float(judged.sum()),
                        "reward/judge/parse_failures": float(b["judge_parse_failed"].sum()),
                        "reward/judge/timeouts": float(b["judge_timed_out"].sum()),
                        "reward/judge/overlong": float(b["judge_overlong"].sum()),
                        "reward/judge/tokens/mean": float(b["judge_tokens"][judged].mean()),
                        "reward/judge/latency_s": float(b["judge_seconds"].max())})
    if "teacher_log_probs" in b and "old_log_probs" in b:  # KL(student || teacher) on the student's own tokens
        metrics["actor/opd/reverse_kl"] = float(masked_mean(b["old_log_probs"] - b["teacher_log_probs"],
                                                            b["response_mask"]))
    return metrics


def kl_metrics(update: dict[str, float], user_fn: bool, ppo, reward_beta: float | None) -> dict[str, float]:
    """``kl_div`` and ``beta``, the names the design documents print, from the actor's update metrics.

    ``kl_div``: the token mean of log pi - log ref over the update (``actor/kl_div``). ``beta``: the
    coefficient in effect. A user's ``kl_loss_fn``: its loss divided by ``kl_div``, or where ``kl_div``
    is 0 (the first update, when the actor still equals the reference) its loss at a KL of 1 (for a
    term linear in the KL the two are the same number). Otherwise ``ppo.kl_loss_coef`` under
    ``ppo.use_kl_loss``, or the KL controller's coefficient under ``algorithm.kl_in_reward``.
    Nothing when the step has no reference log-probs.
    """
    if "actor/kl_div" not in update:
        return {}
    kl_div = update["actor/kl_div"]
    if user_fn:
        loss = update["actor/kl_loss"]
        beta = loss / kl_div if abs(kl_div) >= _KL_DIV_FLOOR else update["actor/kl_unit_loss"]
    elif ppo.use_kl_loss:
        beta = ppo.kl_loss_coef
    elif reward_beta is not None:
        beta = reward_beta
    else:
        return {"kl_div": kl_div}
    return {"kl_div": kl_div, "beta": float(beta)}


def phase_lines(metrics: dict[str, float], sequences: int) -> list[str]:
    """One line per phase of a finished step (``RLTrainer(verbose=True)``): rollout, reward, values, update."""
    def get(key: str, fmt: str = ".3f") -> str:
        return format(metrics[key], fmt) if key in metrics else "-"

    lines = [f"rollout: generated {sequences} sequences (response length mean {get('response_length/mean', '.1f')}, "
             f"max {get('response_length/max', '.0f')}) in {get('timing_s/rollout', '.2f')} s",
             f"reward: scored {sequences} sequences in {get('timing_s/reward', '.2f')} s "
             f"(score mean {get('critic/score/mean')})"]
    if "timing_s/values" in metrics:
        lines.append(f"critic: values for {sequences} sequences in {get('timing_s/values', '.2f')} s")
    update = f"update: pg_loss={get('actor/pg_loss')}"
    if "critic/vf_loss" in metrics:
        update += f", vf_loss={get('critic/vf_loss')}"
    if "kl_div" in metrics:
        update += f", kl_div={get('kl_div')}" + (f", beta={get('beta')}" if "beta" in metrics else "")
    lines.append(update + f" in {get('timing_s/update_actor', '.2f')} s")
    return lines


def reduce_update_metrics(replies: Any) -> dict[str, float]:
    """A role's update statistics (per mini-batch lists, one dict per answering replica) as step means."""
    first = replies[0] if isinstance(replies, list) else replies
    return {key: float(sum(values) / len(values)) for key, values in first.items() if values}


def nothing_to_train(step: int, batch: DataProto, rollout_metrics: dict[str, float]) -> str | None:
    """Why step ``step`` (as the console numbers it) has nothing to train on, when no sample of ``batch`` has a
    response token masked in (every agent session failed, say); None when it has. The update would otherwise
    average over no token and report the NaN it got."""
    if bool(batch.batch["response_mask"].any()):
        return None
    sessions = rollout_metrics.get("agent/sessions")
    if sessions:
        failed = {k.removeprefix("agent/"): int(v) for k, v in sorted(rollout_metrics.items())
                  if k.removeprefix("agent/") in ("error", "timeout", "bad_reward", "no_requests") and v}
        why = (f"every agent session failed ({int(sessions)} of {int(sessions)}: "
               f"{', '.join(f'{k} {v}' for k, v in failed.items())}; the first failure is above)"
               if sum(failed.values()) == sessions else f"no agent session of {int(sessions)} gave a token to train")
    else:
        why = f"every one of its {len(batch)} responses is masked out"
    return f"step {step}: nothing to train on: {why}; the critic's and the actor's updates are skipped"


# The rollout's own metrics that a step reports; extra generation rounds add to the timings and bytes.
ROLLOUT_METRICS = ("timing_s/gen", "timing_s/reshard", "timing_s/weight_sync", "weight_sync/bytes",
                   "reshard/bytes_received", "reshard/expert_bytes_received", "reshard/lora_bytes_received",
                   "rollout/tokens_per_s",
                   # either way the weights came (in place or across pools): the time and the bytes received
                   "timing_s/weight_update", "weight_update/bytes_received",
                   # a rollout on its own pool: the cross-pool transfer, beside the in-place reshard's
                   "timing_s/weight_transfer", "weight_transfer/bytes", "weight_transfer/bound_bytes",
                   "weight_transfer/bytes_sent",
                   "rollout/kv_cache_tokens")  # what vLLM's KV cache holds (whole blocks), as the planner sizes it


def record_rollout_metrics(state: StepState, metrics: dict[str, Any]) -> None:
    """A generation's metrics into the step's: timings and bytes add up over a step's rounds."""
    # A multi-turn rollout's agent/* metrics (turns, tool calls and errors, finish reasons) as they come.
    state.rollout_metrics.update({k: float(v) for k, v in metrics.items() if k.startswith("agent/")})
    for key in (k for k in ROLLOUT_METRICS if k in metrics):
        summed = key.startswith("timing_s/") or key.endswith(("bytes", "bytes_received"))
        previous = state.rollout_metrics.get(key, 0.0) if summed else 0.0
        state.rollout_metrics[key] = previous + float(metrics[key])


def actor_update_metrics(metrics: dict[str, float], old_log_probs_from_update: bool) -> dict[str, float]:
    """The actor's update metrics under the step's names: the rollout correction's as ``rollout_corr/...``; and,
    where the update's own forward gave the old log-probs, the agreement the skipped pass would have measured
    (``rollout/logprob_diff_*``) and the routers' (``router_replay/...``: its one pass is at the rollout's weights)."""
    metrics = dict(metrics)
    for key in [k for k in metrics if k.startswith("actor/rollout_corr/")]:
        metrics[key.removeprefix("actor/")] = metrics.pop(key)
    if old_log_probs_from_update:
        for stat in ("max", "mean"):
            metrics[f"rollout/logprob_diff_{stat}"] = metrics.pop(f"actor/rollout_logprob_diff_{stat}")
        for key in [k for k in metrics if k.startswith("actor/router_replay/")]:
            metrics[key.removeprefix("actor/")] = metrics.pop(key)
    return metrics


def timeline_metrics(phases: list[tuple[str, str, float, float]], step_s: float, pools: set[str]) -> dict[str, float]:
    """The step's timeline as timings: ``timing_s/phase/<pool>/<phase>/start`` and ``/end`` (seconds from the
    step's start; a phase run twice spans both runs), and ``timing_s/idle/<pool>``, the seconds of the step each
    of the job's ``pools`` ran no phase."""
    metrics: dict[str, float] = {}
    for pool, phase, start, end in phases:
        key = f"{PHASE_PREFIX}{pool}/{phase}"
        metrics[f"{key}/start"] = min(start, metrics.get(f"{key}/start", start))
        metrics[f"{key}/end"] = max(end, metrics.get(f"{key}/end", end))
    for pool in sorted(pools):
        metrics[f"{IDLE_PREFIX}{pool}"] = max(0.0, step_s - busy_seconds(
            [(start, end) for where, _, start, end in phases if where == pool]))
    return metrics

