"""The ``hybridflow`` command: train, sft, plan, plot, export, data."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from controller.planner.command import add_plan_parser
from controller.runtime.torchrun_backend import under_torchrun
from workers.console import configure_console

STOP_FILE_ENV = "HYBRIDFLOW_STOP_FILE"  # where a torchrun rank says the run stopped itself (_torchrun reads it)
FAILURE_FILE_ENV = "HYBRIDFLOW_FAILURE_FILE"  # where rank 0 says why the run failed, and whether to restart


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training with a single controller")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run an RL job from a YAML config (key.sub=value overrides after it)")
    train.add_argument("--config", help="a YAML file (examples/*.yaml); omitted: all defaults")
    train.add_argument("overrides", nargs="*", help="key.sub=value, e.g. algorithm.name=grpo rollout.sampling.n=4")
    train.add_argument("--force", action="store_true",
                       help="launch a GPU job even when the planner predicts it will not fit its devices' memory")
    sft = commands.add_parser("sft", help="supervised fine-tuning from a YAML config (key.sub=value overrides after it)")
    sft.add_argument("--config", help="a YAML file (examples/sft_tiny.yaml); omitted: all defaults")
    sft.add_argument("overrides", nargs="*", help="key.sub=value, e.g. data.batch_size=32 trainer.total_steps=100")
    plot = commands.add_parser("plot", help="write PNG curves of a run's metrics")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="directory for the PNGs (default RUN_DIR/plots)")
    plot.add_argument("--step", type=int, metavar="N",
                      help="the step timeline.png draws, its pools' phases over time (default: the last step "
                           "with phase timings)")
    export = commands.add_parser("export", help="write a run's trained actor (newest checkpoint) as an HF checkpoint")
    export.add_argument("run_dir")
    export.add_argument("--out", required=True)
    _data_parser(commands)
    add_plan_parser(commands)
    return parser


def _data_parser(commands) -> None:
    from controller.data.arithmetic import ARITHMETIC_INSTRUCTION, ARITHMETIC_OPERATORS
    from controller.data.gsm8k import GSM8K_INSTRUCTION

    data = commands.add_parser("data", help="write ready-to-train parquet files in verl's row schema")
    kinds = data.add_subparsers(dest="kind", required=True)
    arithmetic = kinds.add_parser("arithmetic", help="a op b problems as chat prompts: OUT/train.parquet, OUT/val.parquet")
    arithmetic.add_argument("--out", required=True)
    arithmetic.add_argument("--train-size", type=int, default=2048)
    arithmetic.add_argument("--val-size", type=int, default=64)
    arithmetic.add_argument("--seed", type=int, default=0)
    arithmetic.add_argument("--max-operand", type=int, default=9, help="operands in [0, MAX_OPERAND]")
    arithmetic.add_argument("--operators", default=ARITHMETIC_OPERATORS, help=f"a subset of {ARITHMETIC_OPERATORS!r}")
    arithmetic.add_argument("--instruction", default=ARITHMETIC_INSTRUCTION, help="formatted with {a}, {op}, {b}")
    gsm8k = kinds.add_parser("gsm8k", help="GSM8K rows (question, answer with '#### N') into OUT/SPLIT.parquet")
    gsm8k.add_argument("--input", required=True, help="a .parquet / .jsonl / .json file or a save_to_disk directory")
    gsm8k.add_argument("--out", required=True)
    gsm8k.add_argument("--split", default="train")
    gsm8k.add_argument("--instruction", default=GSM8K_INSTRUCTION, help="appended to each question")
    images = kinds.add_parser("images", help="rows with images (paths or bytes) into OUT/SPLIT.parquet, each image "
                                             "checked and stored in the file")
    images.add_argument("--input", required=True, help="a .parquet / .jsonl / .json file or a save_to_disk directory")
    images.add_argument("--out", required=True)
    images.add_argument("--split", default="train")
    images.add_argument("--image-key", default="images", help="the column holding each row's images")
    images.add_argument("--prompt-key", default="prompt", help="the prompt column, with an <image> per image")


def _data(args) -> int:
    from controller.data.writers import write_arithmetic_files, write_gsm8k_file, write_image_rows

    try:
        if args.kind == "arithmetic":
            paths = write_arithmetic_files(args.out, args.train_size, args.val_size, args.seed, args.max_operand,
                                           args.operators, args.instruction)
        elif args.kind == "images":
            paths = [write_image_rows(args.input, args.out, args.split, args.image_key, args.prompt_key)]
        else:
            paths = [write_gsm8k_file(args.input, args.out, args.split, args.instruction)]
    except (FileNotFoundError, ValueError) as exc:
        print(f"hybridflow data {args.kind}: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _torchrun(trainer, argv: list[str]) -> int:
    """Run ``hybridflow <argv>`` under torchrun: one launcher here, or this node's share of a multi-node job.

    With ``trainer.max_restarts``, a launch that fails for a reason a restart can get past (rank 0 says so in
    a file; a rank 0 that died says nothing) is started again, its ranks resuming from the newest complete
    checkpoint (``HYBRIDFLOW_RESTART`` in their environment), within the crash-loop bound."""
    from controller.jobs.restarts import RESTART_ENV, CrashLoopError, RestartBudget

    if trainer.nnodes == 1:
        launch = ["--standalone", f"--nproc-per-node={trainer.nproc}"]
    else:
        # Every node runs this same command; c10d's rendezvous at rdzv_endpoint assembles the world.
        run_id = hashlib.sha1(f"{trainer.run_dir}|{trainer.rdzv_endpoint}".encode()).hexdigest()[:16]
        launch = [f"--nnodes={trainer.nnodes}", f"--nproc-per-node={trainer.nproc}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint={trainer.rdzv_endpoint}", f"--rdzv-id=hybridflow-{run_id}"]
        if os.environ.get("HYBRIDFLOW_NODE_IP"):  # the address the other nodes reach this one on
            launch.append(f"--local-addr={os.environ['HYBRIDFLOW_NODE_IP']}")
    command = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "controller.cli", *argv]
    # The machine's cores shared among the ranks (torchrun's own default is 1 thread, which leaves a
    # one-process run on a fraction of the CPU); a user's OMP_NUM_THREADS wins.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // trainer.nproc))
    budget = RestartBudget(trainer.max_restarts, trainer.restart_window_s,
                           log_path=Path(trainer.run_dir) / "restarts.jsonl" if trainer.run_dir else None)
    # A run that stops itself (TrainingStoppedError) says so in the stop file and its ranks exit cleanly, so that
    # torchrun does not report a failed child: this command then exits 3, as it does under Ray. A run that
    # fails says in the failure file whether a restart can get past it.
    with tempfile.TemporaryDirectory(prefix="hybridflow-stop-") as scratch:
        stop_file, failure_file = Path(scratch) / "stopped", Path(scratch) / "failed"
        env = {**os.environ, "OMP_NUM_THREADS": threads, STOP_FILE_ENV: str(stop_file),
               FAILURE_FILE_ENV: str(failure_file)}
        while True:
            code, died = _call_torchrun(command, env)
            if stop_file.exists():
                return 3  # (a hung rank the stop killed makes torchrun report it)
            if code == 0 or not trainer.max_restarts:
                return code
            said = json.loads(failure_file.read_text()) if failure_file.exists() else None
            failure_file.unlink(missing_ok=True)
            if said is not None and not said["restartable"]:
                return code
            cause = said["cause"] if said else died or f"torchrun exited with code {code} (see above)"
            try:
                number = budget.admit(cause)
            except CrashLoopError as exc:
                print(f"hybridflow {argv[0]}: stopped: {exc}", file=sys.stderr, flush=True)
                return 3
            budget.record(nnodes=[trainer.nnodes, trainer.nnodes])
            print(f"[hybridflow] restart {number} (at most {trainer.max_restarts} within "
                  f"{trainer.restart_window_s:g} s) after {cause}: torchrun again, resuming from the newest complete "
                  f"checkpoint", file=sys.stderr, flush=True)
            env[RESTART_ENV] = str(number)


# torchrun's agent, when a rank ends badly: "failed (exitcode: -9) local_rank: 1 (pid: 25893) of binary: ..."
_CHILD_FAILED = re.compile(rb"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def _call_torchrun(command: list[str], env: dict[str, str]) -> tuple[int, str | None]:
    """Run torchrun, its stderr passed through as it comes; returns its exit code and, when its agent reported
    a rank that ended badly, which (the agent stops the others at once, often before rank 0 can say why)."""
    import threading

    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    died: list[str] = []

    def pass_through() -> None:
        tail = b""
        while chunk := os.read(proc.stderr.fileno(), 1 << 16):
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()
            tail = (tail + chunk)[-4096:]
            if not died and (match := _CHILD_FAILED.search(tail)):
                code, rank, pid = (int(g) for g in match.groups())
                how = (f"ended by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                       else f"exited with code {code}")
                died.append(f"local rank {rank} (pid {pid}) {how}")

    reader = threading.Thread(target=pass_through, name="torchrun-stderr", daemon=True)
    reader.start()
    code = proc.wait()
    reader.join(timeout=5)  # (a process the ranks left behind may hold the pipe open: not waited for)
    return code, died[0] if died else None


def _ray_cluster(config):
    """The Ray cluster's nodes for the placement check (joining ``trainer.ray_address``), None under torchrun."""
    if config.trainer.launcher != "ray":
        return None
    from controller.runtime.ray_backend import cluster_for

    try:
        return cluster_for(config.trainer.ray_address)
    except ConnectionError as exc:
        raise ConnectionError(f"cannot join the Ray cluster at trainer.ray_address={config.trainer.ray_address!r}: "
                              f"{exc}") from None


