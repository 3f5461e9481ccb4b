"""A user's agent that fails says why on the console, a step where every session failed says so instead of
diagnosing the NaN an update over no token would give, and the row an agent gets has verl's names too. Pure:
real sessions run against a stand-in server object (no engine), the reports against hand-made outcomes."""

import asyncio

import torch

from controller.rl.step_metrics import nothing_to_train
from controller.serving.agent_failures import failure_report
from controller.serving.session import SessionStore
from controller.serving.user_agents import SessionOutcome, agent_row, run_sessions
from workers.data_proto import DataProto


class Sessions:
    """What run_sessions uses of a RolloutServer: opening and taking sessions (no request reaches it here)."""

    url, api_key = "http://127.0.0.1:9", "k" * 32

    def __init__(self):
        self.store = SessionStore()

    def open_session(self, session_id, seed=None, **limits):
        return self.store.open(session_id, seed, **limits)

    def take_session(self, session_id):
        return self.store.pop(session_id)


async def reads_verls_prompt(client, row):
    return float(len(row["prompt"]) == 1 and row["reward_model"]["ground_truth"] == "7")


async def reads_a_missing_column(client, row):
    return row["question"]  # no such column: a KeyError, as verl-schema agents met before `prompt` was given


def rows():
    return [{"messages": [{"role": "user", "content": "3+4="}], "ground_truth": "7", "uid": "p0"}] * 2


def test_the_row_has_verls_names_and_a_raising_agent_keeps_its_traceback():
    row = agent_row(rows()[0])
    assert row["prompt"] == row["messages"] and row["reward_model"] == {"style": "rule", "ground_truth": "7"}
    assert agent_row({"messages": [], "prompt": "kept"})["prompt"] == "kept"  # a row's own column wins
    limits = {"max_prompt_length": None, "max_response_length": None}
    ok = asyncio.run(run_sessions(reads_verls_prompt, [agent_row(r) for r in rows()], Sessions(), [None, None], 2,
                                  5.0, limits))
    assert [(o.status, o.reward) for o in ok] == [("no_requests", None)] * 2  # it read both names; asked nothing
    failed = asyncio.run(run_sessions(reads_a_missing_column, rows(), Sessions(), [None, None], 2, 5.0, limits))
    assert [o.status for o in failed] == ["error", "error"] and failed[0].error == "KeyError: 'question'"
    assert "Traceback (most recent call last)" in failed[0].traceback
    assert 'return row["question"]' in failed[0].traceback  # the user's own line


def outcome(row, status, error=None, traceback=None):
    return SessionOutcome(f"step0-{row}", row, status, None, [], error, 0.1, traceback)


def test_the_first_exception_is_shown_with_its_traceback_and_the_counts():
    trace = 'Traceback (most recent call last):\n  File "agent.py", line 3, in agent\nKeyError: \'prompt\'\n'
    report = failure_report([outcome(0, "ok"), outcome(1, "timeout", "the agent did not return within 5 s"),
                             outcome(2, "error", "KeyError: 'prompt'", trace), outcome(3, "error", "ValueError: x", "t")])
    lines = report.splitlines()
    assert lines[0] == ("[hybridflow] agent: 3 of 4 sessions failed (error 2, timeout 1); each trains nothing. The "
                        "first, row 2 (session step0-2): KeyError: 'prompt'")
    assert lines[1:] == ["[hybridflow]     " + line for line in trace.rstrip().splitlines()]
    only_timeouts = failure_report([outcome(0, "timeout", "the agent did not return within 5 s")])
    assert only_timeouts.endswith("row 0 (session step0-0): the agent did not return within 5 s")
    assert failure_report([outcome(0, "ok")]) is None


def test_a_step_with_no_token_to_train_says_why():
    masked_out = DataProto({"response_mask": torch.zeros(4, 3)})
    some = DataProto({"response_mask": torch.tensor([[0.0, 1, 0], [0, 0, 0]])})
    assert nothing_to_train(3, some, {}) is None
    metrics = {"agent/sessions": 16.0, "agent/error": 16.0, "agent/timeout": 0.0}
    assert nothing_to_train(3, masked_out, metrics) == (
        "step 3: nothing to train on: every agent session failed (16 of 16: error 16; the first failure is above); "
        "the critic's and the actor's updates are skipped")
    assert nothing_to_train(1, masked_out, {}) == (
        "step 1: nothing to train on: every one of its 4 responses is masked out; the critic's and the actor's "
        "updates are skipped")
