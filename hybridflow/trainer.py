"""``from hybridflow.trainer import RLTrainer``: the RL loop (``controller.trainer``), where the design
documents import it from."""

from controller.trainer import RLTrainer

__all__ = ["RLTrainer"]