def _train(args, argv: list[str]) -> int:
    from controller.config import load_config
    from controller.jobs.train_job import prepare_job, run_training

    from controller.planner.prelaunch import check_before_launch

    if args.force:  # as the override, so that the processes torchrun starts (the same argv) skip it too
        args.overrides = [*args.overrides, "trainer.memory_check=false"]

    def prepare(config):
        check_before_launch(config)
        return prepare_job(config, cluster=_ray_cluster(config))

    # Before any worker starts: the memory of a GPU job, the model, the data, the reward functions, the placement
    # against the Ray cluster.
    return _run_job("train", load_config, prepare, run_training, args, argv)


def _sft(args, argv: list[str]) -> int:
    from controller.sft.config import load_sft_config
    from controller.sft.job import prepare_sft, run_sft

    return _run_job("sft", load_sft_config, prepare_sft, run_sft, args, argv)  # the model, the examples, every check


def _run_job(command: str, load, prepare, run, args, argv: list[str]) -> int:
    """Load and check a job's config, then run it: here (Ray, or this process is a torchrun rank) or
    under a torchrun this command starts. Every check that needs no worker process runs before any
    starts; a problem exits 2 naming it."""
    from controller.config import ConfigError
    from controller.jobs.restarts import RESTART_ENV

    prepared = None
    try:
        resumed = ["trainer.resume=true"] if under_torchrun() and os.environ.get(RESTART_ENV) else []
        config = load(args.config, [*args.overrides, *resumed])  # (a restarted launch resumes)
        configure_console(config.trainer.verbose)  # before the libraries that log at import
        if not under_torchrun():
            trainer = config.trainer
            if trainer.launcher == "torchrun" and trainer.nnodes > 1 and not trainer.rdzv_endpoint:
                raise ConfigError(f"trainer.nnodes={trainer.nnodes} with trainer.launcher=torchrun: set "
                                  "trainer.rdzv_endpoint=host:port (a port on the first node that every node can "
                                  "reach) and run the same command on every node (tools/slurm/ renders it)")
            prepared = prepare(config)
    except (ConfigError, FileNotFoundError, ValueError, ConnectionError) as exc:
        print(f"hybridflow {command}: {exc}", file=sys.stderr)
        return 2
    if config.trainer.launcher == "torchrun" and not under_torchrun():
        return _torchrun(config.trainer, argv)
    from controller.errors import TrainingStoppedError
    from controller.jobs.restarts import describe, restartable

    try:
        run(config, prepared)
    except Exception as exc:
        failure_file = os.environ.get(FAILURE_FILE_ENV) if under_torchrun() else None
        restart = bool(config.trainer.max_restarts) and restartable(exc)
        if failure_file and (restart or not isinstance(exc, TrainingStoppedError)):
            # Rank 0 of a torchrun launch: the launching command restarts it, or not, from what this says.
            Path(failure_file).write_text(json.dumps({"restartable": restart, "cause": describe(exc)}))
            if restart:
                print(f"hybridflow {command}: failed: {exc}", file=sys.stderr, flush=True)
                return 1
        if not isinstance(exc, TrainingStoppedError):
            raise
        print(f"hybridflow {command}: stopped: {exc}", file=sys.stderr, flush=True)  # for a reason it names
        if under_torchrun() and os.environ.get(STOP_FILE_ENV):  # the launcher exits 3 for the whole job
            Path(os.environ[STOP_FILE_ENV]).write_text(str(exc))
            return 0
        return 3
    return 0


