"""The agent layer's pure logic: tools, the ToolBox's timeouts and threads, the calculator, tool-call parsing."""

from __future__ import annotations

import json
import math
import operator
import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest

from workers.rollout.agent import (
    BAD_ARGUMENTS,
    MALFORMED,
    RAISED,
    TIMEOUT,
    TOOL_ERROR_KINDS,
    UNKNOWN_TOOL,
    Calculator,
    Tool,
    ToolBox,
    ToolCall,
    ToolOutcome,
    error_counts,
    evaluate,
    parse_tool_calls,
)

# -- tools used by the tests ------------------------------------------------------------------------------------------


class Echo(Tool):
    name = "echo"
    description = "Repeat a text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
                  "required": ["text"]}

    def call(self, text: str, times: int = 1) -> str:
        return text * times


class Sleeper(Tool):
    description = "Sleep, then answer."
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}

    def __init__(self, name: str = "sleeper", timeout_s: float = 5.0) -> None:
        self.name, self.timeout_s = name, timeout_s

    def call(self, seconds: float) -> str:
        time.sleep(seconds)
        return f"slept {seconds}"


class Blocker(Tool):
    """Hangs until the test releases it (so the threads it holds are freed at the end)."""

    name = "blocker"
    description = "Wait for an event."
    parameters = {"type": "object", "properties": {}}
    timeout_s = 0.2

    def __init__(self) -> None:
        self.release = threading.Event()

    def call(self) -> str:
        self.release.wait(30)
        return "released"


class Failing(Tool):
    name = "failing"
    description = "Always raises."
    parameters = {"type": "object", "properties": {"how": {"type": "string"}}}

    def call(self, how: str = "value") -> str:
        if how == "exit":
            sys.exit(3)
        if how == "number":
            return 42  # not a str
        raise KeyError("no such record")


class Loose(Tool):
    """A schema that allows any property, a call that takes only one: the signature check catches the rest."""

    name = "loose"
    description = "Takes x."
    parameters = {"type": "object"}

    def call(self, x: int = 0) -> str:
        return str(x)


# -- Tool and ToolBox construction ------------------------------------------------------------------------------------


def test_schema_is_the_openai_function_spec():
    spec = Calculator().schema()
    assert spec == {"type": "function", "function": {
        "name": "calculator", "description": Calculator.description, "parameters": Calculator.parameters}}
    with ToolBox([Calculator(), Echo()]) as box:
        assert [s["function"]["name"] for s in box.schemas()] == ["calculator", "echo"]
        assert box.names == ["calculator", "echo"] and "echo" in box and len(box) == 2
        assert isinstance(box["calculator"], Calculator)


class NoCall(Tool):
    name = "nocall"
    description = "Forgot call."


class BadSchema(Tool):
    name = "badschema"
    description = "A schema jsonschema refuses."
    parameters = {"type": "object", "properties": {"x": {"type": "nope"}}}

    def call(self, **arguments) -> str:
        return ""


def test_toolbox_refuses_bad_tools_with_every_problem_named():
    with pytest.raises(ValueError, match=r"duplicate tool names \['sleeper'\]"):
        ToolBox([Sleeper(), Sleeper()])
    with pytest.raises(ValueError) as error:
        ToolBox([Sleeper("bad name"), Sleeper("ok", timeout_s=0), NoCall(), BadSchema(), "calculator"])
    message = str(error.value)
    assert "name 'bad name' must be 1-64 characters" in message
    assert "tool 'ok': timeout_s must be a positive number of seconds, got 0" in message
    assert "tool 'nocall': NoCall does not implement call" in message
    assert "tool 'badschema': parameters is not a valid JSON schema" in message
    assert "'calculator' is not a Tool" in message
    with pytest.raises(ValueError, match="must be a JSON schema of an object"):
        ToolBox([type("Arr", (Echo,), {"name": "arr", "parameters": {"type": "array"}})()])
    with pytest.raises(ValueError, match="max_threads must be a positive integer, got 0"):
        ToolBox([Echo()], max_threads=0)


