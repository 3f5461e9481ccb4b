"""``hybridflow plan``: the best placements and layouts of a job on a cluster, from the config alone.

    hybridflow plan --config examples/paper_ppo.yaml --cluster 16x8xA100-80GB
    hybridflow plan --config job.yaml --cluster 4x8xH100-80GB --pin actor.tp=8 --write --json plans.json

Exit status: 0 with a plan; 1 when no plan fits the cluster (the message gives the memory of the smallest
plan tried); 2 on bad input (an unknown device, a pin that contradicts the model or the cluster).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner loads only when the command runs: `hybridflow --help` and the other commands stay fast
    from controller.planner.options import Pin
    from controller.planner.workload import Workload

__all__ = ["add_plan_parser", "parse_pins", "run_plan"]

_PIN_KEYS = {"tp": int, "pp": int, "ep": int, "cp": int, "micro_batch": int, "gen_tp": int, "devices": int,
             "colocate_with": str}


def add_plan_parser(commands) -> None:
    plan = commands.add_parser("plan", help="choose placement and parallelism for a job on a cluster (nothing runs)")
    plan.add_argument("--config", help="the job's YAML file; omitted: all defaults")
    plan.add_argument("--cluster",
                      help="NODESxDEVICESxTYPE, e.g. 4x8xH100-80GB (types: controller/planner/hardware.py), or "
                           "'local': this machine's CPU processes (trainer.nproc of them), as --calibrate measured it")
    plan.add_argument("--calibrate", action="store_true",
                      help="measure this machine (GEMM rates, memory bandwidth, gloo) for --cluster local, and save it")
    plan.add_argument("--pin", action="append", default=[], metavar="ROLE.KEY=VALUE",
                      help=f"fix a choice: keys {sorted(_PIN_KEYS)}, e.g. actor.tp=8, critic.colocate_with=actor")
    plan.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    plan.add_argument("--network-gbps", type=float, help="network bandwidth per device between nodes, Gb/s")
    plan.add_argument("--write", action="store_true", help="print the chosen plan's overrides for hybridflow train")
    plan.add_argument("--json", metavar="PATH", help="write every plan kept, and the losers, as JSON")
    plan.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config, as for train")


def parse_pins(items: list[str], workload: "Workload") -> "dict[str, Pin]":
    """``role.key=value`` pins, checked against the job's roles (a PlanError names what is valid)."""
    from controller.planner.options import Pin
    from controller.planner.search import PlanError

    pins: dict[str, dict] = {}
    for item in items:
        target, sep, value = item.partition("=")
        role, dot, key = target.partition(".")
        if not sep or not dot:
            raise PlanError(f"--pin {item!r} is not ROLE.KEY=VALUE (e.g. actor.tp=8)")
        if role not in workload.role_names:
            raise PlanError(f"--pin {item!r}: the job has no role {role!r}; its roles: {list(workload.role_names)}")
        if key not in _PIN_KEYS:
            raise PlanError(f"--pin {item!r}: unknown key {key!r}; valid: {sorted(_PIN_KEYS)}")
        try:
            parsed = _PIN_KEYS[key](value)
        except ValueError:
            raise PlanError(f"--pin {item!r}: {key} must be an integer, got {value!r}") from None
        if _PIN_KEYS[key] is int and parsed < 1:
            raise PlanError(f"--pin {item!r}: {key} must be >= 1")
        if key == "colocate_with" and parsed not in workload.role_names:
            raise PlanError(f"--pin {item!r}: no role {parsed!r} to colocate with; roles: {list(workload.role_names)}")
        if key == "gen_tp" and not workload.role(role).generates:
            raise PlanError(f"--pin {item!r}: {role} does not generate; gen_tp pins the role that does")
        previous = pins.setdefault(role, {}).get(key)
        if previous is not None and previous != parsed:
            raise PlanError(f"--pin {role}.{key} is given twice, as {previous!r} and {parsed!r}")
        pins[role][key] = parsed
    return {role: Pin(**values) for role, values in pins.items()}


