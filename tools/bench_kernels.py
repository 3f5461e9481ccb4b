"""The csrc op library against its torch references: time and peak memory.

    python tools/bench_kernels.py                    # every op at the CPU shapes
    python tools/bench_kernels.py --ops log_prob gae --repeat 5 --json out.json
    python tools/bench_kernels.py --device gpu       # the GPU shapes, when a GPU is visible

For each case: median wall time over --repeat runs (after one warm-up), and
the peak memory the call adds above its inputs (CPU: resident set, with
glibc's mmap threshold fixed so freed tensors leave it; GPU: the caching
allocator's peak). Printed as ratios torch / fused; --json writes the rows.

Ops and their torch references:
  log_prob      fused log-prob + entropy (forward; forward + backward) vs log_softmax, gather, p * log p
  linear        fused output layer + log-prob (forward + backward) vs the logits GEMM then the fused
                log-prob op (the unfused engine path), and vs the GEMM then torch
  gae, returns  advantage scans vs the torch loop over the length
  reshard       vLLM QKV reorder and the fc1 [gate; up] join of two TP shards vs torch reshape/split/cat
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
if os.environ.get(MMAP_ENV) is None:  # allocations above 64 KiB come from mmap and leave RSS when freed
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, MMAP_ENV: "65536"})

import torch  # noqa: E402

from hybridengine.device import kernel_devices, reset_peak_memory, peak_memory, synchronize  # noqa: E402
from hybridengine.model.catalogue import FC1, lookup  # noqa: E402
from hybridengine.model.spec import ModelSpec  # noqa: E402
from hybridengine.ops.advantage_scan import (  # noqa: E402
    discounted_returns, discounted_returns_reference, gae_scan, gae_scan_reference,
)
from hybridengine.ops.library import kernels_on, kernels_reason  # noqa: E402
from hybridengine.ops.linear_log_prob import linear_log_prob_entropy  # noqa: E402
from hybridengine.ops.log_prob import log_prob_entropy, log_prob_entropy_reference  # noqa: E402
from hybridengine.model.geometry import join_into  # noqa: E402

MiB = 2**20


@dataclass
class Row:
    op: str
    case: str
    device: str
    fused: str
    reference: str
    fused_ms: float
    reference_ms: float
    speedup: float
    fused_peak_mib: float
    reference_peak_mib: float
    memory_ratio: float  # fused peak / reference peak


def measure(fn: Callable[[], object], device: torch.device, repeat: int) -> tuple[float, float]:
    """(median ms, peak MiB added above what was held before the call)."""
    fn()  # warm-up
    times, peaks = [], []
    for _ in range(repeat):
        gc.collect()
        synchronize(device)
        base = reset_peak_memory(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        peaks.append((peak_memory(device) - base) / MiB)
        del out
    return statistics.median(times), max(peaks)


def compare(op, case, device, fused_name, fused, ref_name, ref, repeat) -> Row:
    fused_ms, fused_peak = measure(fused, device, repeat)
    ref_ms, ref_peak = measure(ref, device, repeat)
    row = Row(op, case, str(device), fused_name, ref_name, fused_ms, ref_ms, ref_ms / fused_ms, fused_peak, ref_peak,
              fused_peak / ref_peak if ref_peak > 0 else float("nan"))
    print(f"{op:9} {case:34} {ref_name:>16} {ref_ms:10.1f} {fused_ms:10.1f} {row.speedup:7.2f}x "
          f"{ref_peak:10.0f} {fused_peak:10.0f} {row.memory_ratio:7.3f}", flush=True)
    return row


# ------------------------------------------------------------------- cases
def log_prob_cases(device, shapes, repeat):
    rows = []
    for n, v, dtype in shapes:
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(n, v, generator=g) * 3).to(dtype).to(device)
        target = torch.randint(0, v, (n,), generator=g).to(device)
        case = f"N={n} V={v} {str(dtype).removeprefix('torch.')}"

        def forward(f):
            def run():
                with torch.no_grad():
                    return f(logits, target)
            return run

        def forward_backward(f):
            def run():
                x = logits.detach().requires_grad_()
                lp, ent = f(x, target)
                (lp.sum() + ent.sum()).backward()
                return x.grad
            return run

        rows.append(compare("log_prob", case + " fwd", device, "fused", forward(log_prob_entropy),
                            "torch", forward(log_prob_entropy_reference), repeat))
        rows.append(compare("log_prob", case + " fwd+bwd", device, "fused", forward_backward(log_prob_entropy),
                            "torch", forward_backward(log_prob_entropy_reference), repeat))
        del logits
    return rows


HEAVY_FLOP = 5e12  # a case whose GEMMs pass this is timed once after the warm-up


def linear_cases(device, shapes, repeat):
    rows = []
    for n, h, v, dtype in shapes:
        case_repeat = 1 if device.type == "cpu" and 2 * n * h * v * 3 > HEAVY_FLOP else repeat
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
        weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).to(device)
        target = torch.randint(0, v, (n,), generator=g).to(device)
        case = f"N={n} H={h} V={v} {str(dtype).removeprefix('torch.')}"

        def train_step(f):
            def run():
                hx, wx = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
                lp, ent = f(hx, wx)
                (lp.sum() + ent.sum()).backward()
                return hx.grad, wx.grad
            return run

        fused = train_step(lambda hx, wx: linear_log_prob_entropy(hx, wx, target))
        unfused = train_step(lambda hx, wx: log_prob_entropy(hx @ wx.t(), target))
        rows.append(compare("linear", case + " fwd+bwd", device, "fused", fused, "GEMM+fused", unfused, case_repeat))
        if n * v * 4 <= 4 * 2**30:  # the all-torch path holds several fp32 [N, V] tensors
            unfused_torch = train_step(lambda hx, wx: log_prob_entropy_reference(hx @ wx.t(), target))
            rows.append(compare("linear", case + " fwd+bwd", device, "fused", fused, "GEMM+torch", unfused_torch,
                                case_repeat))
        del hidden, weight
    return rows


def scan_cases(device, shapes, repeat):
    rows = []
    for b, t in shapes:
        g = torch.Generator().manual_seed(0)
        rewards, values = torch.randn(b, t, generator=g).to(device), torch.randn(b, t, generator=g).to(device)
        mask = (torch.rand(b, t, generator=g) > 0.1).float().to(device)
        case = f"B={b} T={t}"
        rows.append(compare("gae", case, device, "fused", lambda: gae_scan(rewards, values, mask, 1.0, 0.95),
                            "torch loop", lambda: gae_scan_reference(rewards, values, mask, 1.0, 0.95), repeat))
        rows.append(compare("returns", case, device, "fused", lambda: discounted_returns(rewards, mask, 0.99),
                            "torch loop", lambda: discounted_returns_reference(rewards, mask, 0.99), repeat))
    return rows


def _qkv_torch(tensor: torch.Tensor, spec: ModelSpec, tp: int) -> torch.Tensor:
    """The reorder as torch reshape / split / cat (what the op replaced)."""
    groups = spec.num_query_groups // tp
    per_group = spec.num_attention_heads // spec.num_query_groups
    d = spec.head_dim
    grouped = tensor.reshape(groups, (per_group + 2) * d, *tensor.shape[1:])
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return torch.cat([x.reshape(-1, *tensor.shape[1:]) for x in (q, k, v)])


def _fc1_torch(out: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor:
    """The fc1 join as torch chunk / cat / copy_ (what the op replaced)."""
    gates, ups = zip(*(s.chunk(2) for s in shards))
    out.copy_(torch.cat([*gates, *ups]))
    return out


def reshard_cases(device, shapes, repeat):
    rows = []
    for hidden, heads, groups, ffn, tp in shapes:
        spec = ModelSpec(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=hidden, ffn_hidden_size=ffn,
                         num_layers=1, num_attention_heads=heads, num_query_groups=groups,
                         head_dim=hidden // heads, norm_epsilon=1e-5, rope_theta=1e4, max_position_embeddings=4096,
                         tie_word_embeddings=False, qkv_bias=False)
        g = torch.Generator().manual_seed(0)
        qkv_rows = (heads + 2 * groups) * spec.head_dim // tp
        qkv = torch.randn(qkv_rows, hidden, generator=g).to(device)
        case = f"qkv [{qkv_rows}, {hidden}] tp={tp}"
        qkv_geometry = lookup("decoder.layers.0.self_attention.linear_qkv.weight", spec, 0, 1).geometry
        rows.append(compare("reshard", case, device, "copy_blocks", lambda: qkv_geometry.stacked(qkv, 0),
                            "torch cat", lambda: _qkv_torch(qkv, spec, tp), repeat))
        shards = [torch.randn(2 * ffn // tp, hidden, generator=g).to(device) for _ in range(2)]
        out = torch.empty(4 * ffn // tp, hidden, device=device)
        case = f"fc1 join 2x[{2 * ffn // tp}, {hidden}]"
        rows.append(compare("reshard", case, device, "copy_blocks", lambda: join_into(out, FC1, shards),
                            "torch cat", lambda: _fc1_torch(out, shards), repeat))
        del qkv, shards, out
    return rows


SHAPES = {
    # Sized for a 2-core, 24 GiB machine: the torch references hold several [N, V] fp32 tensors.
    "cpu": {
        "log_prob": [(8192, 32768, torch.float32), (8192, 32768, torch.bfloat16), (4096, 152064, torch.bfloat16)],
        # The last is the realistic token count; ~10 TFLOP a step on two cores, so it is timed once.
        "linear": [(2048, 1024, 32768, torch.float32), (2048, 1024, 152064, torch.float32),
                   (8192, 1024, 152064, torch.float32)],
        "scan": [(256, 4096)],
        "reshard": [(4096, 32, 8, 11008, 2)],
    },
    "gpu": {
        "log_prob": [(32768, 32768, torch.float32), (32768, 152064, torch.bfloat16), (8192, 152064, torch.float32)],
        "linear": [(16384, 4096, 152064, torch.bfloat16), (8192, 4096, 152064, torch.float32)],
        "scan": [(1024, 8192)],
        "reshard": [(8192, 64, 8, 28672, 4)],
    },
}
CASES = {"log_prob": log_prob_cases, "linear": linear_cases, "gae": scan_cases, "reshard": reshard_cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    devices = kernel_devices()
    device = devices[0] if args.device == "cpu" else (devices[1] if len(devices) > 1 else None)
    if device is None:
        sys.exit("--device gpu: no GPU is visible")
    if not kernels_on(device):
        sys.exit(f"the op library does not cover {device}: {kernels_reason()}")
    torch.manual_seed(0)
    print(f"device {device}, torch threads {torch.get_num_threads()}; ms = median of {args.repeat}; "
          "peak = MiB added above the inputs")
    print(f"{'op':9} {'case':34} {'reference':>16} {'torch ms':>10} {'fused ms':>10} {'speedup':>8} "
          f"{'torch MiB':>10} {'fused MiB':>10} {'mem f/t':>7}")
    shapes = SHAPES[args.device]
    rows = []
    for op in args.ops:
        key = "scan" if op == "gae" else op
        rows += CASES[op](device, shapes[key], args.repeat)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