def test_outcome_checks_its_error_kind():
    with pytest.raises(ValueError, match="not one of"):
        ToolOutcome(None, "x", False, "oops")
    with pytest.raises(ValueError, match="ok=True needs error=None"):
        ToolOutcome(None, "x", True, TIMEOUT)
    assert ToolOutcome(ToolCall("echo", {}), "hi", True).message() == {"role": "tool", "content": "hi", "name": "echo"}


# -- ToolBox.run: every failure is an outcome -------------------------------------------------------------------------


def test_run_success_and_every_error_kind():
    with ToolBox([Calculator(), Echo(), Failing(), Loose()]) as box:
        ok = box.run(ToolCall("calculator", {"expression": "2*(3+4)"}))
        assert (ok.ok, ok.content, ok.error) == (True, "14", None) and ok.seconds >= 0
        assert box.run(ToolCall("echo", {"text": "ab", "times": 3})).content == "ababab"

        unknown = box.run(ToolCall("search", {"q": "x"}))
        assert unknown.error == UNKNOWN_TOOL and not unknown.ok
        assert unknown.content == ("error: unknown tool 'search'; "
                                   "the tools are ['calculator', 'echo', 'failing', 'loose']")

        missing = box.run(ToolCall("echo", {}))
        assert missing.error == BAD_ARGUMENTS and "'text' is a required property" in missing.content
        wrong_type = box.run(ToolCall("echo", {"text": "a", "times": "3"}))
        assert wrong_type.error == BAD_ARGUMENTS and "at 'times'" in wrong_type.content
        extra = box.run(ToolCall("calculator", {"expression": "1", "precision": 3}))
        assert extra.error == BAD_ARGUMENTS and "'precision' was unexpected" in extra.content
        not_a_dict = box.run(ToolCall("echo", ["a"]))
        assert not_a_dict.error == BAD_ARGUMENTS and "must be a JSON object" in not_a_dict.content
        signature = box.run(ToolCall("loose", {"y": 1}))
        assert signature.error == BAD_ARGUMENTS and "unexpected keyword argument 'y'" in signature.content
        assert box.run(ToolCall("loose", {"x": 5})).content == "5"

        raised = box.run(ToolCall("failing", {}))
        assert raised.error == RAISED
        assert raised.content == "error: tool 'failing' failed: KeyError: 'no such record'"
        assert box.run(ToolCall("failing", {"how": "exit"})).error == RAISED  # sys.exit in a tool: no crash
        not_str = box.run(ToolCall("failing", {"how": "number"}))
        assert not_str.error == RAISED and "returned int, not str" in not_str.content

        calc_error = box.run(ToolCall("calculator", {"expression": "1/0"}))
        assert calc_error.error == RAISED and "ValueError: division by zero" in calc_error.content

        outcomes = [ok, unknown, missing, wrong_type, raised, not_str, calc_error]
        assert error_counts(outcomes) == {MALFORMED: 0, UNKNOWN_TOOL: 1, BAD_ARGUMENTS: 2, RAISED: 3, TIMEOUT: 0}
        assert set(error_counts([])) == set(TOOL_ERROR_KINDS)


def test_long_results_and_errors_are_truncated_with_a_marker():
    with ToolBox([Echo()], max_observation_chars=50) as box:
        out = box.run(ToolCall("echo", {"text": "x", "times": 120}))
        assert out.ok and out.content == "x" * 50 + "\n[... 70 more characters truncated]"
        assert box.run(ToolCall("echo", {"text": "y", "times": 50})).content == "y" * 50  # at the limit: kept
        long_name = box.run(ToolCall("z" * 200, {}))
        assert long_name.error == UNKNOWN_TOOL and long_name.content.endswith("more characters truncated]")
    with ToolBox([Echo()]) as box:  # the default limit
        assert len(box.run(ToolCall("echo", {"text": "x", "times": 5000})).content.split("\n")[0]) == 2000


