"""Resharding latency: the 3D-HybridEngine's micro-DP all-gather against the two baselines.

    python tools/bench_reshard.py                          # every model and pair on 4 CPU processes
    python tools/bench_reshard.py --models tiny --pairs 4x1x1-2x1 --json out.json
    torchrun --nproc-per-node 4 tools/bench_reshard.py --inner OUT.json ...   (what the launcher runs)

Each rank holds random training shards of the model (megatron layout) and
builds its generation shard with each method ("micro_dp+release": the training shards free their memory while
the generation weights exist, as HybridFlow's zero-redundancy design does).
Per method and pair it prints:
transition latency (median over repeats, slowest rank), bytes received per
rank (largest rank) next to the lower bound (d_g-1)*M/(t*p), peak extra
memory per rank during the transition and the extra memory held while the
generation weights exist (largest rank), and the time to return to training. The
plain all-gather of the same bytes on the same micro-DP group is timed too,
so the latency can be read as a fraction of what the link allows.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hybridengine.device import current_memory, dist_backend, peak_memory, reset_peak_memory  # noqa: E402
from hybridengine.layout import ParallelLayout  # noqa: E402
from hybridengine.model_spec import ModelSpec  # noqa: E402
from hybridengine.reshard_baselines import BASELINES  # noqa: E402
from hybridengine.reshard_plan import GenerationLayout, plan_reshard  # noqa: E402
from hybridengine.resharder import Resharder  # noqa: E402
from hybridengine.stage_params import stage_params  # noqa: E402
from hybridengine.transport import TorchTransport  # noqa: E402
from tools.torchrun_job import run_torchrun_job  # noqa: E402

MODELS = {
    "tiny": dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
    "7b-1layer": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=1,
                       num_attention_heads=32, num_key_value_heads=32),
}
# (t, p, d) -> (t_g, p_g), 4 ranks
PAIRS = ["4x1x1-2x1", "4x1x1-1x1", "2x2x1-2x1", "2x2x1-1x1", "2x1x2-1x1", "1x2x2-1x1", "2x1x2-4x1"]
METHODS = ["micro_dp", "micro_dp+release", "tp_pp_gather", "full_allgather"]


def spec_of(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", **MODELS[name]})


def parse_pair(text: str) -> tuple[ParallelLayout, GenerationLayout]:
    train, gen = text.split("-")
    t, p, d = map(int, train.split("x"))
    tg, pg = map(int, gen.split("x"))
    return ParallelLayout(t, p, d), GenerationLayout(tg, pg)


def model_bytes(spec: ModelSpec) -> int:
    """M: the whole model in fp32."""
    return 4 * sum(p.numel for p in stage_params(spec, 1, 1, 0))


def timed(fn, repeats: int):
    times = []
    out = None
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times), out


def inner(args) -> None:
    dist.init_process_group(dist_backend())
    rank = dist.get_rank()
    spec = spec_of(args.model)
    train, gen = parse_pair(args.pair)
    spec.check_layout(gen.tensor_parallel, gen.pipeline_parallel)
    plan = plan_reshard(train, gen)
    coord = train.coordinate(rank)
    torch.manual_seed(rank)
    params = {p.name: torch.randn(p.shape) for p in stage_params(spec, train.tp, train.pp, coord.pp_rank)}
    rows = []
    for method in args.methods:
        transport = TorchTransport()
        if method.startswith("micro_dp"):
            resharder = Resharder(spec, plan, rank, params, transport, bucket_bytes=args.bucket_mb << 20)
            release = method.endswith("release")

            def run():
                return resharder.to_generation(release_training=release)

            def back():
                resharder.to_training()
        else:
            baseline = BASELINES[method]
            holder = {}

            def run():
                holder["weights"] = baseline(spec, plan, rank, params, transport)
                return holder["weights"]

            def back():
                holder.clear()

        run()  # warm-up: groups, allocations
        back()
        transport.bytes_received = 0
        run()
        received = transport.bytes_received
        back()
        latencies = []
        for _ in range(args.repeats):
            latencies.append(timed(run, 1)[0])
            back()
        latency = statistics.median(latencies)
        gc.collect()
        base = reset_peak_memory()
        run()
        extra = peak_memory() - base
        held = current_memory() - base
        back_s, _ = timed(back, 1)
        stats = torch.tensor([received, extra, held], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, stats)
        rows.append({
            "method": method, "latency_s": latency, "return_s": back_s,
            "bytes_received_max": int(max(g[0].item() for g in gathered)),
            "bytes_received_mean": sum(g[0].item() for g in gathered) / len(gathered),
            "peak_extra_bytes_max": int(max(g[1].item() for g in gathered)),
            "held_extra_bytes_max": int(max(g[2].item() for g in gathered)),
        })
    # The plain all-gather of one generation shard over the micro-DP group, for scale.
    group_ranks = plan.ranks[rank].micro_dp_group
    link = None
    if len(group_ranks) > 1:
        groups = {g: dist.new_group(list(g)) for g in plan.micro_dp_groups}
        # Shards of different pipeline stages differ a little in size; time equal parts of the largest.
        largest = torch.tensor([sum(t.numel() for t in params.values())])
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        shard_elems = int(largest.item())
        own = torch.randn(shard_elems)
        parts = [torch.empty_like(own) for _ in group_ranks]
        dist.all_gather(parts, own, group=groups[group_ranks])
        link, _ = timed(lambda: dist.all_gather(parts, own, group=groups[group_ranks]), args.repeats)
        link = {"allgather_s": link, "bytes": 4 * shard_elems * (len(group_ranks) - 1)}
    if rank == 0:
        M = model_bytes(spec)
        Path(args.inner).write_text(json.dumps({
            "model": args.model, "pair": args.pair, "model_bytes": M, "micro_dp_size": plan.micro_dp_size,
            "lower_bound_bytes": (plan.micro_dp_size - 1) * M / (train.tp * train.pp) if plan.kind == "gather" else 0,
            "methods": rows, "plain_allgather": link,
        }))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--pairs", nargs="+", default=PAIRS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS,
                        help="the baselines rebuild the whole model on every rank: drop them for models that will not fit")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--pair", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        return inner(args)

    results = []
    for model in args.models:
        for pair in args.pairs:
            train, _ = parse_pair(pair)
            # A fixed mmap threshold makes freed tensors leave the resident set at once,
            # so peak RSS measures what each method really holds.
            results.append(run_torchrun_job(
                __file__, train.world_size,
                ["--model", model, "--pair", pair, "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb),
                 "--methods", *args.methods],
                f"{model} {pair}", env={"MALLOC_MMAP_THRESHOLD_": "65536"},
            ))

    mib = 2**20
    header = (f"{'model':10} {'pair':10} {'method':17} {'latency_ms':>10} {'vs micro':>8} {'recv MiB':>9} "
              f"{'bound MiB':>9} {'peak extra MiB':>14} {'held MiB':>8} {'return_ms':>9}")
    print(header)
    print("-" * len(header))
    for r in results:
        micro = r["methods"][0]["latency_s"]
        for m in r["methods"]:
            print(f"{r['model']:10} {r['pair']:10} {m['method']:17} {1e3 * m['latency_s']:10.1f} "
                  f"{m['latency_s'] / micro:7.1f}x {m['bytes_received_max'] / mib:9.1f} "
                  f"{r['lower_bound_bytes'] / mib:9.1f} {m['peak_extra_bytes_max'] / mib:14.1f} "
                  f"{m['held_extra_bytes_max'] / mib:8.1f} {1e3 * m['return_s']:9.2f}")
        if r["plain_allgather"]:
            link = r["plain_allgather"]
            print(f"{'':10} {'':10} {'(all-gather)':17} {1e3 * link['allgather_s']:10.1f} "
                  f"{link['allgather_s'] / micro:7.1f}x  {link['bytes'] / mib:8.1f} received over the same micro-DP group")
    print("(latency: median of repeats, slowest rank; MiB received, peak and held extra memory: largest rank; fp32)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
