"""Tool calls and reasoning in each model family's own format, through `coli serve` and the
official `openai` client (issue 16, item 5).

The model is the session's tiny random-weight checkpoint with its chat template replaced by a
real one (server/tests/fixtures/chat_templates/, see its README), so the server picks the
format from how that template writes a tool call. A random model writes nothing on purpose,
so what it "produces" is forced by a grammar:

- a `grammar` (Lark) that allows exactly one text, an answer written by hand in the family's
  format (as the family's documentation and vLLM's parsers show it): the client must get the
  `reasoning_content`, `content` and `tool_calls` it holds, whole and streamed;
- `tool_choice: "required"` or a named function: the server's own grammar forces a call in
  the family's format, which the server must read back as the client's `tool_calls`.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from helpers import REPO, wait_until

TEMPLATES = REPO / "server" / "tests" / "fixtures" / "chat_templates"

SWITCH_PARAMS = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
TOOLS = [
    {"type": "function", "function": {"name": "switch", "description": "Turn the light on or off",
                                      "parameters": SWITCH_PARAMS}},
    {"type": "function", "function": {"name": "ping", "description": "Check the light",
                                      "parameters": {"type": "object", "properties": {}}}},
]
ARGS_SCHEMAS = {"switch": {**SWITCH_PARAMS, "additionalProperties": False},
                "ping": {"type": "object", "additionalProperties": False}}
ASK = [{"role": "user", "content": "Turn the light on."}]

# template -> (the format the server must detect, as its log names it; a model answer in that
# format; the reasoning, content and call it holds).
CASES = {
    "glm-4.6": (
        "Glm45",
        "<think>Turn it on.</think>\n<tool_call>switch\n<arg_key>on</arg_key>\n<arg_value>true</arg_value>\n</tool_call>",
        "Turn it on.", None,
    ),
    "deepseek-v3.1": (
        "DeepseekV31",
        "Switching.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>switch<｜tool▁sep｜>{\"on\": true}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        None, "Switching.",
    ),
    "deepseek-r1": (
        "DeepseekV3",
        "<think>Turn it on.</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>switch\n```json\n{\"on\": true}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Turn it on.", None,
    ),
    "kimi-k2-thinking": (
        "KimiK2",
        "<think>Turn it on.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.switch:0<|tool_call_argument_begin|>{\"on\": true}<|tool_call_end|><|tool_calls_section_end|>",
        "Turn it on.", None,
    ),
    "kimi-k3": (
        "KimiK3",
        "<|open|>think<|sep|>Turn it on.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"switch\" index=\"1\"<|sep|><|open|>argument key=\"on\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
        "Turn it on.", None,
    ),
    "gpt-oss-120b": (
        "Harmony",
        "<|channel|>analysis<|message|>Turn it on.<|end|><|start|>assistant<|channel|>commentary to=functions.switch <|constrain|>json<|message|>{\"on\": true}",
        "Turn it on.", None,
    ),
    "minimax-m2": (
        "MinimaxM2",
        "<think>Turn it on.</think>\n<minimax:tool_call>\n<invoke name=\"switch\">\n<parameter name=\"on\">true</parameter>\n</invoke>\n</minimax:tool_call>",
        "Turn it on.", None,
    ),
    "qwen3-coder": (
        "Qwen3Coder",
        "Switching.\n<tool_call>\n<function=switch>\n<parameter=on>\ntrue\n</parameter>\n</function>\n</tool_call>",
        None, "Switching.",
    ),
}

_servers: dict = {}


@pytest.fixture
def family_server(request, start_server, model_dir, tmp_path_factory):
    """A server on the session's model with the real template `request.param`, one per
    template for the session."""
    name = request.param
    if name not in _servers:
        model = tmp_path_factory.mktemp(f"model-{name}") / "model"
        shutil.copytree(model_dir, model)
        shutil.copy(TEMPLATES / f"{name}.jinja", model / "chat_template.jinja")
        _servers[name] = start_server("--slots", "1", "--drain-secs", "5", name=name, model=model)
    return name, _servers[name]


def literal(text: str) -> str:
    """A Lark grammar that allows exactly `text`."""
    return f"start: {json.dumps(text)}\n"


def streamed(stream) -> tuple[str | None, str | None, list[dict], str | None]:
    """(reasoning, content, calls, finish_reason) that a stream's chunks add up to."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = choice.finish_reason or finish
    return reasoning or None, content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("family_server", list(CASES), indirect=True)
def test_the_family_format_is_read_back_whole_and_streamed(family_server):
    name, server = family_server
    detected, output, want_reasoning, want_content = CASES[name]
    assert f"tool_call_format={detected}" in server.log(400), server.log(40)
    client = server.client()
    body = dict(model=server.model_id, messages=ASK, tools=TOOLS, max_tokens=400,
                extra_body={"grammar": literal(output)})
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice, server.log(20))
    message = choice.message
    assert getattr(message, "reasoning_content", None) == want_reasoning, message
    assert message.content == want_content, message
    (call,) = message.tool_calls
    assert call.type == "function"
    assert call.function.name == "switch"
    assert json.loads(call.function.arguments) == {"on": True}

    reasoning, content, calls, finish = streamed(client.chat.completions.create(**body, stream=True))
    assert (reasoning, content, finish) == (want_reasoning, want_content, "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("switch", {"on": True})]
    assert calls[0]["id"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "switch"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("family_server", list(CASES), indirect=True)
def test_a_required_call_is_forced_in_the_family_format(family_server, tool_choice):
    name, server = family_server
    client = server.client()
    body = dict(model=server.model_id, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                max_tokens=400, temperature=1.0, seed=7)
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice, r.usage, server.log(20))
    (call,) = choice.message.tool_calls
    if tool_choice != "required":
        assert call.function.name == "switch"
    assert call.function.name in ARGS_SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), ARGS_SCHEMAS[call.function.name])

    _, content, calls, finish = streamed(client.chat.completions.create(**body, stream=True))
    assert finish == "tool_calls"
    assert content is None
    # The same seed: the same call.
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (call.function.name, json.loads(call.function.arguments))]


@pytest.mark.parametrize("family_server", ["gpt-oss-120b"], indirect=True)
def test_harmony_reasoning_and_answer_without_tools(family_server):
    _, server = family_server
    output = "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    r = server.client().chat.completions.create(
        model=server.model_id, messages=ASK, max_tokens=200, extra_body={"grammar": literal(output)})
    message = r.choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == ("A greeting.", "Hello!")
    assert r.choices[0].finish_reason == "stop"
    assert not message.tool_calls


@pytest.mark.parametrize("family_server", ["glm-4.6"], indirect=True)
def test_a_malformed_call_comes_back_as_text(family_server):
    _, server = family_server
    output = "<tool_call>switch\n<arg_key>on</arg_key>\ntrue\n</tool_call>"
    r = server.client().chat.completions.create(
        model=server.model_id, messages=ASK, tools=TOOLS, max_tokens=200,
        extra_body={"grammar": literal(output)})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == output
    assert not choice.message.tool_calls
    # The server writes the warning before it answers, but its stderr is read by a thread of
    # the test's own that may not have reached that line yet.
    wait_until(lambda: "does not read as calls" in server.log(40), 10,
               "the malformed-block warning in the server log")