def test_timeout_returns_an_error_observation_in_time():
    with ToolBox([Sleeper(timeout_s=0.3)]) as box:
        start = time.monotonic()
        out = box.run(ToolCall("sleeper", {"seconds": 2}))
        elapsed = time.monotonic() - start
        assert out.error == TIMEOUT and out.content == "error: tool 'sleeper' timed out after 0.3 s"
        assert 0.25 <= elapsed < 1.5, elapsed
        assert box.run(ToolCall("sleeper", {"seconds": 0.01})).ok  # another thread takes it meanwhile


def test_hung_calls_cannot_exhaust_the_pool():
    blocker = Blocker()
    box = ToolBox([blocker, Echo()], max_threads=2)
    try:
        hung = box.run_many([ToolCall("blocker", {}), ToolCall("blocker", {})])
        assert [o.error for o in hung] == [TIMEOUT, TIMEOUT]
        assert box.hung_threads == 2
        start = time.monotonic()
        refused = box.run(ToolCall("echo", {"text": "hi"}))  # no thread left: refused at once, not queued
        assert time.monotonic() - start < 0.5
        assert refused.error == TIMEOUT and "all 2 tool threads are still held by earlier calls" in refused.content
        blocker.release.set()
        deadline = time.monotonic() + 10
        while box.hung_threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert box.hung_threads == 0
        assert box.run(ToolCall("echo", {"text": "hi"})).content == "hi"
    finally:
        blocker.release.set()
        box.close()


def test_a_free_thread_left_beside_hung_ones_still_serves_every_call():
    blocker = Blocker()
    with ToolBox([blocker, Echo()], max_threads=2) as box:
        try:
            assert box.run(ToolCall("blocker", {})).error == TIMEOUT
            outcomes = box.run_many([ToolCall("echo", {"text": str(i)}) for i in range(5)])
            assert [o.content for o in outcomes] == ["0", "1", "2", "3", "4"]
        finally:
            blocker.release.set()


def test_run_many_runs_calls_concurrently_in_order():
    with ToolBox([Sleeper("slow"), Echo()]) as box:
        start = time.monotonic()
        outcomes = box.run_many([ToolCall("slow", {"seconds": 1.0}), ToolCall("echo", {"text": "fast"})])
        elapsed = time.monotonic() - start
        assert [o.content for o in outcomes] == ["slept 1.0", "fast"]
        assert 0.95 <= elapsed < 1.7, elapsed  # not 2 s: the slow call does not hold up the other
        assert outcomes[0].seconds >= 0.95 and outcomes[1].seconds < 0.5

        start = time.monotonic()
        two_slow = box.run_many([ToolCall("slow", {"seconds": 0.5}), ToolCall("slow", {"seconds": 0.5})])
        assert all(o.ok for o in two_slow) and time.monotonic() - start < 0.95


def test_more_calls_than_threads_wait_for_a_thread_without_timing_out():
    with ToolBox([Sleeper(timeout_s=2.0)], max_threads=2) as box:
        start = time.monotonic()
        outcomes = box.run_many([ToolCall("sleeper", {"seconds": 0.2}) for _ in range(4)])
        assert all(o.ok for o in outcomes), [o.content for o in outcomes]
        assert 0.35 <= time.monotonic() - start < 1.5  # two waves of two


def test_toolbox_is_safe_to_share_between_threads():
    results: dict[int, list[str]] = {}
    with ToolBox([Calculator()], max_threads=3) as box:
        def worker(k: int) -> None:
            results[k] = [box.run(ToolCall("calculator", {"expression": f"{k} * {i} + 1"})).content
                          for i in range(25)]

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert results == {k: [str(k * i + 1) for i in range(25)] for k in range(6)}


def test_closed_toolbox_refuses_calls():
    box = ToolBox([Echo()])
    box.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.run(ToolCall("echo", {"text": "x"}))


# -- the calculator ---------------------------------------------------------------------------------------------------

LIMIT = 10**30
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
       "%": operator.mod, "**": operator.pow}


class Refused(Exception):
    pass


def _check(value):
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > LIMIT:
        raise Refused("too large")
    return value


