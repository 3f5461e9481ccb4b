"""Multi-step word problems and the arithmetic environment that rewards a conversation's final answer."""

import re

import pytest

from controller.data.arithmetic import word_problems
from test_agent_loop import ScriptedEngine, call, tokenizer  # noqa: F401 - the fixture
from workers.reward.functions import REWARD_FUNCTIONS
from workers.rollout.agent import AgentLimits, AgentLoop, Calculator, ChatFormat, ToolBox
from workers.rollout.agent.arithmetic_env import ArithmeticEnvironment
from workers.rollout.sampling import SamplingConfig

WORDS = {"add": "+", "subtract": "-", "multiply by": "*"}


def test_word_problems_chain_generator_draws_and_their_answers_follow_the_steps():
    data = word_problems(50, seed=3, steps=3, max_operand=99)
    assert len(data) == 50 and set(data.data_sources) == {"arithmetic"}
    assert data.prompts == word_problems(50, seed=3, steps=3, max_operand=99).prompts  # seeded
    for prompt, answer in zip(data.prompts, data.answers):
        text = prompt[0]["content"]
        start = int(re.match(r"Start with (\d+)\.", text).group(1))
        steps = re.findall(r"(add|subtract|multiply by) (\d+)", text.lower())
        assert len(steps) == 3
        value = start
        for word, operand in steps:  # the answer computed another way: the text's steps applied in order
            value = eval(f"{value} {WORDS[word]} {operand}")  # noqa: S307 - numbers and one operator, from a regex
        assert answer == str(value), (text, answer)
    with pytest.raises(ValueError, match="steps >= 1"):
        word_problems(2, 0, steps=0)


def test_the_environment_rewards_the_final_answer_after_tool_calls(tokenizer):  # noqa: F811
    samples = [{"messages": [{"role": "user", "content": name}], "ground_truth": truth}
               for name, truth in (("right", "15"), ("wrong", "15"), ("cut", "15"))]
    scripts = {"right": [call("calculator", expression="(2+3)*3"), "The result is 15"],
               "wrong": ["It is 14"],
               "cut": [call("calculator", expression="1+1")]}
    engine = ScriptedEngine(tokenizer, scripts)
    with ToolBox([Calculator()]) as box:
        loop = AgentLoop(ChatFormat(tokenizer), lambda sample: ArithmeticEnvironment(box, "hermes"),
                         AgentLimits(max_turns=2, max_response_length=300))
        right, wrong, cut = loop.run(samples, engine, SamplingConfig(max_new_tokens=120))
    assert (right.reward, right.finish_reason, right.tool_calls) == (1.0, "stop", 1)
    assert right.messages[2] == {"role": "tool", "content": "15", "name": "calculator"}
    assert (wrong.reward, wrong.finish_reason) == (0.0, "stop")
    assert (cut.reward, cut.finish_reason) == (0.0, "max_turns")  # never answered
    score = REWARD_FUNCTIONS["environment"]
    assert score("", "", None, {"agent_reward": right.reward}) == 1.0
    with pytest.raises(ValueError, match="reward fn 'environment' scores multi-turn rollouts"):
        score("", "", None, {})
    with pytest.raises(ValueError, match="needs each sample's ground_truth"):
        ArithmeticEnvironment(ToolBox([]), "hermes").reset({"messages": []})


def test_the_word_problems_task_is_configured_and_checked():
    from controller.config import ConfigError, check_config, load_config
    from controller.data.prepare import raw_job_prompts

    config = load_config(None, ["data.task=word_problems", "data.steps=3", "data.train_size=8", "data.val_size=2",
                                "data.max_operand=20"])
    prompts = raw_job_prompts(config.data)
    assert len(prompts.train) == 8 and len(prompts.val) == 2
    assert prompts.train.prompts == word_problems(8, config.data.seed, 3, 20).prompts
    with pytest.raises(ConfigError, match=r"data.steps must be >= 1 \(operations per word problem\), got 0"):
        check_config(load_config(None, ["data.task=word_problems", "data.steps=0"]))
