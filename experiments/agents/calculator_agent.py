"""An agent program for `environment: agent`: the demo's calculator protocol written against the OpenAI API.

The policy writes GSM8K-style calls, `Step 1: <<12 + 7>>`; the agent stops each request at `>>`, evaluates the
expression, appends ` = 19` and asks the policy to go on, until it writes its `Answer:` line. Nothing in it knows
about rlhf's trainer: `client` is an `openai.OpenAI` client (any OpenAI-compatible server would do), and the reward
is the exact match of the final answer. Used by experiments/configs/demo_agent.yaml and docs/experiments/agents.md.

    agent: experiments.agents.calculator_agent:solve
"""

from __future__ import annotations

import ast
import operator
import re

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Arithmetic on numbers with + - * / and parentheses, from the syntax tree; an error text otherwise."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(type(node).__name__)

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return "error"
    return str(int(result)) if float(result).is_integer() else str(round(result, 6))


def final_answer(text: str) -> str | None:
    found = re.findall(r"Answer:\s*(-?[\d.,]+)", text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def solve(client, record, max_calls: int = 4, budget: int = 96) -> float:
    """One episode: the record's prompt (as the run's chat template writes it) continued through the completions
    API, with the calculator answering every `<<...>>`. Returns 1.0 when the final answer is the record's."""
    prompt = record["prompt_text"]
    written = ""
    for _ in range(max_calls):
        reply = client.completions.create(model="policy", prompt=prompt + written, stop=[">>"],
                                          max_tokens=budget)
        choice = reply.choices[0]
        written += choice.text
        if choice.finish_reason != "stop" or "<<" not in choice.text or "Answer:" in choice.text:
            break  # the Answer line, or the budget, ended the episode
        # the answer stops at ">>" and leaves it out, as OpenAI's API does: write it back, then the result
        written += ">> = " + calculate(choice.text[choice.text.rfind("<<") + 2:])
    answer = record.get("answer")
    return float(answer is not None and final_answer(written) == str(answer).strip())