def _random_tree(rng: random.Random, depth: int):
    """(text, reference evaluator): the value is computed on the tree, in the calculator's order, not by parsing."""
    if depth == 0 or rng.random() < 0.25:
        value = rng.choice([rng.randint(0, 60), rng.randint(0, 60), round(rng.uniform(0, 20), rng.randint(1, 3))])
        return str(value), lambda: value
    if rng.random() < 0.12:
        text, inner = _random_tree(rng, depth - 1)
        return f"-({text})", lambda: _check(-inner())
    op = rng.choice(list(OPS))
    left_text, left = _random_tree(rng, depth - 1)
    if op == "**":  # small integer exponents keep the values finite most of the time
        exponent = rng.randint(-2, 3)
        right_text, right = f"({exponent})", lambda: exponent
    else:
        right_text, right = _random_tree(rng, depth - 1)

    def value():
        a, b = left(), right()
        try:
            return _check(OPS[op](a, b))
        except ZeroDivisionError:
            raise Refused("division by zero") from None
        except OverflowError:
            raise Refused("too large") from None

    return f"({left_text}) {op} ({right_text})", value


def test_calculator_agrees_with_python_arithmetic_on_random_expressions():
    rng = random.Random(1234)
    calc = Calculator()
    checked = refused = 0
    for _ in range(600):
        text, reference = _random_tree(rng, rng.randint(1, 4))
        if len(text) > calc.max_expression_chars:
            continue
        try:
            expected = reference()
        except Refused as exc:
            with pytest.raises(ValueError, match=str(exc)):
                calc.call(expression=text)
            refused += 1
            continue
        got = calc.call(expression=text)
        assert expected == eval(text), text  # the rendering means what the tree means (test-only eval)
        if isinstance(expected, int):
            assert got == str(expected), (text, got, expected)
        else:
            assert math.isclose(float(got), expected, rel_tol=1e-9, abs_tol=1e-300), (text, got, expected)
            if expected.is_integer() and abs(expected) < 1e16:
                assert got == str(int(expected)), (text, got)
        checked += 1
    assert checked > 300 and refused > 10, (checked, refused)


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 // 2", "3"), ("-7 // 2", "-4"), ("-7 % 3", "2"), ("7 % -3", "-2"),
    ("6 / 3", "2"), ("1 / 3", "0.3333333333"), ("2 / 3", "0.6666666667"), ("0.1 + 0.2", "0.3"), ("2 ** -1", "0.5"),
    ("2 ** 10", "1024"), ("2 ** 99", str(2**99)), ("2 ** 0.5", "1.414213562"), ("-2 ** 2", "-4"), ("(-2) ** 2", "4"),
    ("+-+3", "-3"), ("  12\n", "12"), ("1_000 * 3", "3000"), ("1e3", "1000"), ("10 ** 30", str(10**30)),
    ("3.0 * 4", "12"), ("-0.0", "0"), ("1.5e20 / 1e3", "1.5e+17"), ("1e16 * 1.5", "1.5e+16"),
    ("2 ** -40", "9.094947018e-13"), ("5 % 2.5", "0"), ("2 * -3", "-6"), ("(-2) ** -1", "-0.5"),
])
def test_calculator_values(expression, expected):
    assert Calculator().call(expression=expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('ls')", "function calls are not allowed"),
    ("(1).__class__", "attribute access is not allowed"),
    ("().__class__.__bases__[0].__subclasses__()", "function calls are not allowed"),
    ("x + 1", r"names are not allowed \('x'\)"),
    ("[1, 2][0]", "subscripts are not allowed"),
    ("1 < 2", "comparisons are not allowed"),
    ("1 and 2", "'and' / 'or' are not allowed"),
    ("'a' * 3", "only int and float numbers are allowed, got str"),
    ("True + 1", "got bool True"),
    ("1j * 2", "got complex"),
    ("1 & 3", "operator '&' is not allowed"),
    ("~1", "operator '~' is not allowed"),
    ("not 1", "operator 'not' is not allowed"),
    ("1, 2", "tuples"),
    ("(x := 3)", "assignments are not allowed"),
    ("lambda: 1", "lambdas are not allowed"),
    ("import os", "not an arithmetic expression"),
    ("1 +", "not an arithmetic expression"),
    ("", "the expression is empty"),
    ("9**9**9", "the exponent 387420489 is too large"),
    ("2 ** 1001", "the exponent 1001 is too large"),
    ("10 ** 31", "10 \\*\\* 31 is too large"),
    ("10 ** 30 + 1", "a value is too large"),
    ("1e308 * 10", "a value is too large"),
    ("1e999", "a value is too large"),
    ("9" * 40, "a value is too large"),
    ("1 / 0", r"division by zero \(in 1 / 0\)"),
    ("5 // (2 - 2)", "division by zero"),
    ("5 % 0.0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "negative number to a fractional power"),
    ("1" + "+1" * 100, "the expression is 201 characters long; the limit is 200"),
    ("(" * 150 + "1" + ")" * 150, "characters long"),
])
def test_calculator_refuses_with_a_clear_message(expression, message):
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        evaluate(expression)
    assert time.monotonic() - start < 0.5  # refused before any expensive work


