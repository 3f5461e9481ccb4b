"""Sessions and their training samples with no process: a chat request that extends what the session was served
continues its ids (nothing the model said is tokenized again), one that rewrites history starts a new sample,
and a session's samples are exactly the served ids with the engine's tokens masked in."""

import pytest

from controller.serving.messages import assistant_message, normalized, template_messages, tool_call_json
from controller.serving.openai_protocol import RequestError, sampling_fields
from controller.serving.session import ServedTurn, Session
from controller.serving.trajectories import session_samples


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from transformers import AutoTokenizer

    from controller.models.builtin import resolve_model_path
    from workers.rollout.agent.trajectory import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-chat", tmp_path_factory.mktemp("m")))
    return ChatFormat(tokenizer, end_of_turn_id=tokenizer.eos_token_id)


def _served(session: Session, messages, chat, completion, finish="stop", reply_text="x"):
    prompt, parent = session.chat_prompt(template_messages(messages), chat)
    reply = assistant_message(reply_text, [])
    index = session.record(ServedTurn(prompt, completion, [-0.5] * len(completion), [3] * len(completion), finish,
                                      parent, template_messages(messages), reply))
    return prompt, parent, index, reply


def test_a_chat_that_extends_the_session_continues_its_ids_and_a_rewrite_starts_a_new_sample(chat):
    session = Session("s", seed=10)
    first = [{"role": "user", "content": "2+3="}]
    prompt0, parent0, turn0, reply0 = _served(session, first, chat, [50, 51, chat.end_of_turn_id])
    assert parent0 is None and prompt0 == chat.prompt_ids(first)
    # The client sends the reply back as the openai client serializes it, with fields a template ignores.
    echoed = {**reply0, "refusal": None, "annotations": None, "audio": None, "function_call": None}
    second = [*first, echoed, {"role": "user", "content": "and 4?"}]
    prompt1, parent1, turn1, _ = _served(session, second, chat, [60, 61], finish="length")
    observation = chat.observation_ids([{"role": "user", "content": "and 4?"}], closed=True)
    assert parent1 == turn0 and prompt1 == prompt0 + [50, 51, chat.end_of_turn_id] + observation
    # A turn that ended without its end-of-turn token (the token limit) gets it from the template's framing.
    third = [*second, assistant_message("x", []), {"role": "user", "content": "ok"}]
    prompt2, parent2, _, _ = _served(session, third, chat, [70], finish="length")
    assert parent2 == turn1
    assert prompt2 == prompt1 + [60, 61] + chat.observation_ids([{"role": "user", "content": "ok"}], closed=False)
    assert prompt2[len(prompt1) + 2] == chat.end_of_turn_id
    # History rewritten: rendered from scratch, a sample of its own.
    prompt3, parent3, _, _ = _served(session, [{"role": "user", "content": "2+3= (rephrased)"}], chat, [80, 81])
    assert parent3 is None and prompt3 == chat.prompt_ids([{"role": "user", "content": "2+3= (rephrased)"}])
    samples = session_samples(session.turns)
    assert len(samples) == 2
    whole, rewritten = samples
    assert whole.prompt_ids == prompt0 and whole.turns == 3
    assert whole.context_ids == prompt2 + [70]  # the last prompt and its completion: every id served, in order
    assert whole.response_mask == ([1] * 3 + [0] * len(observation) + [1] * 2
                                   + [0] * (len(prompt2) - len(prompt1) - 2) + [1])
    assert [lp for lp, m in zip(whole.log_probs, whole.response_mask) if m] == [-0.5] * 6
    assert all(lp == 0.0 for lp, m in zip(whole.log_probs, whole.response_mask) if not m)
    assert [v for v, m in zip(whole.versions, whole.response_mask) if m] == [3] * 6
    assert rewritten.prompt_ids == prompt3 and rewritten.response_ids == [80, 81] and rewritten.response_mask == [1, 1]
    assert [session.next_seed() for _ in range(2)] == [10, 11]


