"""Launch an RL job under your own torchrun (cluster users):

    torchrun --nproc-per-node 4 tools/train.py --config examples/ppo_tiny.yaml trainer.total_steps=50

The same as ``hybridflow train`` with ``trainer.launcher=torchrun``, minus the launching.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
