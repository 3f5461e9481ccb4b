"""The planner's model state held to the engine's own tensors (the parity programs' ``state_bytes``)."""

from controller.planner.memory import stage_state
from hybridengine.model.spec import ModelSpec
from hybridengine.parallel.layout import ParallelLayout


def assert_state_predicted(model_dir, measured: list[dict], tp: int, pp: int, precision: str, trains: bool,
                           distributed_optimizer: bool = False, vocab_multiple: int = 128) -> None:
    """Every rank's weights, gradients and optimizer bytes equal the planner's prediction, to the byte."""
    spec = ModelSpec.from_pretrained(model_dir).with_padded_vocab(vocab_multiple, tp)
    layout = ParallelLayout.for_world(len(measured), tp, pp)
    for rank, got in enumerate(measured):
        at = layout.coordinate(rank)
        want = stage_state(spec, tp, pp, at.pp_rank, layout.dp, at.dp_rank, precision, trains, distributed_optimizer)
        expected = {"weights": want.weights, "gradients": want.gradients, "optimizer": want.optimizer}
        assert got == expected, (f"rank {rank} ({layout}, {precision}, distributed optimizer {distributed_optimizer}): "
                                 f"measured {got}, predicted {expected}")
    assert measured[0]["weights"] > 0 and (not trains or measured[0]["optimizer"] > 0)
