"""The one weight-sync interface, both ways, in real gloo processes: a colocated sync (the actor's hybrid bridge
reshards in place) and a cross-pool sync (the actor's pool sends, the rollout's pool receives) each bring the
generation shard into a generator through ``WeightSync.update`` / ``done``. The shards must equal the same
slices read straight from the HF checkpoint, each rank must receive its bound, and both must report the same
weight-update metrics. Generators that copy and that borrow the weights are both driven. A LoRA actor's
cross-pool sync: the base once, then the adapters, merged on the rollout's side as PEFT merges them."""

import pytest
import torch

from dist_utils import run_cases_in_processes
from peft_reference import peft_with_random_b
from test_resharder import shard_from_checkpoint
from tiny_models import make_llama, projection_shapes

COMMON = {"timing_s/weight_update", "weight_update/bytes_received", "timing_s/weight_sync", "weight_sync/bytes"}


class _Params:
    """The engine's module as the hybrid bridge reads it: named parameters."""

    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())

    def parameters(self):
        return iter(self.params.values())


class _Engine:
    """What the hybrid bridge reads of a megatron engine: the model, the layout, the parameters, the rank, and
    its LoRA section (None unless given; the adapters themselves: none)."""

    def __init__(self, spec, layout, params, rank, lora=None):
        from types import SimpleNamespace

        self.spec, self.layout, self._module, self.adapters, self.lora = spec, layout, _Params(params), {}, lora
        self.groups = SimpleNamespace(grid_rank=rank)

    def module(self):
        return self._module


def _recording_generator(borrows: bool):
    from workers.rollout.generator import GeneratorBase

    class Recording(GeneratorBase):
        """Keeps what it is given: a copy, or (borrowing) the tensors themselves."""

        borrows_weights = borrows

        def __init__(self):
            self.weights, self.released = None, 0

        def update_weights(self, weights):
            self.weights = dict(weights) if borrows else {k: v.clone() for k, v in weights.items()}
            copied = 0 if borrows else sum(v.numel() * v.element_size() for v in weights.values())
            return {"timing_s/weight_sync": 0.0, "weight_sync/bytes": copied}

        def generate(self, requests, sampling):
            raise NotImplementedError

        def release(self):
            self.released += 1

    return Recording()


def _streaming_generator(model: dict):
    """An engine with its own copy of the weights (``model``, made beforehand) that loads them bucket by bucket."""
    from workers.rollout.generator import GeneratorBase

    class Streaming(GeneratorBase):
        borrows_weights = False

        def __init__(self):
            self.model, self.buckets, self.released = model, [], 0

        def update_weights(self, weights):
            raise AssertionError("a bucket-loading engine is handed buckets")

        def update_weights_in_buckets(self, buckets):
            for bucket in buckets:
                self.buckets.append(sum(t.numel() * t.element_size() for t in bucket.values()))
                for name, tensor in bucket.items():
                    self.model[name].copy_(tensor)
            return {"timing_s/weight_sync": 0.0, "weight_sync/bytes": sum(self.buckets)}

        def generate(self, requests, sampling):
            raise NotImplementedError

    return Streaming()


def peak_bytes_allocated(fn):
    """``fn()``'s result and the most bytes of tensor memory it held at once beyond what existed before: every
    storage an operation makes while it runs (not a view, not an in-place result), counted until it is freed,
    on whatever thread (a received message may be let go where the communication library completes it)."""
    import threading
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    held = {"live": 0, "peak": 0}
    lock = threading.Lock()

    def freed(nbytes):
        with lock:
            held["live"] -= nbytes

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                    storage = tensor.untyped_storage()
                    inputs.add(storage.data_ptr())
                    with lock:
                        held["live"] += storage.nbytes()
                        held["peak"] = max(held["peak"], held["live"])
                    weakref.finalize(storage, freed, storage.nbytes())
            return out

    with Allocations():
        result = fn()
    return result, held["peak"]


BUCKET = 1 << 20  # a few buckets of the tiny model's 6.8 MB shard


