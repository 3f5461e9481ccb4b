"""A generative judge through the real CLI: GRPO rewarded by the judge alone, the judge on a Ray pool of its own,
one step off (the rollout on a pool of its own generates and has step k+1 judged while step k trains; the sync
step calls the same scoring).

The judge is the built-in tiny chat model (random weights, a chat template) generating greedily on vLLM in fp32;
its template and parser are a test module's functions, given in the config (`tests/judge_functions.py`). Every
score the run trained on (its rollout dump) equals what the same judge gives in a plain transformers loop on the
same samples: the same user turn through the judge's chat template, greedy `generate`, the same parser, the
default score where the parser reads nothing. The template sleeps past `reward.judge.timeout_s` on questions
that start with an odd digit: those samples score the default and are counted, and both steps go on. Unreadable verdicts are
counted as the loop counts them.
"""

import json

import pytest

from conftest import TESTS
from judge_functions import first_digit, is_slow
from test_train_cli import hybridflow, read_metrics


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from controller.models.builtin import resolve_model_path

    where = tmp_path_factory.mktemp("models")
    return {name: resolve_model_path(f"builtin:{name}", where) for name in ("tiny-arithmetic", "tiny-chat")}


def judged_by_transformers(judge_path: str, rows: list[dict], max_new_tokens: int) -> list[tuple[float, bool, bool]]:
    """(score, timed out, unreadable) of each dumped sample, as a plain transformers loop scores it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(judge_path)
    model = AutoModelForCausalLM.from_pretrained(judge_path, dtype=torch.float32).eval()
    out = []
    for row in rows:
        if is_slow(row["prompt"]):
            out.append((0.0, True, False))
            continue
        text = f"Q: {row['prompt']} A: {row['response']} Verdict:"  # slow_on_odd's user turn, without the wait
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        verdict = tokenizer.decode(generated[0, len(ids):], skip_special_tokens=True)
        score = first_digit(verdict, row)
        out.append((0.0 if score is None else score, False, score is None))
    return out


def test_grpo_rewarded_by_a_judge_alone_on_its_own_pool(tmp_path, models):
    dump = tmp_path / "samples"
    proc = hybridflow(
        "train", "--config", "examples/ppo_tiny.yaml", f"model_path={models['tiny-arithmetic']}",
        "algorithm.name=grpo", "rollout.sampling.n=2", "trainer.launcher=ray", "trainer.nproc=1",
        "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1", "actor.engine.precision=fp32",
        "actor.engine.micro_batch_size=4", "data.batch_size=4", "ppo.ppo_mini_batch_size=8", "ppo.ppo_epochs=1",
        "rollout.engine=vllm", "rollout.sampling.max_new_tokens=4", "trainer.total_steps=2", "trainer.val_every=0",
        "trainer.logger=[jsonl]", "trainer.export_hf=false", "trainer.plots=false", "trainer.save_every=0",
        "data.train_size=64", "data.val_size=8", f"trainer.run_dir={tmp_path / 'run'}",
        f"trainer.rollout_data_dir={dump}", "trainer.mode=one_step_off", "trainer.placement={judge: 1, rollout: 1}",
        "reward.fn=null", f"reward.judge.model_path={models['tiny-chat']}", "reward.judge.precision=fp32",
        "reward.judge.template=judge_functions:slow_on_odd", "reward.judge.parser=judge_functions:first_digit",
        "reward.judge.max_prompt_length=128", "reward.judge.max_new_tokens=12", "reward.judge.timeout_s=1",
        pythonpath=(str(TESTS),))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    # every process ends with its work: the judge's pool, and the template calls left running past their deadline
    assert proc.ending_s < 30, f"the job ended {proc.ending_s:.1f} s after its last line"
    steps = read_metrics(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2]  # the step went on past the timed-out calls
    compared = 0
    for step in steps:
        rows = [json.loads(line) for line in (dump / f"{step['step']}.jsonl").read_text().splitlines()]
        expected = judged_by_transformers(models["tiny-chat"], rows, 12)
        assert [row["score"] for row in rows] == pytest.approx([e[0] for e in expected], abs=1e-6)
        assert step["reward/judge/timeouts"] == sum(e[1] for e in expected)
        assert step["reward/judge/parse_failures"] == sum(e[2] for e in expected)
        assert step["reward/judge/samples"] == len(rows) == 8 and step["reward/judge/latency_s"] > 0
        compared += sum(not e[1] and not e[2] for e in expected)
        assert step["timing_s/phase/judge/reward/end"] > step["timing_s/phase/judge/reward/start"]  # its own pool
    assert compared > 0  # some verdicts were read and scored (not every sample the default)
    assert sum(m["reward/judge/timeouts"] for m in steps) > 0
