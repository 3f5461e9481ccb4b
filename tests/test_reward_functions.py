"""The built-in rule-based reward functions and resolve_reward_fn."""

from decimal import Decimal

import pytest

from workers.reward import REWARD_FUNCTIONS, resolve_reward_fn
from workers.reward.functions import (
    arithmetic_answer,
    arithmetic_shaped,
    final_answer,
    format_check,
)

not_a_function = 42


def my_reward(prompt, response, ground_truth, extra):
    return float(len(response))


class Scorers:
    @staticmethod
    def length(prompt, response, ground_truth, extra):
        return float(len(prompt))


def score(fn, response, ground_truth="42"):
    return fn("What is 6*7?", response, ground_truth, {})


# --------------------------------------------------------------- final_answer
@pytest.mark.parametrize("text,expected", [
    ("6*7 = 42\n#### 42", "42"),
    ("first 3, then #### 17 (not 99)", "17"),  # the first number after the marker
    ("#### 1 then more #### 5", "5"),  # the last marker wins
    ("The answer is 42.", "42"),  # the sentence's period is not a decimal point
    ("x = -3.5 and then 1,000", "1000"),  # last number, thousands comma dropped
    ("it is -7", "-7"),
    ("10-3 is 7; 2.50", "2.50"),
    ("3-5", "5"),  # a minus after a digit is a subtraction, not a sign
    ("no number here", None),
    ("I think 12 #### unsure", None),  # committed to a non-numeric answer
    ("", None),
])
def test_final_answer(text, expected):
    assert final_answer(text) == (None if expected is None else Decimal(expected))


# ---------------------------------------------------------- arithmetic_answer
@pytest.mark.parametrize("response,ground_truth,expected", [
    ("6 * 7 = 42\n#### 42", "42", 1.0),
    ("6 * 7 = 42\n#### 41", "42", 0.0),
    ("#### 42", "She has 6*7 = <<6*7=42>>42 apples.\n#### 42", 1.0),  # a GSM8K ground truth
    ("the answer is 42", "42", 1.0),  # last-number fallback
    ("42 or maybe 43", "42", 0.0),
    ("it drops to -3.5 degrees", "-3.5", 1.0),
    ("it drops to 3.5 degrees", "-3.5", 0.0),
    ("#### 42.0", "42", 1.0),  # compared as numbers
    ("#### 1,250", "1250", 1.0),
    ("no idea", "42", 0.0),
    ("", "42", 0.0),
])
def test_arithmetic_answer(response, ground_truth, expected):
    assert score(arithmetic_answer, response, ground_truth) == expected


@pytest.mark.parametrize("ground_truth,message", [
    (None, "arithmetic_answer needs a ground truth"),
    ("none given", "ground truth 'none given' contains no number"),
])
def test_arithmetic_answer_bad_ground_truth(ground_truth, message):
    with pytest.raises(ValueError, match=message):
        score(arithmetic_answer, "#### 42", ground_truth)


# -------------------------------------------------------------- format_check
@pytest.mark.parametrize("response,expected", [
    ("6*7 = 42\n#### 42", 1.0),
    ("#### -3.5  \n", 1.0),
    ("#### 1,000", 1.0),
    ("#### 42.", 0.0),  # something after the number
    ("#### 42 apples", 0.0),
    ("#### forty-two", 0.0),
    ("the answer is 42", 0.0),
    ("", 0.0),
])
def test_format_check(response, expected):
    assert score(format_check, response, ground_truth=None) == expected


# --------------------------------------------------------- arithmetic_shaped
@pytest.mark.parametrize("response,ground_truth,expected", [
    ("42", "42", 1.0),
    ("4 then #### 42", "42", 1.0),
    ("43", "42", 0.5),  # two leading digits of two
    ("4x", "42", 0.25),  # one of two
    ("9999", "42", 0.5),  # capped at the answer's length
    ("12+", "123", 0.5 * 2 / 3),
    (" 42x", "420", 0.0),  # leading whitespace is not a digit
    ("abc", "42", 0.0),
    ("", "42", 0.0),
    ("5", "#### 100", 0.5 / 3),  # the target is the ground truth's answer, "100"
    ("3", "-3", 0.25),  # "-3" has two characters; the digit counts for one
])
def test_arithmetic_shaped(response, ground_truth, expected):
    assert score(arithmetic_shaped, response, ground_truth) == pytest.approx(expected, abs=1e-12)


def test_arithmetic_shaped_needs_ground_truth():
    with pytest.raises(ValueError, match="arithmetic_shaped needs a ground truth"):
        score(arithmetic_shaped, "42", None)


# --------------------------------------------------------- resolve_reward_fn
def test_resolve_names_and_callables():
    assert set(REWARD_FUNCTIONS) == {"arithmetic_answer", "format_check", "arithmetic_shaped", "environment",
                                     "code_exec", "code_expression", "code_expression_shaped"}
    for name, fn in REWARD_FUNCTIONS.items():
        assert resolve_reward_fn(name) is fn
    assert resolve_reward_fn(my_reward) is my_reward
    assert resolve_reward_fn(lambda *a: 0.5)("p", "r", None, {}) == 0.5


def test_resolve_import_paths():
    fn = resolve_reward_fn("test_reward_functions:my_reward")
    assert fn("p", "four", None, {}) == 4.0
    assert resolve_reward_fn("test_reward_functions:Scorers.length")("abc", "", None, {}) == 3.0
    assert resolve_reward_fn("workers.reward.functions:format_check") is format_check


@pytest.mark.parametrize("spec,error,message", [
    ("arithmetic", ValueError,
     (r"unknown reward function 'arithmetic'; built-in functions: \['arithmetic_answer', 'arithmetic_shaped', "
     r"'code_exec', 'code_expression', 'code_expression_shaped', 'environment', 'format_check'\], or give an "
     r"import path 'package\.module:function'")),
    ("", ValueError, "unknown reward function ''"),
    (":my_reward", ValueError, r"reward function path ':my_reward' must have the form 'package\.module:function'"),
    ("test_reward_functions:", ValueError, "must have the form"),
    ("a:b:c", ValueError, "must have the form"),
    ("no_such_module_xyz:fn", ImportError,
     (r"reward function 'no_such_module_xyz:fn': module 'no_such_module_xyz' failed to import "
     r"\(ModuleNotFoundError: No module named 'no_such_module_xyz'\)")),
    ("test_reward_functions:missing", AttributeError,
     "reward function 'test_reward_functions:missing': module 'test_reward_functions' has no attribute 'missing'"),
    ("test_reward_functions:not_a_function", TypeError,
     "reward function 'test_reward_functions:not_a_function' is a int, not a callable"),
    (3.5, TypeError, "a reward function must be a callable, a built-in name or 'package.module:function'; got float 3.5"),
])
def test_resolve_errors(spec, error, message):
    with pytest.raises(error, match=message):
        resolve_reward_fn(spec)


def test_resolve_chains_the_import_error(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_module.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"module 'broken_reward_module' failed to import \(RuntimeError: boom at import\)") as info:
        resolve_reward_fn("broken_reward_module:fn")
    assert isinstance(info.value.__cause__, RuntimeError)