def _export(args, argv: list[str]) -> int:
    import yaml

    from controller.config import load_config
    from controller.sft.config import load_sft_config
    from controller.jobs.train_job import export_checkpoint

    saved = Path(args.run_dir) / "config.yaml"
    kind = (yaml.safe_load(saved.read_text()) or {}).get("kind") if saved.is_file() else None
    config = load_sft_config(saved) if kind == "sft" else load_config(saved)
    configure_console(config.trainer.verbose)
    if config.trainer.launcher == "torchrun" and not under_torchrun():
        return _torchrun(config.trainer, argv)
    export_checkpoint(config, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "train":
        return _train(args, argv)
    if args.command == "sft":
        return _sft(args, argv)
    if args.command == "plot":
        from controller.metrics.plots import plot_run

        try:
            paths = plot_run(args.run_dir, args.out, step=args.step)
        except (FileNotFoundError, ValueError) as exc:
            print(f"hybridflow plot: {exc}", file=sys.stderr)
            return 2
        for path in paths:
            print(path)
        return 0
    if args.command == "export":
        return _export(args, argv)
    if args.command == "data":
        return _data(args)
    if args.command == "plan":
        from controller.planner.command import run_plan

        return run_plan(args)
    return 2


def run() -> None:
    """The ``hybridflow`` command: ``main`` on this process's arguments, then a prompt exit
    (controller/runtime/process_exit.py) once the command's outputs are closed."""
    from controller.runtime.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    run()
