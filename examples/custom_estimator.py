"""A custom advantage estimator and a custom reward worker in RLTrainer, without touching the framework.

    python examples/custom_estimator.py            # Ray, 1 worker process, two GRPO-style steps

The estimator scores each response against the median of its prompt's
samples (a robust cousin of GRPO's mean baseline); the reward worker is a
BaseWorker subclass that prefers short, digit-only answers.
"""

import tempfile

import torch

from hybridflow import (
    Actor,
    AdvantageConfig,
    AdvantageInputs,
    BaseWorker,
    DataProto,
    Dispatch,
    RLTrainer,
    RoleSpec,
    Rollout,
    arithmetic_prompts,
    group_rows,
    last_token_scores,
    register,
    register_advantage_estimator,
    resolve_model_path,
)


@register_advantage_estimator("median_baseline")
def median_baseline(inputs: AdvantageInputs, config: AdvantageConfig):
    scores = inputs.token_level_rewards.sum(-1)
    advantages = torch.zeros_like(scores)
    for rows in group_rows(inputs.group_index).values():
        advantages[rows] = scores[rows] - scores[rows].median()
    advantages = advantages[:, None] * inputs.response_mask
    return advantages, advantages


class DigitsReward(BaseWorker):
    """1 per response made only of digits, minus 0.1 per token: short numeric answers win."""

    def __init__(self, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_reward(self, data: DataProto) -> DataProto:
        mask = data.batch["response_mask"]
        texts = [self.tokenizer.decode(r[m.bool()], skip_special_tokens=True)
                 for r, m in zip(data.batch["responses"], mask)]
        scores = torch.tensor([float(t.isdigit()) - 0.1 * len(t) for t in texts])
        return DataProto({"token_level_scores": last_token_scores(scores, mask), "scores": scores})


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_path("builtin:tiny-arithmetic", tmp)
        trainer = RLTrainer(
            actor=Actor.from_pretrained(model, micro_batch_size=8, optim={"lr": 5e-3}, ppo={"ppo_mini_batch_size": 32}),
            rollout=Rollout.from_pretrained(model, engine="megatron", max_prompt_length=8,
                                            sampling={"max_new_tokens": 4, "n": 4}),
            reward_worker=RoleSpec(DigitsReward, {"tokenizer_path": model}),
            algorithm={"name": "custom", "advantage_estimator": "median_baseline"},
            train_data=arithmetic_prompts(256, seed=0), batch_size=8, processes=1,
        )
        for _ in range(2):
            m = trainer.step()
            print(f"step {trainer.global_step}: reward {m['critic/score/mean']:+.3f}  "
                  f"advantages in [{m['critic/advantages/min']:+.2f}, {m['critic/advantages/max']:+.2f}]  "
                  f"pg_loss {m['actor/pg_loss']:+.4f}")
        print("estimator used: median_baseline")
        trainer.shutdown()


if __name__ == "__main__":
    main()
