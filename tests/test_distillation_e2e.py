"""On-policy distillation through the real CLI: the demo's SFT export teaches a fresh tiny model.

`hybridflow sft --config examples/sft_tiny.yaml` (the demo's first half, on one process) makes the teacher; then
`hybridflow train --config examples/distillation/opd_tiny.yaml` trains a random `builtin:tiny-arithmetic` student
for 10 steps with the teacher's per-token reverse KL as its only signal. Its mean reverse KL to the teacher falls
by at least 30 % and its greedy exact-answer accuracy rises (from none: a random model answers nothing). A teacher
whose tokenizer is not the student's is refused before any process starts.
"""

import shutil

import pytest

from test_train_cli import hybridflow, read_metrics

OPD = ["--config", "examples/distillation/opd_tiny.yaml", "trainer.logger=[jsonl]", "trainer.plots=false",
       "trainer.export_hf=false", "trainer.save_every=0"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The demo's SFT export (its data, steps and optimizer; one process instead of four)."""
    run_dir = tmp_path_factory.mktemp("sft")
    proc = hybridflow("sft", "--config", "examples/sft_tiny.yaml", f"trainer.run_dir={run_dir}", "trainer.nproc=1",
                      "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1", "trainer.logger=[jsonl]",
                      "trainer.plots=false", "trainer.save_every=0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return run_dir / "hf_actor"


def test_the_demos_sft_export_teaches_a_fresh_model(tmp_path, teacher):
    proc = hybridflow("train", *OPD, f"teacher.model_path={teacher}", f"trainer.run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert proc.ending_s < 30, f"the job ended {proc.ending_s:.1f} s after its last line"  # the teacher's group too
    steps = read_metrics(tmp_path)
    assert [m["step"] for m in steps] == list(range(11))  # step 0: greedy validation before the first update
    reverse_kl = [m["actor/opd/reverse_kl"] for m in steps[1:]]
    first, last = sum(reverse_kl[:2]) / 2, sum(reverse_kl[-2:]) / 2
    assert last <= 0.7 * first, reverse_kl  # falls by at least 30 % (two steps' means: sampling noise)
    accuracy = [m["val/reward/mean"] for m in steps if "val/reward/mean" in m]
    assert len(accuracy) == 3 and accuracy[-1] > accuracy[0], accuracy
    # the teacher's forward is a phase of its own on the default pool, timed like the others
    assert all(m["timing_s/teacher"] > 0 and "timing_s/phase/default/teacher/start" in m for m in steps[1:])


def test_a_teacher_with_another_tokenizer_is_refused_before_any_process(tmp_path, teacher):
    from controller.models.char_tokenizer import save_char_tokenizer

    other = tmp_path / "other_tokenizer"
    shutil.copytree(teacher, other)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (other / name).unlink(missing_ok=True)
    save_char_tokenizer(other, 300)
    proc = hybridflow("train", *OPD, f"teacher.model_path={other}", f"trainer.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "the teacher's tokenizer (" in proc.stderr and f"of {other}, 300 tokens) is not the student's" in proc.stderr
    assert "they first differ at token id" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
