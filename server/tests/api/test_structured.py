"""Constrained output: tool calls (named and `required`), streamed and not, the tool-result
round trip, and `response_format` json_schema / json_object.

A random-weight model never chooses a tool call by itself, so every call here is forced
(`tool_choice` names the function or is `required`), and the server's grammar keeps the
output valid. String lengths are bounded in the schemas, so a random model cannot wander
inside an endless string before `max_tokens`.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers import complete_json_prefix

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": TIME_PARAMS,
            "strict": True,
        },
    },
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]

# Enough for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` with bounded strings.
CALL_TOKENS = 256


def chat(server, **kw):
    kw.setdefault("messages", ASK)
    return server.client().chat.completions.create(model=server.model_id, **kw)


def check_call(call, allowed=("get_weather",)):
    assert call.type == "function"
    assert call.id, "a tool call needs an id"
    assert call.function.name in allowed
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    return args


def reassemble(chunks):
    """Tool calls from stream deltas: id/type/name once, arguments concatenated, by index."""
    calls: dict[int, dict] = {}
    content = ""
    finish = None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "type": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["type"] += tc.type or ""
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
        if c.choices[0].finish_reason:
            assert finish is None, "two finish reasons"
            finish = c.choices[0].finish_reason
    return [calls[i] for i in sorted(calls)], content, finish


@pytest.mark.parametrize("seed", [1, 2])
def test_named_tool_call(server, seed):
    r = chat(server, tools=TOOLS, tool_choice=NAMED, max_tokens=CALL_TOKENS, temperature=0.8, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message.content)
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    check_call(calls[0])
    assert choice.message.content is None
    assert r.usage.completion_tokens < CALL_TOKENS


def test_required_tool_call(server):
    r = chat(server, tools=TOOLS, tool_choice="required", max_tokens=CALL_TOKENS, temperature=0.8, seed=7)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message.content)
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        check_call(call, allowed=("get_weather", "get_time"))


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_tool_call_equals_non_streamed(server, tool_choice):
    kw = dict(tools=TOOLS, tool_choice=tool_choice, max_tokens=CALL_TOKENS, temperature=0.8, seed=3)
    whole = chat(server, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    chunks = list(chat(server, stream=True, **kw))
    calls, content, finish = reassemble(chunks)
    assert finish == "tool_calls"
    assert content == (whole.message.content or "")
    assert len(calls) == len(whole.message.tool_calls) >= 1
    for got, want in zip(calls, whole.message.tool_calls):
        assert got["id"], "streamed tool call without an id"
        assert got["type"] == "function"
        assert got["name"] == want.function.name
        assert json.loads(got["arguments"]) == json.loads(want.function.arguments)
        jsonschema.validate(json.loads(got["arguments"]), PARAMS[got["name"]])


def test_tool_result_round_trip(server):
    first = chat(server, tools=TOOLS, tool_choice=NAMED, max_tokens=CALL_TOKENS, temperature=0.8, seed=4)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    check_call(call)
    history = ASK + [
        {
            "role": "assistant",
            "content": message.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
    ]
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})}

    # `with_raw_response` to see the status itself.
    raw = server.client().chat.completions.with_raw_response.create(
        model=server.model_id,
        messages=history + [result],
        tools=TOOLS,
        max_tokens=16,
        temperature=0.7,
        seed=4,
        extra_body={"ignore_eos": True},
    )
    assert raw.status_code == 200
    answer = raw.parse()
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str)
    # The call and its result are part of the prompt.
    without_result = chat(server, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens > without_result.usage.prompt_tokens > first.usage.prompt_tokens


# ---- response_format ------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_json_schema_output_validates(server, seed):
    r = chat(
        server,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=200,
        temperature=1.0,
        seed=seed,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content)
    jsonschema.validate(value, PERSON)


def test_json_schema_output_streamed_equals_non_streamed(server):
    kw = dict(
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=200,
        temperature=1.0,
        seed=9,
    )
    whole = chat(server, **kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(server, stream=True, **kw) if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


def test_json_object_output_parses(server):
    """`json_object` bounds nothing, so a random model may still be inside a string when
    `max_tokens` ends it: such output must be a prefix of a JSON object; finished output must
    parse as one. With this model (compact JSON), seeds 2, 7 and 8 finish within 300 tokens and
    seed 5 does not, so both paths are checked (at least one seed must finish)."""
    finished = 0
    for seed in (5, 2, 7, 8):
        r = chat(
            server,
            messages=[{"role": "user", "content": "Reply with a JSON object."}],
            response_format={"type": "json_object"},
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        choice = r.choices[0]
        text = choice.message.content
        assert text.lstrip().startswith("{"), text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
            finished += 1
        else:
            assert choice.finish_reason == "length"
            assert r.usage.completion_tokens == 300
            assert isinstance(json.loads(complete_json_prefix(text)), dict), text
    assert finished >= 1


def test_json_schema_on_text_completions(server):
    r = server.client().completions.create(
        model=server.model_id,
        prompt="A person, as JSON:",
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        max_tokens=200,
        temperature=1.0,
        seed=5,
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_bad_constraints_are_400(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model_id, messages=ASK, response_format={"type": "xml"}, max_tokens=4
        )
    assert e.value.param == "response_format.type"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model_id,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}},
            max_tokens=4,
        )
    assert e.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=ASK, tool_choice="required", max_tokens=4)
    assert e.value.param == "tool_choice"
