"""SFTTrainer: supervised fine-tuning of the actor on its worker group, in one screen.

    trainer = SFTTrainer(actor=Actor.from_pretrained(path, tensor_parallel=2, pipeline_parallel=2,
                                                     optim={"lr": 1e-3}),
                         train=examples, val=held_out, batch_size=16, pad_token_id=0)
    trainer.fit(total_steps=100)      # sft/loss every step, sft/val_loss every val_every steps

A step is one optimizer step on ``batch_size`` examples (``Actor.sft_step``: the token mean of the
response tokens' negative log-likelihood under the loss mask). Checkpoints hold the actor (megatron
distributed checkpoint: any layout) and then the loader's position, the commit point, so a resumed run
trains on exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from controller.data.sft_batches import SFTLoader
from controller.data.sft_examples import SFTExample
from controller.runtime.hang_watch import HangWatch
from controller.runtime.resource_pool import ResourcePool
from controller.rl.bad_steps import BadSteps
from controller.rl.trainer_checkpoint import commit_trainer_state, latest_trainer_state, saving
from controller.runtime.worker_group import WorkerGroup
from workers.role_spec import RoleSpec

__all__ = ["SFTTrainer"]


class SFTTrainer:
    def __init__(self, *, actor: RoleSpec, train: Sequence[SFTExample], batch_size: int, pad_token_id: int,
                 val: Sequence[SFTExample] = (), pool: ResourcePool | None = None, run_dir: str | Path | None = None,
                 logger=None, save_every: int = 0, val_every: int = 0, seed: int = 0, shuffle: bool = True,
                 max_bad_steps: int = 5, hang_timeout_s: float | None = None, images=None) -> None:
        """``images``: a vision-language model's image processing (``controller.data.images.ImageProcessing``),
        for examples with images."""
        self.spec, self.pool, self.logger = actor, pool, logger
        self.loader = SFTLoader(train, batch_size, pad_token_id, shuffle, seed, images)
        self.val_loader = (SFTLoader(val, min(batch_size, len(val)), pad_token_id, shuffle=False, images=images)
                           if val else None)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.save_every, self.val_every = save_every, val_every
        self.global_step = 0
        self.actor: WorkerGroup | None = None
        # as in RL: each call's deadline from its own durations (run_dir/hangs), steps skipped on a NaN counted
        self.watch = HangWatch(self.run_dir / "hangs" if self.run_dir is not None else None, hang_timeout_s)
        self.bad_steps = BadSteps(max_bad_steps)

    def build(self) -> None:
        if self.actor is None:
            self.pool = self.pool or ResourcePool([1])
            self.actor = WorkerGroup(self.pool, self.spec.worker_cls, role="actor", kwargs=self.spec.kwargs,
                                     watch=self.watch)

    def step(self) -> dict[str, float]:
        self.build()
        start = time.perf_counter()
        batch = self.loader.next_batch()
        replicas = self.actor.sft_step(batch)  # one dict per data-parallel replica, all the same mini-batch
        elapsed = time.perf_counter() - start
        self.global_step += 1
        metrics = {key: float(values[0]) for key, values in replicas[0].items()}
        if (in_row := self.bad_steps.count(self.global_step, ["actor"] if metrics.get("sft/skipped") else [])):
            metrics["training/bad_steps_in_row"] = in_row
        tokens = float(batch.batch["attention_mask"].sum())
        metrics.update({"sft/learned_tokens": float(batch.batch["response_mask"].sum()), "timing_s/step": elapsed,
                        "perf/throughput": tokens / elapsed, "sft/epoch": float(self.loader.epoch)})
        if self.val_every and self.global_step % self.val_every == 0:
            metrics.update(self.validate())
        if self.logger is not None:
            self.logger.log(self.global_step, metrics)
        if self.run_dir is not None and self.save_every and self.global_step % self.save_every == 0:
            self.save_checkpoint()
        return metrics

    def validate(self) -> dict[str, float]:
        """The token-mean loss over every validation example (forward only)."""
        if self.val_loader is None:
            return {}
        self.build()
        nll = tokens = 0.0
        for batch in self.val_loader.batches():
            out = self.actor.sft_eval(batch).batch
            nll, tokens = nll + float(out["nll_sum"].sum()), tokens + float(out["tokens"].sum())
        return {"sft/val_loss": nll / max(tokens, 1.0)}

    def fit(self, total_steps: int) -> list[dict[str, float]]:
        history = [self.step() for _ in range(self.global_step, total_steps)]
        if self.run_dir is not None and (not self.save_every or self.global_step % self.save_every):
            self.save_checkpoint()
        return history

    # ---------------------------------------------------------- checkpoints
    @property
    def _root(self) -> Path:
        if self.run_dir is None:
            raise ValueError("checkpoints need a run_dir")
        return self.run_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """The actor, then the loader's position: the commit point (``checkpoints/trainer/latest``)."""
        self.build()
        step = self.global_step
        with saving(self._root, step):
            self.actor.save_checkpoint(str(self._root / "actor"), step)
            return commit_trainer_state(self._root, {"step": step, "loader": self.loader.state_dict(),
                                                     "bad_steps": self.bad_steps.steps},
                                        [self._root / "actor" / f"step_{step:08d}"])

    def resume(self) -> int:
        """Continue from the newest complete checkpoint under run_dir that verifies; returns its step (0: none)."""
        self.build()
        state = latest_trainer_state(self._root)
        if state is None:
            return 0
        self.global_step = int(state["step"])
        self.actor.load_checkpoint(str(self._root / "actor" / f"step_{self.global_step:08d}"))
        self.loader.load_state_dict(state["loader"])
        self.bad_steps.steps = list(state.get("bad_steps", []))
        return self.global_step

    def export_hf(self, path: str | Path, precision: str | None = None) -> Path:
        from transformers import AutoTokenizer

        self.build()
        self.actor.save_hf(str(path), precision)
        AutoTokenizer.from_pretrained(self.spec.kwargs["model_path"]).save_pretrained(str(path))
        return Path(path)

    def export_peft(self, path: str | Path) -> Path:
        """A LoRA actor's adapters as a PEFT adapter directory (``peft.PeftModel.from_pretrained(base, path)``
        loads it onto the base model; ``export_hf`` writes them merged)."""
        self.build()
        self.actor.save_peft(str(path))
        return Path(path)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