def test_tool_calls_compare_by_their_arguments_not_their_ids_or_spacing():
    call = tool_call_json("calculator", {"expression": "2*3"}, "call_a")
    echoed = {"id": "call_b", "type": "function", "function": {"name": "calculator", "arguments": '{ "expression":"2*3" }'}}
    assert normalized(assistant_message("", [call])) == normalized({"role": "assistant", "content": None,
                                                                    "tool_calls": [echoed]})
    other = {"id": "call_b", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*4"}'}}
    assert normalized(assistant_message("", [call])) != normalized({"role": "assistant", "tool_calls": [other]})
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert normalized(parts) == normalized({"role": "user", "content": "ab"})
    assert template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])[0]["tool_calls"][0] == {
        "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}
    with pytest.raises(ValueError, match="'role'"):
        normalized({"content": "no role"})


def test_a_branched_session_is_a_sample_per_branch_and_a_completion_continues_by_ids():
    session = Session("s")
    session.record(ServedTurn([1, 2], [3, 4], [-1.0, -1.0], [0, 0], "stop", None))
    assert session.completion_prompt([1, 2, 3, 4, 9]) == 0 and session.completion_prompt([1, 2, 3]) is None
    session.record(ServedTurn([1, 2, 3, 4, 9], [5], [-2.0], [1], "stop", 0))
    session.record(ServedTurn([1, 2, 3, 4, 8], [6], [-3.0], [1], "length", 0))  # a second continuation of turn 0
    first, second = session_samples(session.turns)
    assert first.context_ids == [1, 2, 3, 4, 9, 5] and first.response_mask == [1, 1, 0, 1]
    assert second.context_ids == [1, 2, 3, 4, 8, 6] and second.finish_reason == "length"
    assert second.versions == [0, 0, -1, 1]
    with pytest.raises(ValueError, match="does not start with"):
        session_samples([ServedTurn([1], [2], [0.0], [0], "stop", None), ServedTurn([7, 7], [3], [0.0], [0], "stop", 0)])


def test_sampling_fields_map_openai_names_and_refuse_what_is_not_served():
    fields, n = sampling_fields({"temperature": 0.7, "max_tokens": 5, "stop": "\n", "seed": 3, "n": 2}, 16)
    assert fields == {"temperature": 0.7, "max_new_tokens": 5, "stop": ["\n"], "seed": 3} and n == 2
    with pytest.raises(RequestError, match="max_tokens 20 is over this rollout's 16"):
        sampling_fields({"max_tokens": 20}, 16)
    with pytest.raises(RequestError, match="top_logprobs"):
        sampling_fields({"top_logprobs": 2}, 16)
    with pytest.raises(RequestError, match="n must be a positive integer"):
        sampling_fields({"n": 0}, 16)


def test_a_reply_with_tool_calls_comes_back_as_openai_tool_calls(chat):
    from controller.serving.server import RolloutServer
    from workers.rollout.sampling import SamplingConfig

    server = RolloutServer(chat.tokenizer, ["http://127.0.0.1:1"], SamplingConfig(), max_model_len=64,
                           api_key="k" * 32)  # not started
    text = 'Let me see.<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    ids = chat.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = {"token_ids": ids, "log_probs": [0.0] * len(ids), "versions": [0] * len(ids), "finish_reason": "stop"}
    choice = server._chat_choice(out, with_tools=True)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me see."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "12*7"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"
    plain = server._chat_choice(out, with_tools=False)  # no tools asked for: the text as it is
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": text}


def test_the_server_answers_only_its_job_and_names_each_cap(chat):
    """Every endpoint needs the job's key (401 without it, through the openai client and on a replica's /update);
    an unknown session is 404 and creates nothing; the caps on sessions (429) and choices (400) name their
    settings. Nothing here reaches an engine: each refusal comes first."""
    import json
    import urllib.error
    import urllib.request

    import openai

    from controller.serving.server import RolloutServer
    from workers.rollout.sampling import SamplingConfig
    from workers.rollout.serving import ReplicaServer
    from workers.rollout.serving.api_key import new_api_key

    key = new_api_key()
    replica = ReplicaServer(object(), key).start()  # its engine loop is never reached: the key is checked first
    server = RolloutServer(chat.tokenizer, ["http://127.0.0.1:1"], SamplingConfig(max_new_tokens=8), max_model_len=64,
                           api_key=key, max_sessions=2, max_n=4).start()
    try:
        def client(api_key=key, session=None):
            base = f"{server.url}/sessions/{session}/v1" if session else f"{server.url}/v1"
            return openai.OpenAI(base_url=base, api_key=api_key, max_retries=0, timeout=30)

        hello = [{"role": "user", "content": "hi"}]
        server.open_session("sample-0")
        with pytest.raises(openai.AuthenticationError, match="needs the job's API key"):
            client("wrong-key", "sample-0").chat.completions.create(model="policy", messages=hello)
        with pytest.raises(openai.AuthenticationError):
            client("wrong-key").models.list()
        bare = urllib.request.Request(f"{server.url}/v1/models")  # no Authorization header at all
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bare, timeout=30)
        assert refused.value.code == 401
        assert [m.id for m in client().models.list()] == ["policy"]
        # An unknown session: 404, and nothing is created.
        with pytest.raises(openai.NotFoundError, match="no open session 'guessed-1'"):
            client(session="guessed-1").chat.completions.create(model="policy", messages=hello)
        assert sorted(server.sessions.sessions) == ["sample-0"]
        # n past server_max_n: 400 naming it.
        with pytest.raises(openai.BadRequestError, match=r"n 5 is over this server's 4 choices a request "
                                                         r"\(rollout.server_max_n\)"):
            client(session="sample-0").chat.completions.create(model="policy", messages=hello, n=5)
        # With the key, on an open session, the request goes on to the replicas (none answers here: 502).
        with pytest.raises(openai.InternalServerError, match="could not be reached"):
            client(session="sample-0").chat.completions.create(model="policy", messages=hello)
        # A request naming no session is one of its own while it runs; past server_max_sessions it is 429.
        with pytest.raises(openai.InternalServerError):
            client().completions.create(model="policy", prompt="1+2=")
        assert sorted(server.sessions.sessions) == ["sample-0"]  # its session is gone with it
        server.open_session("sample-1")
        with pytest.raises(openai.RateLimitError, match=r"holds 2 sessions, its cap \(rollout.server_max_sessions=2\)"):
            client().completions.create(model="policy", prompt="1+2=")

        # A replica's control endpoints: refused without the key, taken with it.
        def update(headers):
            request = urllib.request.Request(f"{replica.address}/update", data=json.dumps({"policy": "pause"}).encode(),
                                             headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(request, timeout=30) as reply:
                    return reply.status, json.loads(reply.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            status, body = update(headers)
            assert status == 401 and "needs the job's API key" in body["error"]["message"]
        assert update({"Authorization": f"Bearer {key}"}) == (400, {"error": "this replica takes no weights while it "
                                                                              "serves"})
    finally:
        server.close()
        replica.close()
