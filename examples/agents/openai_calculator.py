"""An agent written against the plain ``openai`` client, as it would be for any OpenAI-compatible server.

    rollout:
      server: true
      agent: {entrypoint: "examples.agents.openai_calculator:agent"}
    reward: {fn: arithmetic_answer}      # the agent returns None: the last assistant message is scored

Nothing here knows hybridflow: the model is offered a calculator in OpenAI's tool format, each call is run
here and answered with a ``tool`` message, and the model's first reply without a call is its answer.
"""

import ast
import json
import operator

import openai

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (numbers, + - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TURNS = 3
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.10g}"


async def agent(client: openai.AsyncOpenAI, row: dict) -> float | None:
    messages = list(row["messages"])
    for _ in range(MAX_TURNS):
        try:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError:  # the conversation has used up its tokens
            break
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except Exception as exc:  # noqa: BLE001 (the model's call was bad: it reads why)
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