def test_calculator_deep_nesting_within_the_length_limit():
    assert evaluate("(" * 90 + "1" + ")" * 90) == 1
    assert evaluate("-" * 199 + "1") == -1
    with ToolBox([Calculator()]) as box:
        out = box.run(ToolCall("calculator", {"expression": "a" * 100_000}))
        assert out.error == RAISED and "limit is 200" in out.content and len(out.content) < 300


# -- tool-call parsing: hermes ----------------------------------------------------------------------------------------

CALC = '{"name": "calculator", "arguments": {"expression": "2*3"}}'


def _block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_hermes_single_and_several_calls():
    reply = parse_tool_calls(f"Let me compute.\n{_block(CALC)}", "hermes")
    assert reply.content == "Let me compute." and reply.has_tool_calls and reply.errors == []
    [call] = reply.calls
    assert (call.name, call.arguments, call.raw) == ("calculator", {"expression": "2*3"}, _block(CALC))

    text = ("First.\n" + _block(CALC) + "\nthen\n" + _block('{"arguments": {"text": "é", "times": 2}, "name": "echo"}')
            + "<tool_call>{\"name\":\"loose\",\"arguments\":{}}</tool_call> done")
    reply = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in reply.calls] == [
        ("calculator", {"expression": "2*3"}), ("echo", {"text": "é", "times": 2}), ("loose", {})]
    assert reply.content == "First.\n\nthen\n done"

    plain = parse_tool_calls("The answer is 6.", "hermes")
    assert (plain.content, plain.blocks, plain.has_tool_calls) == ("The answer is 6.", [], False)


def test_hermes_lenient_arguments():
    as_string = parse_tool_calls(_block('{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'),
                                 "hermes")
    assert as_string.calls[0].arguments == {"expression": "1+1"}
    no_arguments = parse_tool_calls(_block('{"name": "loose"}'), "hermes")
    assert no_arguments.calls[0].arguments == {}


@pytest.mark.parametrize("body, problem", [
    ('{"name": "calculator", "arguments": {"expression": "2*3"}', "invalid JSON"),
    ("calculator(2*3)", "invalid JSON"),
    ("", "invalid JSON"),
    ('[{"name": "calculator"}]', "the call must be a JSON object, got an array"),
    ('{"arguments": {"expression": "1"}}', 'no tool name (a non-empty string "name")'),
    ('{"name": 7, "arguments": {}}', "no tool name"),
    ('{"name": "calculator", "arguments": ["2*3"]}', "arguments must be a JSON object, got an array"),
    ('{"name": "calculator", "arguments": "2*3"}', "got a string that is not JSON"),
    ('{"name": "calculator", "arguments": "[1]"}', "got a string holding an array"),
    ('{"name": "calculator", "arguments": null}', "got null"),
])
def test_hermes_malformed_blocks_are_errors_beside_good_ones(body, problem):
    reply = parse_tool_calls(f"ok {_block(CALC)} bad {_block(body)} end", "hermes")
    assert reply.content == "ok  bad  end"
    good, bad = reply.blocks
    assert isinstance(good, ToolCall) and good.name == "calculator"
    assert isinstance(bad, ToolOutcome) and bad.call is None and bad.error == MALFORMED and not bad.ok
    assert bad.content.startswith("error: malformed tool call: ") and problem in bad.content
    assert '"arguments": {<arguments>}' in bad.content  # says what was expected


