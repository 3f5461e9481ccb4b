"""Resharding latency: the 3D-HybridEngine's micro-DP all-gather against the plain all-gather and two baselines.

    python tools/bench_reshard.py                          # every model and pair (4 and 8 CPU processes)
    python tools/bench_reshard.py --models tiny --pairs 4x1x1-2x1 --dtypes bf16 --json out.json
    python tools/bench_reshard.py --models tiny --pairs all-legal --world 8 --methods micro_dp+keep
    python tools/bench_reshard.py --models moe --pairs 1x1x4x4x1-2x1 1x1x4x4x1-2x1xEP 2x1x2x2x1-1x1 --methods micro_dp
    torchrun --nproc-per-node 4 tools/bench_reshard.py --inner OUT.json ...   (what the launcher runs)

Each rank holds random training shards of the model (megatron layout) and
builds its generation shard with each method ("micro_dp+keep": the
generation buffer is kept between transitions, as ``to_training(offload=True)``
does on CPU and as the GPU's caching allocator does for a freed one;
"micro_dp+release": the training shards free their memory while the
generation weights exist, as HybridFlow's zero-redundancy design does).
Per method and pair it prints:
transition latency (median over repeats, slowest rank), bytes received per
rank (largest rank) next to the lower bound (d_g-1)*M/(t*p), peak extra
memory per rank during the transition and the extra memory held while the
generation weights exist (largest rank), and the time to return to training. The
plain all-gather of the same bytes on the same micro-DP group is timed too,
so the latency can be read as a fraction of what the link allows.

A mixture of experts ("moe": 8 experts, top-2) takes pairs with its expert grid,
TxPxDxEPxETP-TGxPG, and "xEP" after the generation size for whole experts per
generation rank. Its dense part goes through the method, its routed experts
point to point (their group's pieces, ``PieceMover``); the bound printed is the dense part's
plus the experts' (``expert_group``: the units a rank needs and does not hold).
Only the micro_dp methods move experts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hybridengine.device import (CollectiveProfile, current_memory, device_for_local_rank,  # noqa: E402
                                 dist_backend, peak_memory, reset_peak_memory, synchronize)
from hybridengine.parallel.layout import ParallelLayout  # noqa: E402
from hybridengine.model.spec import ModelSpec  # noqa: E402
from hybridengine.reshard.baselines import BASELINES  # noqa: E402
from hybridengine.reshard.plan import GenerationLayout, legal_generation_layouts  # noqa: E402
from hybridengine.reshard.weight_plan import plan_weights  # noqa: E402
from hybridengine.reshard.resharder import Resharder  # noqa: E402
from hybridengine.model.catalogue import ExpertShard, stage_params  # noqa: E402
from hybridengine.reshard.dense_group import move_dense  # noqa: E402
from hybridengine.reshard.piece_mover import PieceMover  # noqa: E402
from hybridengine.reshard.transport import TorchTransport  # noqa: E402
from tools.torchrun_job import run_torchrun_job  # noqa: E402

MODELS = {
    "tiny": dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
    "7b-1layer": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=1,
                       num_attention_heads=32, num_key_value_heads=32),
    # A mixture of experts (Qwen3-MoE's layout): the routed experts are most of its bytes.
    "moe": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=1024, hidden_size=512, intermediate_size=1024,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=512, norm_topk_prob=True),
}
# (t, p, d) -> (t_g, p_g): 4 ranks, then 8 (the paper's example and two pipeline merges)
PAIRS = ["4x1x1-2x1", "4x1x1-1x1", "2x2x1-2x1", "2x2x1-1x1", "2x1x2-1x1", "1x2x2-1x1", "2x1x2-4x1",
         "2x2x2-1x1", "4x1x2-2x1", "2x4x1-2x2"]
METHODS = ["micro_dp", "micro_dp+keep", "micro_dp+release", "tp_pp_gather", "full_allgather"]
# the dense group moved point to point by the weight plan's one executor: asked for by name (--methods ... pieces)
OPTIONAL_METHODS = ["pieces"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def all_legal_pairs(spec: ModelSpec, world: int) -> list[str]:
    """Every (training layout, generation layout) of ``world`` ranks that the model allows."""
    pairs = []
    for t in range(1, world + 1):
        for p in range(1, world // t + 1):
            if world % (t * p) or spec.num_layers % p:
                continue
            try:
                spec.check_layout(t, p)
            except ValueError:
                continue
            train = ParallelLayout(t, p, world // (t * p))
            for gen in legal_generation_layouts(train):
                try:
                    spec.check_layout(gen.tensor_parallel, gen.pipeline_parallel)
                except ValueError:
                    continue
                pairs.append(f"{t}x{p}x{train.dp}-{gen.tensor_parallel}x{gen.pipeline_parallel}")
    return pairs


def spec_of(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", **MODELS[name]})


def parse_pair(text: str) -> tuple[ParallelLayout, GenerationLayout]:
    """TxPxD[xEPxETP]-TGxPG[xEP]."""
    train, gen = text.split("-")
    sizes = [int(x) for x in train.split("x")]
    whole = gen.endswith("xEP")
    tg, pg = map(int, gen.removesuffix("xEP").split("x"))
    return ParallelLayout(*sizes), GenerationLayout(tg, pg, whole)


def model_bytes(spec: ModelSpec, element_size: int) -> int:
    """M: the whole model (a mixture of experts with every expert)."""
    return element_size * sum(p.numel for p in stage_params(spec, 1, 1, 0))


def timed(fn, repeats: int):
    times = []
    out = None
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        synchronize()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times), out


def measure_link(transport: TorchTransport, key, device: torch.device, dtype: torch.dtype) -> CollectiveProfile:
    """The micro-DP group's link, measured: one element's all-gather (latency), 32 MiB's (bandwidth), a local copy."""
    def seconds(n: int) -> float:
        own = torch.zeros(n, dtype=dtype, device=device)
        out = torch.empty(n * len(key), dtype=dtype, device=device)
        transport.all_gather_into(out, own, key)
        return timed(lambda: transport.all_gather_into(out, own, key), 5)[0]

    n = (32 << 20) // torch.finfo(dtype).bits * 8
    latency = seconds(1)
    link = n * (len(key) - 1) * torch.finfo(dtype).bits / 8 / max(seconds(n) - latency, 1e-9)
    a, b = torch.zeros(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
    b.copy_(a)
    copy = timed(lambda: b.copy_(a), 5)[0]
    return CollectiveProfile(latency, link, a.numel() * a.element_size() / max(copy, 1e-9))


def inner(args) -> None:
    dist.init_process_group(dist_backend())
    rank = dist.get_rank()
    device = device_for_local_rank(int(os.environ.get("LOCAL_RANK", 0)))
    dtype = DTYPES[args.dtype]
    spec = spec_of(args.model)
    train, gen = parse_pair(args.pair)
    weights = plan_weights(spec, train, gen)
    plan = weights.layout
    coord = train.coordinate(rank)
    torch.manual_seed(rank)
    params = {p.name: torch.randn(p.shape).to(device=device, dtype=dtype)
              for p in stage_params(spec, train.tp, train.pp, coord.pp_rank, routed=False)}
    experts = None  # a mixture of experts: this rank's training experts, moved point to point
    if spec.moe is not None:
        at = train.expert_coordinate(rank)
        shard = ExpertShard(train.ep, at.ep_rank, train.etp)
        experts = {p.name: torch.randn(p.shape).to(device=device, dtype=dtype)
                   for p in stage_params(spec, train.tp, train.pp, at.pp_rank, experts=shard) if p.expert is not None}
        args.methods = [m for m in args.methods if m.startswith("micro_dp")]
    element = torch.finfo(dtype).bits // 8
    transport = TorchTransport()  # one communicator per group, shared by every method and the reference
    group_ranks = plan.ranks[rank].micro_dp_group
    keys = {g: transport.new_group(g) for g in plan.micro_dp_groups}
    profile = None
    if args.measure_link and len(group_ranks) > 1:
        profile = measure_link(transport, keys[group_ranks], device, dtype)
    schedule = None
    runners = {}
    for method in args.methods:
        if method.startswith("micro_dp"):
            resharder = Resharder(weights, rank, params, transport,
                                  bucket_bytes=args.bucket_mb << 20 if args.bucket_mb else None, profile=profile)
            if resharder.schedule is not None:
                schedule = {"bucket_bytes": resharder.bucket_bytes, "buffer_elements": resharder.schedule.numel,
                            "units": [u.name for u in resharder.schedule.units]}
            release, keep = method.endswith("release"), method.endswith("keep")
            moving = PieceMover.colocated(weights.experts, rank, transport) if experts is not None else None
            runners[method] = (lambda r=resharder, m=moving, release=release: (
                                   r.to_generation(release_training=release), m.move(experts) if m else None),
                               lambda r=resharder, keep=keep: r.to_training(offload=keep))
        else:
            holder = {}
            runners[method] = (lambda b={**BASELINES, "pieces": move_dense}[method], h=holder: h.setdefault("w", b(weights, rank, params, transport)),
                               lambda h=holder: h.clear())
    # The plain all-gather of one generation shard over the same micro-DP communicator, for scale.
    reference = None
    if len(group_ranks) > 1:
        # Shards of different pipeline stages differ a little in size; time equal parts of the largest.
        largest = torch.tensor([sum(t.numel() for t in params.values())], device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        shard_elems = int(largest.item())
        own = torch.randn(shard_elems, device=device).to(dtype)
        out = torch.empty(shard_elems * len(group_ranks), dtype=dtype, device=device)
        key = keys[group_ranks]
        reference = lambda: transport.all_gather_into(out, own, key)  # noqa: E731
        reference()
    received = {}
    for method, (run, back) in runners.items():
        run()  # warm-up: groups, allocations
        back()
        transport.bytes_received = 0
        run()
        received[method] = transport.bytes_received
        back()
    # Methods and the reference take turns in every repeat, so that the machine's drift hits all alike.
    latencies = {method: [] for method in runners}
    plain = []
    for _ in range(args.repeats):
        for method, (run, back) in runners.items():
            latencies[method].append(timed(run, 1)[0])
            back()
        if reference:
            plain.append(timed(reference, 1)[0])
    rows = []
    for method, (run, back) in runners.items():
        gc.collect()
        base = reset_peak_memory()
        run()
        extra = peak_memory() - base
        held = current_memory() - base
        back_s, _ = timed(back, 1)
        stats = torch.tensor([received[method], extra, held], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(stats) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, stats)
        rows.append({
            "method": method, "latency_s": statistics.median(latencies[method]), "return_s": back_s,
            "bytes_received_max": int(max(g[0].item() for g in gathered)),
            "bytes_received_mean": sum(g[0].item() for g in gathered) / len(gathered),
            "peak_extra_bytes_max": int(max(g[1].item() for g in gathered)),
            "held_extra_bytes_max": int(max(g[2].item() for g in gathered)),
        })
    link = {"allgather_s": statistics.median(plain), "bytes": element * shard_elems * (len(group_ranks) - 1)} \
        if reference else None
    if rank == 0:
        M = model_bytes(spec, element)
        bound = (plan.micro_dp_size - 1) * M / (train.tp * train.pp) if plan.kind == "gather" else 0
        if experts is not None:  # the dense part's exact bound, and the experts' own
            bound = max(weights.expected_bytes(r, element) + weights.experts.bound(r, element)
                        for r in range(train.world_size))
        Path(args.inner).write_text(json.dumps({
            "model": args.model, "pair": args.pair, "dtype": args.dtype, "model_bytes": M,
            "micro_dp_size": plan.micro_dp_size, "kind": plan.kind,
            "lower_bound_bytes": bound,
            "expert_bound_bytes": max(weights.experts.bound(r, element) for r in range(train.world_size))
            if experts is not None else None,
            "methods": rows, "plain_allgather": link, "schedule": schedule,
            "profile": profile.__dict__ if profile else None,
        }))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--pairs", nargs="+", default=PAIRS,
                        help="TxPxD-TGxPG pairs, or 'all-legal': every legal pair of --world ranks")
    parser.add_argument("--world", type=int, default=8, help="ranks for --pairs all-legal")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bucket-mb", type=int, default=0, help="fixed bucket size; 0: sized from the link")
    parser.add_argument("--measure-link", action="store_true",
                        help="measure the micro-DP group's latency and bandwidth first and size buckets from them")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + OPTIONAL_METHODS,
                        help="the baselines rebuild the whole model on every rank: drop them for models that will not fit")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--pair", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        return inner(args)

    results = []
    for model in args.models:
        pairs = all_legal_pairs(spec_of(model), args.world) if args.pairs == ["all-legal"] else args.pairs
        for pair in pairs:
            train, _ = parse_pair(pair)
            for dtype in args.dtypes:
                # A fixed mmap threshold makes freed tensors leave the resident set at once,
                # so peak RSS measures what each method really holds.
                results.append(run_torchrun_job(
                    __file__, train.world_size,
                    ["--model", model, "--pair", pair, "--dtype", dtype, "--repeats", str(args.repeats),
                     "--bucket-mb", str(args.bucket_mb), "--methods", *args.methods,
                     *(["--measure-link"] if args.measure_link else [])],
                    f"{model} {pair} {dtype}", env={"MALLOC_MMAP_THRESHOLD_": "65536"},
                ))
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def print_table(results: list[dict]) -> None:
    mib = 2**20
    header = (f"{'model':10} {'pair':18} {'dtype':5} {'method':17} {'latency_ms':>10} {'vs gather':>9} {'recv MiB':>9} "
              f"{'bound MiB':>9} {'peak extra MiB':>14} {'held MiB':>8} {'return_ms':>9}")
    print(header)
    print("-" * len(header))
    for r in results:
        link = r["plain_allgather"]
        for m in r["methods"]:
            ratio = f"{m['latency_s'] / link['allgather_s']:8.2f}x" if link else f"{'-':>9}"
            print(f"{r['model']:10} {r['pair']:18} {r['dtype']:5} {m['method']:17} {1e3 * m['latency_s']:10.1f} "
                  f"{ratio} {m['bytes_received_max'] / mib:9.1f} "
                  f"{r['lower_bound_bytes'] / mib:9.1f} {m['peak_extra_bytes_max'] / mib:14.1f} "
                  f"{m['held_extra_bytes_max'] / mib:8.1f} {1e3 * m['return_s']:9.2f}")
        if link:
            units = r["schedule"]["units"] if r["schedule"] else []
            summary = ", ".join(f"{units.count(n)} {n}" for n in dict.fromkeys(units))
            print(f"{'':10} {'':18} {'':5} {'(all-gather)':17} {1e3 * link['allgather_s']:10.1f} {'1.00x':>9} "
                  f"{link['bytes'] / mib:9.1f}  plain, same communicator; schedule: {summary}")
    print("(latency: median of repeats, slowest rank; MiB received, peak and held extra memory: largest rank)")


if __name__ == "__main__":
    main()
