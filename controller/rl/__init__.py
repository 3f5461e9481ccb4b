"""The RL loop: ``RLTrainer`` and its step (``trainer``), the schedules (sync, one-step-off, async) and
the sample stream, the roles a job assembles and their defaults, the weight link to a rollout on its
own pool, checkpoints, the step's metrics and the rollout dump. The algorithms' hooks and tensor
functions are ``controller.algorithms``."""
