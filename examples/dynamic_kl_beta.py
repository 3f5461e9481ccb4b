"""Replace the KL term of the actor's loss with your own: here a coefficient that decays with the step.

    python examples/dynamic_kl_beta.py             # Ray, 1 worker process, GRPO with a k3 KL loss

``kl_loss_fn(actor_outputs, ref_outputs, step)`` returns the KL term, weight
included: a scalar (a token mean, as ``torch.mean(actor_outputs.logprobs -
ref_outputs.logprobs)`` is) or, as here, one value per token, which the update
aggregates like the policy loss (workers/user_kl.py). The trainer hands it to
the actor's update (and keeps a reference policy for it). The loop reports the
beta it used.
"""

import tempfile

from hybridflow import Actor, RLTrainer, Rollout, arithmetic_prompts, kl_penalty, resolve_model_path


def beta(step: int) -> float:
    return 0.2 * 0.5**step


def kl_loss_fn(actor_outputs, ref_outputs, step):
    # k3 per token ([B, T]; the padding is 0 in both and never read)
    return beta(step) * kl_penalty(actor_outputs.token_logprobs, ref_outputs.token_logprobs, "k3")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_path("builtin:tiny-arithmetic", tmp)
        trainer = RLTrainer(
            actor=Actor.from_pretrained(model, micro_batch_size=8, optim={"lr": 5e-3}, ppo={"ppo_mini_batch_size": 32}),
            rollout=Rollout.from_pretrained(model, engine="megatron", max_prompt_length=8,
                                            sampling={"max_new_tokens": 4, "n": 4}),
            reward_fn="arithmetic_shaped", algorithm="grpo", kl_loss_fn=kl_loss_fn,
            train_data=arithmetic_prompts(256, seed=0), batch_size=8, processes=1,
        )
        for step in range(2):
            metrics = trainer.step()
            metrics["beta"] = beta(step)
            print(f"step {trainer.global_step}: beta {metrics['beta']:.3f}  kl_loss {metrics['actor/kl_loss']:.5f}  "
                  f"reward {metrics['critic/score/mean']:+.3f}")
        trainer.shutdown()


if __name__ == "__main__":
    main()
