"""Draw PNG charts of a run's metrics.jsonl.

    python tools/plot_metrics.py RUN_DIR                       # default figures into RUN_DIR/plots
    python tools/plot_metrics.py RUN_DIR --out figs --keys actor/pg_loss critic/vf_loss

Prints the path of each PNG written. See controller/metrics/plots.py for the figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.metrics.plots import plot_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    parser.add_argument("--keys", nargs="+", default=None, metavar="KEY",
                        help="plot these metrics, one figure each, instead of the default figures")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, out_dir=args.out, keys=args.keys)
    except (FileNotFoundError, ValueError) as error:
        print(f"plot_metrics: {error}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    if not paths:
        print("plot_metrics: none of the default figures' metrics are in this run; try --keys", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
