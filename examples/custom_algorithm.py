"""A user's algorithm: GRPO with each advantage clipped to [-1, 1], registered by name and chosen by it.

    python examples/custom_algorithm.py            # Ray, 1 worker process, two steps

One hook (``advantages``) changes; the rest of the step is the trainer's. In a YAML config the same
class is ``algorithm.name: clipped_grpo`` (once imported) or ``algorithm.name: my_module:ClippedGRPO``.
"""

import tempfile

from hybridflow import Actor, RLAlgorithm, RLTrainer, Rollout, arithmetic_prompts, register_algorithm, resolve_model_path


@register_algorithm("clipped_grpo")
class ClippedGRPO(RLAlgorithm):
    """GRPO's defaults; no sample moves the policy more than one group-std from its group's mean."""

    preset = "grpo"

    def advantages(self, ctx, state, batch):
        batch = super().advantages(ctx, state, batch)
        advantages, mask = batch.batch["advantages"], batch.batch["response_mask"].bool()
        state.metrics["clipped_grpo/clipped_frac"] = float((advantages.abs() > 1.0)[mask].float().mean())
        batch.batch["advantages"] = advantages.clamp(-1.0, 1.0)
        return batch


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_path("builtin:tiny-arithmetic", tmp)
        trainer = RLTrainer(
            actor=Actor.from_pretrained(model, micro_batch_size=8, optim={"lr": 5e-3}, ppo={"ppo_mini_batch_size": 32}),
            rollout=Rollout.from_pretrained(model, engine="megatron", max_prompt_length=8,
                                            sampling={"max_new_tokens": 4, "n": 4}),
            reward_fn="arithmetic_shaped", algorithm="clipped_grpo",
            train_data=arithmetic_prompts(256, seed=0), batch_size=8, processes=1,
        )
        for _ in range(2):
            m = trainer.step()
            print(f"step {trainer.global_step}: reward {m['critic/score/mean']:+.3f}  advantages in "
                  f"[{m['critic/advantages/min']:+.2f}, {m['critic/advantages/max']:+.2f}]  "
                  f"clipped {m['clipped_grpo/clipped_frac']:.2f}")
        trainer.shutdown()


if __name__ == "__main__":
    main()
