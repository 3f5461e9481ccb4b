"""The ``hybridflow`` command."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training with a single controller")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="data-parallel training on a worker group (Ray or torchrun)")
    demo.add_argument("--backend", choices=["auto", "ray", "torchrun"], default="auto")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--steps", type=int, default=60)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from controller.demo import run_demo

        result = run_demo(backend=args.backend, workers=args.workers, steps=args.steps)
        return 0 if result["replica_spread"] == 0.0 and result["weight_error"] < 0.05 else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
