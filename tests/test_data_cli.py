"""`hybridflow data` writes files that load back, and `hybridflow train` checks data and rewards before any process.

The train runs here never launch: torchrun is replaced by a recorder, so a
refusal shows as exit code 2 with its message and no launch, and an accepted
config as the launch it would have made.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from chat_tokenizer import make_chat_model
from conftest import ROOT

import controller.cli as cli
from controller.data import load_prompt_files
from controller.data.writers import write_parquet

SMALL = ["trainer.nproc=1", "actor.engine.tensor_parallel=1", "actor.engine.pipeline_parallel=1",
         "actor.engine.micro_batch_size=2", "critic.engine.tensor_parallel=1", "critic.engine.pipeline_parallel=1",
         "critic.engine.micro_batch_size=2", "data.batch_size=4", "ppo.ppo_mini_batch_size=4",
         "critic_ppo.ppo_mini_batch_size=4", "rollout.max_prompt_length=40", "rollout.sampling.max_new_tokens=4"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture
def launches(monkeypatch):
    """Every launch `hybridflow train` would make, recorded instead of started."""
    calls = []
    monkeypatch.setattr(cli, "_torchrun", lambda nproc, argv: calls.append((nproc, argv)) or 0)
    monkeypatch.setattr("controller.jobs.train_job.run_training", lambda *args: pytest.fail("run_training was called"))
    return calls


def write_rows(path, rows):
    return str(write_parquet(rows, path))


def train(tmp_path, model, *overrides):
    start = time.perf_counter()
    code = cli.main(["train", "--config", str(ROOT / "examples" / "ppo_tiny.yaml"), f"model_path={model}",
                     f"trainer.run_dir={tmp_path / 'run'}", *SMALL, "reward.fn=auto", *overrides])
    return code, time.perf_counter() - start


def refused(tmp_path, model, path, launches, capsys, *overrides):
    """Train on the prompt file ``path``: the run must be refused (exit code 2, no launch); returns (stderr, seconds)."""
    code, seconds = train(tmp_path, model, "data.task=files", f"data.train_files={path}", *overrides)
    err = capsys.readouterr().err
    assert (code, launches) == (2, []), overrides
    return err, seconds


def test_data_arithmetic_writes_chat_files_that_load_back(tmp_path, capsys):
    out = tmp_path / "arith"
    assert cli.main(["data", "arithmetic", "--out", str(out), "--train-size", "12", "--val-size", "3", "--seed", "5",
                     "--max-operand", "20", "--operators", "+*", "--instruction", "Compute {a} {op} {b}."]) == 0
    assert capsys.readouterr().out.split() == [str(out / "train.parquet"), str(out / "val.parquet")]
    train, val = load_prompt_files(out / "train.parquet"), load_prompt_files(out / "val.parquet")
    assert (len(train), len(val)) == (12, 3)
    assert set(train.data_sources) == {"arithmetic"}
    assert train.extra_infos[3] == {"split": "train", "index": 3} and val.extra_infos[0]["split"] == "val"
    for messages, answer in zip(train.prompts, train.answers):
        (message,) = messages
        assert message["role"] == "user"
        _, a, op, b = message["content"].rstrip(".").split(" ")
        assert op in "+*" and 0 <= int(a) <= 20 and 0 <= int(b) <= 20
        assert answer == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    assert cli.main(["data", "arithmetic", "--out", str(out), "--operators", "+/"]) == 2
    assert "operators '+/': each must be one of '+-*'" in capsys.readouterr().err


def test_data_gsm8k_converts_to_verls_schema(tmp_path, capsys):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "What is 1,000 + 234?", "answer": "1,000 + 234 = 1,234\n#### 1,234"},
    ]))
    assert cli.main(["data", "gsm8k", "--input", str(source), "--out", str(tmp_path / "out"), "--split", "test"]) == 0
    written = tmp_path / "out" / "test.parquet"
    assert capsys.readouterr().out.split() == [str(written)]
    data = load_prompt_files(written)
    assert data.answers == ("7", "1234") and data.data_sources == ("openai/gsm8k",) * 2
    assert data.prompts[0] == [{"role": "user", "content": 'Tom has 3 apples and buys 4. How many? '
                                                           'Let\'s think step by step and output the final answer after "####".'}]
    assert data.extra_infos[1] == {"split": "test", "index": 1, "answer": "1,000 + 234 = 1,234\n#### 1,234",
                                   "question": "What is 1,000 + 234?"}
    assert cli.main(["data", "gsm8k", "--input", str(source), "--out", str(tmp_path / "o2"), "--instruction", "Go."]) == 0
    assert load_prompt_files(tmp_path / "o2" / "train.parquet").prompts[0][0]["content"].endswith("How many? Go.")
    source.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    assert cli.main(["data", "gsm8k", "--input", str(source), "--out", str(tmp_path / "o3")]) == 2
    assert "row 0: GSM8K answer has no '#### <number>' line" in capsys.readouterr().err


def test_overlong_prompts_are_refused_before_any_process(tmp_path, chat_model, launches, capsys):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "data_source": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(6)]
    rows[2]["prompt"][0]["content"] = "Please add these two numbers carefully: 2 + 1?"
    path = write_rows(tmp_path / "train.parquet", rows)
    err, seconds = refused(tmp_path, chat_model, path, launches, capsys)
    assert "1 of 6 training prompts are longer than rollout.max_prompt_length=40 tokens: row 2 (69 tokens" in err
    assert "Set data.filter_overlong_prompts=true" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert seconds < 30, seconds  # loading and tokenizing, no start-up
    # The Ray launcher starts its workers from this process: the same refusal comes before it.
    err, _ = refused(tmp_path, chat_model, path, launches, capsys, "trainer.launcher=ray")
    assert "1 of 6 training prompts are longer" in err
    # With the filter on the row is dropped, said so, and the job launches.
    code, _ = train(tmp_path, chat_model, "data.task=files", f"data.train_files=[{path}, {path}]",
                    "data.filter_overlong_prompts=true")
    assert code == 0 and len(launches) == 1
    assert "dropped 2 of 12 training prompts longer than rollout.max_prompt_length=40" in capsys.readouterr().err


def test_unknown_data_source_and_bad_reward_functions_are_refused_before_launch(tmp_path, chat_model, launches,
                                                                                 capsys, monkeypatch, request):
    rows = [{"prompt": "1+1=", "ground_truth": "2", "data_source": "my/riddles"}] * 4
    path = write_rows(tmp_path / "riddles.parquet", rows)
    err, _ = refused(tmp_path, chat_model, path, launches, capsys)
    assert "reward.fn is 'auto' (score by data_source), but no reward function is known for data_source 'my/riddles'" in err
    assert "known data sources: ['DigitalLearningGmbH/MATH-lighteval', " in err

    (tmp_path / "riddle_rewards.py").write_text(textwrap.dedent("""
        def score(prompt, response, ground_truth, extra, **kwargs):
            return float(response == ground_truth)

        def old_style(response, ground_truth):
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(lambda: sys.modules.pop("riddle_rewards", None))  # the checks below import it
    refusals = {
        "reward.fn=riddle_rewards:old_style": "reward.fn: 'riddle_rewards:old_style' has the signature (response, ground_truth)",
        "reward.fn=no_such_reward_module:score": "module 'no_such_reward_module' failed to import (ModuleNotFoundError",
        "algorithm.safe_rlhf_cost_fn=riddle_rewards:missing": "algorithm.safe_rlhf_cost_fn: reward function "
                                                              "'riddle_rewards:missing': module 'riddle_rewards' has no attribute",
    }
    for override, message in refusals.items():
        assert message in refused(tmp_path, chat_model, path, launches, capsys, override)[0], override
    # A function of the user's, or the old spelling of a single file, and the job launches.
    code, _ = train(tmp_path, chat_model, "data.task=jsonl", f"data.train_file={path}", "reward.fn=riddle_rewards:score")
    assert code == 0 and len(launches) == 1, capsys.readouterr().err


def test_refusal_through_the_real_command_starts_no_process(tmp_path, chat_model):
    """The same refusal as a user sees it: `python -m controller.cli train`, exit code 2, nothing launched."""
    path = write_rows(tmp_path / "train.parquet", [{"prompt": "x" * 50, "ground_truth": "0", "data_source": "arithmetic"}] * 4)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "controller.cli", "train", "--config", str(ROOT / "examples" / "ppo_tiny.yaml"),
                           f"model_path={chat_model}", f"trainer.run_dir={tmp_path / 'run'}", *SMALL, "data.task=files",
                           f"data.train_files={path}"], capture_output=True, text=True, timeout=120, env=env, cwd=str(ROOT))
    assert proc.returncode == 2, proc.stderr
    assert "4 of 4 training prompts are longer than rollout.max_prompt_length=40 tokens: row 0 (50 tokens" in proc.stderr
    assert "torch.distributed" not in proc.stderr and "Traceback" not in proc.stderr
    # run_training writes config.yaml first thing; the workers' metrics come after.
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
