"""The ``hybridflow`` command."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training with a single controller")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="worker groups, then PPO steps of a small policy on megatron at TP2xPP2 with resharding"
    )
    demo.add_argument("--backend", choices=["auto", "ray", "torchrun"], default="auto")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--steps", type=int, default=60)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from controller.demo import run_demo

        result = run_demo(backend=args.backend, workers=args.workers, steps=args.steps)
        ok = result["replica_spread"] == 0.0 and result["weight_error"] < 0.05
        if "logprob_gap_end" in result:
            ok = ok and result["logprob_gap_end"] > result["logprob_gap_start"]
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