def check_pins(pins: "dict[str, Pin]", workload: "Workload", cluster) -> None:
    """Pins that no plan can satisfy, named before the search runs."""
    from controller.planner.search import PlanError

    for role, pin in pins.items():
        work = workload.role(role)
        if pin.devices is not None and pin.devices > cluster.devices:
            raise PlanError(f"--pin {role}.devices={pin.devices}: the cluster has {cluster.devices} devices")
        if pin.tp is not None:
            if pin.tp > cluster.devices_per_node:
                raise PlanError(f"--pin {role}.tp={pin.tp}: TP stays within a node, which has "
                                f"{cluster.devices_per_node} devices")
            try:
                work.padded(pin.tp).check_layout(pin.tp, pin.pp or 1)
            except ValueError as exc:
                raise PlanError(f"--pin {role}.tp={pin.tp}: {exc}") from None
        if pin.pp is not None and work.spec.num_layers % pin.pp:
            raise PlanError(f"--pin {role}.pp={pin.pp}: the model's {work.spec.num_layers} layers do not divide "
                            f"into {pin.pp} stages")
        if pin.devices is not None and pin.tp is not None and pin.devices % (pin.tp * (pin.pp or 1)):
            raise PlanError(f"--pin {role}: tp x pp = {pin.tp * (pin.pp or 1)} does not divide devices={pin.devices}")
        if pin.cp is not None and pin.cp > 1 and (role == "rollout" or work.spec.moe is not None or work.lora_rank
                                                   or work.spec.vision is not None):
            raise PlanError(f"--pin {role}.cp={pin.cp}: context parallelism splits a dense megatron role's sequences "
                            "(not a rollout's, a mixture of experts', a LoRA role's or a vision-language model's)")
        if pin.colocate_with == role:
            raise PlanError(f"--pin {role}.colocate_with={role}: a role is always with itself; name another role")
        if workload.mode != "sync" and "rollout" in (role, pin.colocate_with) and pin.colocate_with is not None:
            raise PlanError(f"--pin {role}.colocate_with={pin.colocate_with}: trainer.mode {workload.mode} runs the "
                            f"rollout on a pool of its own")


def run_plan(args) -> int:
    from controller.config import ConfigError, load_config
    from controller.planner.hardware import ClusterError, parse_cluster
    from controller.planner.report import plan_overrides, render, result_json
    from controller.planner.search import PlanError, search
    from controller.planner.workload import job_workload

    from controller.planner.calibrate import load_calibration, local_cluster, local_efficiency, recalibrate

    if args.calibrate:
        figures, path = recalibrate()
        print(f"calibrated {figures['machine']['cpu']} ({figures['machine']['cores']} cores): "
              f"GEMM {figures['fp32_flops'] / 1e9:.1f} GFLOP/s fp32, {figures['bf16_flops'] / 1e9:.1f} bf16; memory "
              f"{figures['memory_bandwidth'] / 1e9:.1f} GB/s; gloo {figures['gloo_latency_s'] * 1e6:.0f} us, "
              f"{figures['gloo_bandwidth'] / 1e9:.2f} GB/s -> {path}")
        if args.cluster is None:
            return 0
    try:
        if args.cluster is None:
            raise ClusterError("give --cluster NODESxDEVICESxTYPE (e.g. 4x8xH100-80GB) or --cluster local")
        config = load_config(args.config, args.overrides)
        efficiency = None
        if args.cluster == "local":
            figures = load_calibration()
            cluster = local_cluster(config.trainer.nnodes * config.trainer.nproc, figures)
            efficiency = local_efficiency(figures)
        else:
            cluster = parse_cluster(args.cluster)
        if args.network_gbps is not None:
            if args.network_gbps <= 0:
                raise ClusterError(f"--network-gbps must be > 0, got {args.network_gbps}")
            cluster = cluster.with_network(args.network_gbps)
        workload = job_workload(config, flash_attention=args.cluster != "local")  # CPU attention keeps its scores
        pins = parse_pins(args.pin, workload)
        check_pins(pins, workload, cluster)
        if args.top < 1:
            raise PlanError(f"--top must be >= 1, got {args.top}")
        result = search(workload, cluster, efficiency, pins=pins, top=args.top)
    except (ConfigError, ClusterError, PlanError, FileNotFoundError, ValueError) as exc:
        print(f"hybridflow plan: {exc}", file=sys.stderr)
        return 2
    print(render(result, workload, cluster))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result_json(result, workload, cluster), indent=2))
    if not result.plans:
        needs = [r.need for r in result.rejected if r.need]
        smallest = min(needs) if needs else None
        what = (f"its smallest plan needs {smallest / 2**30:.2f} GiB on a device"
                if smallest else "no layout of the models divides these devices")
        print(f"hybridflow plan: the job fits no plan on {cluster}: {what}, and a device has "
              f"{cluster.accelerator.usable_bytes / 2**30:.2f} GiB usable; use more or larger devices", file=sys.stderr)
        return 1
    if args.write:
        overrides = plan_overrides(result.plans[0], cluster)
        config_arg = f" --config {args.config}" if args.config else ""
        print("\n# the chosen plan:")
        merged = {o.partition("=")[0]: o for o in [*args.overrides, *overrides]}  # the plan's value of a key wins
        print(f"hybridflow train{config_arg} " + " ".join(f"'{o}'" if " " in o else o for o in merged.values()))
    return 0