def test_hermes_unterminated_block():
    reply = parse_tool_calls(f"{_block(CALC)}\n<tool_call>\n{CALC}", "hermes")
    assert len(reply.calls) == 1 and reply.content == ""
    [error] = reply.errors
    assert error.error == MALFORMED and "<tool_call> is never closed by </tool_call>" in error.content
    cut = parse_tool_calls('I will call.\n<tool_call>\n{"name": "calcul', "hermes")  # generation ran out
    assert cut.calls == [] and cut.content == "I will call." and cut.errors[0].error == MALFORMED
    long = parse_tool_calls("<tool_call>" + "x" * 5000, "hermes")
    assert len(long.errors[0].content) < 400  # the bad block is quoted, shortened


def test_unknown_tools_are_left_to_the_toolbox_and_run_reply_keeps_block_order():
    text = _block('{"name": "search", "arguments": {"q": "x"}}') + _block("{bad") + _block(CALC) + _block(
        '{"name": "calculator", "arguments": {"expression": "2**9999"}}')
    reply = parse_tool_calls(text, "hermes")
    assert [c.name for c in reply.calls] == ["search", "calculator", "calculator"] and len(reply.errors) == 1
    with ToolBox([Calculator()]) as box:
        outcomes = box.run_reply(reply)
    assert [o.error for o in outcomes] == [UNKNOWN_TOOL, MALFORMED, None, RAISED]
    assert outcomes[2].message() == {"role": "tool", "content": "6", "name": "calculator"}
    assert error_counts(outcomes) == {MALFORMED: 1, UNKNOWN_TOOL: 1, BAD_ARGUMENTS: 0, RAISED: 1, TIMEOUT: 0}


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match=r"tool_format 'xml' is not one of \('hermes', 'json'\)"):
        parse_tool_calls("x", "xml")


# -- tool-call parsing: json ------------------------------------------------------------------------------------------

JCALC = '{"tool": "calculator", "arguments": {"expression": "2*3"}}'


def test_json_lines_and_fenced_blocks():
    text = f"I need two numbers.\n{JCALC}\n  {{\"tool\": \"echo\", \"arguments\": {{\"text\": \"a\"}}}}  \nDone."
    reply = parse_tool_calls(text, "json")
    assert [(c.name, c.arguments) for c in reply.calls] == [
        ("calculator", {"expression": "2*3"}), ("echo", {"text": "a"})]
    assert reply.content == "I need two numbers.\nDone." and reply.calls[0].raw == JCALC

    fenced = 'Calling:\n```json\n{\n  "tool": "calculator",\n  "arguments": {"expression": "1+1"}\n}\n```\nwait'
    reply = parse_tool_calls(fenced, "json")
    assert [(c.name, c.arguments) for c in reply.calls] == [("calculator", {"expression": "1+1"})]
    assert reply.content == "Calling:\nwait" and reply.calls[0].raw.startswith("```json")
    bare = parse_tool_calls(f"```\n{JCALC}\n```", "json")
    assert bare.calls[0].name == "calculator" and bare.content == ""

    as_string = parse_tool_calls('{"tool": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}', "json")
    assert as_string.calls[0].arguments == {"expression": "3"}


def test_json_content_that_is_not_a_call_stays_content():
    text = ('Here is data:\n{"name": "x", "value": 1}\n```python\nprint({"tool": "calculator"})\n```\n'
            '```json\n{"a": 1}\n```\nsay "tool" in prose\n<tool_call>{"name": "calculator"}</tool_call>')
    reply = parse_tool_calls(text, "json")
    assert reply.blocks == [] and reply.content == text


