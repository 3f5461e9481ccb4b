"""The planner's model state held to the engine's own tensors (the parity programs' ``state_bytes``)."""

from controller.planner.memory import ActivationShape, lora_state, stage_activation_bytes, stage_state
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout


def assert_state_predicted(model_dir, measured: list[dict], tp: int, pp: int, precision: str, trains: bool,
                           distributed_optimizer: bool = False, vocab_multiple: int = 128, ep: int = 1,
                           etp: int | None = None, lora_rank: int = 0, lora_targets: tuple[str, ...] = (),
                           train_vision: bool = False) -> None:
    """Every rank's weights, gradients and optimizer bytes equal the planner's prediction, to the byte (with
    ``lora_rank``: a role training LoRA adapters on ``lora_targets``; ``train_vision``: a vision-language model's
    tower trained too)."""
    spec = ModelSpec.from_pretrained(model_dir).with_padded_vocab(vocab_multiple, tp)
    layout = ParallelLayout.for_world(len(measured), tp, pp, ep, etp)
    for rank, got in enumerate(measured):
        at = layout.coordinate(rank)
        if lora_rank:
            want = lora_state(spec, tp, pp, at.pp_rank, layout.dp, at.dp_rank, precision, distributed_optimizer,
                              lora_rank, lora_targets)
        else:
            want = stage_state(spec, tp, pp, at.pp_rank, layout.dp, at.dp_rank, precision, trains,
                               distributed_optimizer, ep, etp, layout.expert_coordinate(rank).edp_rank, train_vision)
        expected = {"weights": want.weights, "gradients": want.gradients, "optimizer": want.optimizer}
        assert got == expected, (f"rank {rank} ({layout}, {precision}, distributed optimizer {distributed_optimizer}): "
                                 f"measured {got}, predicted {expected}")
    assert measured[0]["weights"] > 0 and (not trains or measured[0]["optimizer"] > 0)


def assert_activations_predicted(model_dir, measured: list[dict], tp: int, precision: str, tolerance: float = 0.05,
                                 vocab_multiple: int = 128, train_vision: bool = False, context_parallel: int = 1,
                                 packed: bool = False) -> None:
    """What autograd keeps for one micro-batch's forward (PP 1, each rank) within ``tolerance`` of the planner's
    activation model (CPU attention: the [heads, s, s] probabilities are kept, or with ``packed`` sequences and
    ``context_parallel`` the engine's own attention's; ``train_vision``: a vision-language model's images
    through its trained tower)."""
    spec = ModelSpec.from_pretrained(model_dir).with_padded_vocab(vocab_multiple, tp)
    for rank, got in enumerate(measured):
        shape = ActivationShape(got["rows"], got["seq_len"], precision, flash_attention=False,
                                vision_patches=got.get("image_patches", 0) if train_vision else 0,
                                context_parallel=context_parallel, packed=packed or context_parallel > 1)
        predicted = stage_activation_bytes(spec, tp, 1, 0, shape)
        ratio = predicted / got["bytes"]
        print(f"activations rank {rank}: measured {got['bytes']} predicted {predicted} ratio {ratio:.3f}")
        assert abs(ratio - 1) <= tolerance, (f"rank {rank}: predicted {predicted} bytes of activations, autograd keeps "
                                             f"{got['bytes']} ({ratio:.2f}x)")
