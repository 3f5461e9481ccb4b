"""rollout.agent: tools and environments resolved by name or import path, every problem named up front."""

import pytest

from workers.rollout.agent import Calculator, Environment, ToolEnvironment
from workers.rollout.agent.config import AgentConfig, resolve_tool


class Echo(Environment):
    def step(self, messages, reply):
        return None, 1.0, True


class Graded(ToolEnvironment):
    pass


def test_tools_and_environments_resolve_from_names_and_import_paths():
    assert resolve_tool("calculator") is Calculator
    config = AgentConfig(tools=("calculator",), environment="test_agent_config:Echo", max_turns=2)
    assert isinstance(config.environment_factory(config.toolbox())({"messages": []}), Echo)
    graded = AgentConfig(environment="test_agent_config:Graded")
    with graded.toolbox() as box:
        env = graded.environment_factory(box)({})
        assert isinstance(env, Graded) and env.box is box and env.tool_format == "hermes"
        assert box.names == ["calculator"]
    assert AgentConfig().limits().max_turns == 4 and AgentConfig(tools=[]).tools == ()


def test_every_problem_is_named_before_any_worker_starts():
    with pytest.raises(ValueError) as info:
        AgentConfig(tools=("calculator", "search", "os:path", "calculator"), environment="test_agent_config:nothing",
                    tool_format="xml", max_turns=0)
    text = str(info.value)
    assert "unknown tool 'search'; built-in tools: ['calculator', 'python'], or give an import path" in text
    assert "tool 'os:path' is <module 'posixpath'" in text and "not a subclass of workers.rollout.agent.Tool" in text
    assert "tools lists a tool twice" in text
    assert "environment 'test_agent_config:nothing': module 'test_agent_config' has no 'nothing'" in text
    assert "tool_format 'xml' is not one of ('hermes', 'json')" in text
    assert "agent limit max_turns must be a positive integer, got 0" in text
    with pytest.raises(ValueError, match="environment 'no_such_module:Env': cannot import 'no_such_module'"):
        AgentConfig(environment="no_such_module:Env")
    with pytest.raises(ValueError, match="environment 'test_agent_config:Calculator' is .*not a subclass of .*Environment"):
        AgentConfig(environment="test_agent_config:Calculator")