@pytest.mark.parametrize("text, problem", [
    ('{"tool": "calculator", "arguments": {"expression": "2*3"}', "invalid JSON"),
    ('{"tool": "calculator", "arguments": 5}', "arguments must be a JSON object, got a number"),
    ('{"tool": "", "arguments": {}}', 'no tool name (a non-empty string "tool")'),
    ('{"name": "calculator", "tool": null}', "no tool name"),
    ('```json\n{"tool": "calculator", "arguments": {"expression": "1"}}\n', "a ``` block is never closed"),
    ('```json\n{"tool": "calculator",\n "arguments": {"expression": "1"}\n\n```', "invalid JSON"),
])
def test_json_malformed_calls_are_errors(text, problem):
    reply = parse_tool_calls(f"Thinking.\n{text}", "json")
    assert reply.calls == [] and reply.content == "Thinking."
    [error] = reply.errors
    assert error.error == MALFORMED and problem in error.content and "on a line of its own" in error.content


# -- the same calls as vLLM's own Hermes parser ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from chat_tokenizer import save_chat_tokenizer

    return AutoTokenizer.from_pretrained(str(save_chat_tokenizer(tmp_path_factory.mktemp("agent_tok"))))


WELL_FORMED = [
    "The answer is 6.",
    "Let me compute.\n" + _block(CALC),
    _block(CALC),
    "Two:\n" + _block(CALC) + "\n"
    + _block('{"name": "echo", "arguments": {"text": "naïve \\"quoted\\"", "times": 2}}'),
    '<tool_call>{"name": "loose", "arguments": {"x": 3, "nested": {"a": [1, 2.5, null, true]}}}</tool_call>',
    _block('{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'),  # arguments as a string
]


@pytest.mark.parametrize("parser", ["hermes", "qwen3_json"])
def test_hermes_parser_finds_the_same_calls_as_vllms(tokenizer, parser):
    pytest.importorskip("vllm.tool_parsers")
    for text in WELL_FORMED:
        ours, theirs = parse_tool_calls(text, "hermes"), parse_tool_calls(text, f"vllm:{parser}", tokenizer)
        assert [(c.name, c.arguments) for c in ours.calls] == [(c.name, c.arguments) for c in theirs.calls], text
        assert ours.content == theirs.content, text  # text only before the calls: the same content
        assert theirs.errors == []
    # Where they differ, by design: one bad block makes vLLM drop every call, silently.
    mixed = _block(CALC) + _block("{bad")
    ours, theirs = parse_tool_calls(mixed, "hermes"), parse_tool_calls(mixed, f"vllm:{parser}", tokenizer)
    assert (len(ours.calls), len(ours.errors)) == (1, 1)
    assert (theirs.blocks, theirs.content) == ([], mixed)


def test_vllm_formats_need_a_tokenizer_and_a_known_parser(tokenizer):
    pytest.importorskip("vllm.tool_parsers")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        parse_tool_calls("x", "vllm:hermes")
    with pytest.raises(ValueError, match="vLLM has no tool parser 'nope'; it has .*'hermes'"):
        parse_tool_calls("x", "vllm:nope", tokenizer)


def test_schemas_render_through_a_hf_chat_template(tokenizer):
    template = ("{% for tool in tools %}<tool>{{ tool | tojson }}</tool>{% endfor %}"
                "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}")
    with ToolBox([Calculator(), Echo()]) as box:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=box.schemas(),
                                             chat_template=template, tokenize=False)
    rendered = [json.loads(part.split("</tool>")[0]) for part in text.split("<tool>")[1:]]
    assert rendered == box.schemas() and text.endswith("<|user|>hi")


def test_a_tool_that_never_returns_does_not_hold_its_process_at_exit():
    import subprocess
    import textwrap

    program = textwrap.dedent("""
        import time
        from workers.rollout.agent import Tool, ToolBox, ToolCall

        class Forever(Tool):
            name, description, parameters, timeout_s = "forever", "never returns", {"type": "object"}, 0.2

            def call(self) -> str:
                while True:
                    time.sleep(1)

        box = ToolBox([Forever()])
        print(box.run(ToolCall("forever", {})).error)
    """)
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent.parent)})
    assert proc.returncode == 0 and proc.stdout.strip() == "timeout", proc.stderr[-2000:]
    assert time.time() - started < 30
