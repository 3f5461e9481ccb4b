"""``from hybridflow.trainer import RLTrainer``: the RL loop (``controller.rl.trainer``), where the design
documents import it from."""

from controller.rl.trainer import RLTrainer

__all__ = ["RLTrainer"]