def _colocated(rank, world_size, path):
    from hybridengine.model.spec import ModelSpec
    from hybridengine.parallel.layout import ParallelLayout
    from hybridengine.reshard.plan import GenerationLayout
    from hybridengine.reshard.weight_plan import plan_weights
    from workers.megatron.hybrid_bridge import HybridBridge
    from workers.rollout.weight_sync import ColocatedSync, weight_sync_for

    spec, train, gen = ModelSpec.from_pretrained(path), ParallelLayout(2, 1, 2), GenerationLayout(1, 1)
    coord = train.coordinate(rank)
    params = shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank)
    before = {k: v.clone() for k, v in params.items()}
    bridge = HybridBridge(_Engine(spec, train, params, rank))
    plan = plan_weights(spec, train, gen)
    me = plan.layout.ranks[rank]
    expected = shard_from_checkpoint(path, spec, 1, 1, me.gen_tp_rank, me.gen_pp_rank)
    sync = weight_sync_for(bridge, None, spec=spec, gen=gen, gen_dp=plan.layout.gen_dp, rank=rank,
                           dtype=torch.float32, device="cpu")
    assert isinstance(sync, ColocatedSync) and not sync.pushed
    for borrows in (False, True):
        generator = _recording_generator(borrows)
        metrics = sync.update(generator)
        assert COMMON <= set(metrics), sorted(metrics)
        assert metrics["weight_update/bytes_received"] == plan.expected_bytes(rank, 4) > 0
        assert list(generator.weights) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(generator.weights[name], tensor), (rank, borrows, name)
        assert bool(bridge.weights) == borrows  # a copying engine lets the buffer go at once
        sync.done(generator)
        assert generator.released == 1 and bridge.weights == {}
        for name, tensor in before.items():  # the training shards are whole again
            assert torch.equal(params[name], tensor), (rank, name)


def _cross_pool(rank, world_size, path, port):
    from hybridengine.model.spec import ModelSpec
    from hybridengine.parallel.layout import ParallelLayout
    from hybridengine.reshard.plan import GenerationLayout
    from workers.megatron.hybrid_bridge import HybridBridge
    from workers.rollout.training_layout import TrainingLayout
    from workers.rollout.weight_sync import CrossPoolSync, weight_sync_for

    spec, train, gen = ModelSpec.from_pretrained(path), ParallelLayout(2, 1, 1), GenerationLayout(1, 1)
    if rank < 2:  # the actor's pool
        coord = train.coordinate(rank)
        params = shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank)
        bridge = HybridBridge(_Engine(spec, train, params, rank))
        bridge.connect_generation_pool("127.0.0.1", port, gen, 2, "auto", timeout_s=60, bucket_bytes=BUCKET)
        for _ in range(3):  # one push per generator below
            assert bridge.send_to_generation_pool()["weight_transfer/bytes_sent"] > 0
        bridge.cross_pool.close()
        return
    training = TrainingLayout(tensor_parallel=2, pipeline_parallel=1, data_parallel=1, precision="fp32")
    sync = weight_sync_for(None, training, spec=spec, gen=gen, gen_dp=2, rank=rank - 2, dtype=torch.float32,
                           device="cpu", bucket_bytes=BUCKET)
    assert isinstance(sync, CrossPoolSync) and sync.pushed
    sync.connect("127.0.0.1", port, "auto", timeout_s=60)
    expected = shard_from_checkpoint(path, spec, 1, 1, 0, 0)
    shard_bytes = sum(t.numel() * 4 for t in expected.values())
    for borrows in (False, True):
        generator = _recording_generator(borrows)
        metrics = sync.update(generator)
        assert COMMON <= set(metrics), sorted(metrics)
        assert metrics["weight_update/bytes_received"] == shard_bytes  # exactly the shard: the bound
        assert list(generator.weights) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(generator.weights[name], tensor), (rank, borrows, name)
        assert (sync.transfer.buffer is not None) == borrows  # a borrowing engine keeps the transfer's buffer
        assert sync.done(generator) == {} and generator.released == 0  # the weights stay until the next push
    # An engine that loads in buckets: each bucket goes in as it lands, so beyond its own model the generation
    # side holds one bucket (its messages and the area they are laid into), not a second copy of the shard.
    model = {name: torch.zeros_like(tensor) for name, tensor in expected.items()}
    generator = _streaming_generator(model)
    metrics, peak = peak_bytes_allocated(lambda: sync.update(generator))
    assert metrics["weight_update/bytes_received"] == metrics["weight_transfer/bound_bytes"] == shard_bytes
    assert len(generator.buckets) > 4 and max(generator.buckets) <= BUCKET // 2
    for name, tensor in expected.items():
        assert torch.equal(model[name], tensor), (rank, name)
    assert peak <= BUCKET < shard_bytes, (peak, shard_bytes)
    sync.close()


HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def _cross_pool_lora(rank, world_size, path, port, reference):
    """A LoRA actor's weights across pools (training TP2 on ranks 0-1, two generation replicas at TP1 on ranks
    2-3): the base crosses once, then each push carries the adapters whole (training rank 0 to every generation
    rank); each generation rank merges them into the base it kept, bit-equal to PEFT's merge, and a copying
    engine takes only the merged linears after the first push. (The actor's side sends as ``HybridBridge``
    does for a LoRA engine; the bridge's gathering of the adapters is the colocated path's, tested there.)"""
    from safetensors.torch import load_file

    from hybridengine.model.spec import ModelSpec
    from hybridengine.parallel.layout import ParallelLayout
    from hybridengine.reshard.plan import GenerationLayout
    from hybridengine.reshard.adapter_group import AdapterGroup
    from workers.megatron.hybrid_bridge import HybridBridge
    from workers.rollout.weight_sync import weight_sync_for
    from workers.megatron.lora import LoRAConfig
    from workers.rollout.training_layout import TrainingLayout

    ref = torch.load(reference, weights_only=False)
    spec, train, gen = ModelSpec.from_pretrained(path), ParallelLayout(2, 1, 1), GenerationLayout(1, 1)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    group = AdapterGroup(spec, train, 4, targets, 2, gathered=True)
    layout = [(key.layer, key.linear, key.part) for key in group.keys if key.side == "A"]
    whole_bytes = spec.num_layers * sum(4 * (fan_in + fan_out) for fan_in, fan_out in projection_shapes(spec).values()) * 4
    adapted = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
    if rank < 2:
        coord = train.coordinate(rank)
        params = shard_from_checkpoint(path, spec, train.tp, train.pp, coord.tp_rank, coord.pp_rank)
        lora = LoRAConfig(rank=4, alpha=8.0, target_modules=tuple(targets))
        bridge = HybridBridge(_Engine(spec, train, params, rank, lora))
        bridge.connect_generation_pool("127.0.0.1", port, gen, 2, "auto", timeout_s=60)
        saved = load_file(f"{ref['adapter_dir']}/adapter_model.safetensors")
        prefix = "base_model.model.model.layers"
        adapters = {key: (saved[f"{prefix}.{key[0]}.{HF_MODULES[key[2]]}.lora_A.weight"],
                          saved[f"{prefix}.{key[0]}.{HF_MODULES[key[2]]}.lora_B.weight"]) for key in layout}
        transfer = bridge.cross_pool
        transfer.send(rank, params)  # the frozen base, once
        for _ in range(2):
            before = transfer.bytes_sent
            transfer.send_adapters(rank, adapters)
            assert transfer.bytes_sent - before == (2 * whole_bytes if rank == 0 else 0)  # to each generation rank
        transfer.close()
        return
    training = TrainingLayout(tensor_parallel=2, pipeline_parallel=1, data_parallel=1, precision="fp32")
    sync = weight_sync_for(None, training, spec=spec, gen=gen, gen_dp=2, rank=rank - 2, dtype=torch.float32,
                           device="cpu", lora=LoRAConfig(rank=4, alpha=8.0, target_modules=tuple(targets)))
    sync.connect("127.0.0.1", port, "auto", timeout_s=60)
    generator = _recording_generator(False)
    generator.accepts_partial_weights = True
    first = sync.update(generator)
    base = shard_from_checkpoint(path, spec, 1, 1, 0, 0)
    assert list(generator.weights) == list(base)
    merged = [name for name in base if name.endswith(adapted)]
    assert len(merged) == 4 * spec.num_layers
    for name, tensor in generator.weights.items():
        assert torch.equal(tensor, ref["merged"][name]), name  # PEFT's merge where adapted, else the base
    second = sync.update(generator)
    assert second["weight_update/bytes_received"] == whole_bytes < first["weight_update/bytes_received"]
    assert sorted(generator.weights) == sorted(merged)  # the merged linears alone
    for name in merged:
        assert torch.equal(generator.weights[name], ref["merged"][name]), name
    sync.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("weight_sync") / "llama", heads=8, kv_heads=4)


def _peft_reference(path, out):
    """PEFT's adapters (rank 4, every linear, random B) saved as an adapter directory, and its merge in
    megatron's names at TP1 (what a generation rank at TP1 holds)."""
    from transformers import AutoModelForCausalLM

    from hybridengine.model.spec import ModelSpec

    peft = peft_with_random_b(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), 4, 8.0)
    peft.save_pretrained(str(out / "adapter"))
    merged_dir = out / "merged"
    merged_model = peft.merge_and_unload()
    merged_model.save_pretrained(str(merged_dir))
    (merged_dir / "config.json").write_text((path / "config.json").read_text())
    spec = ModelSpec.from_pretrained(merged_dir)
    torch.save({"adapter_dir": str(out / "adapter"), "merged": shard_from_checkpoint(merged_dir, spec, 1, 1, 0, 0)},
               out / "peft.pt")
    return out / "peft.pt"


def test_colocated_and_cross_pool_syncs_go_through_one_interface(llama, tmp_path):
    import torch.distributed as dist

    store, lora_store = (dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2))
    reference = _peft_reference(llama, tmp_path)
    outcomes = run_cases_in_processes(_sync_case, 4, {"colocated": ("colocated", str(llama), store.port),
                                                      "cross_pool": ("cross_pool", str(llama), store.port),
                                                      "cross_pool_lora": ("lora", str(llama), lora_store.port,
                                                                          reference)})
    assert outcomes == {"colocated": None, "cross_pool": None, "cross_pool_lora": None}, outcomes


def _sync_case(rank, world_size, which, path, port, reference=None):
    if which == "colocated":
        _colocated(rank, world_size, path)
    elif which == "lora":
        _cross_pool_lora(rank, world_size, path, port, str(reference))
    else:
        _cross_pool(rank, world_size, path, port)
