"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` SDK, and vLLM's `/tokenize` and `/detokenize`.

The model has random weights: answers are checked for their shape, for agreeing with each
other (streamed and not, counted and generated) and, where a tool call is forced by the grammar,
for validating against the tool's schema.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from helpers import API_KEY, wait_until

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA},
    {
        "name": "get_time",
        "description": "Current time in a time zone",
        "input_schema": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "enum": ["UTC", "Asia/Tokyo"]}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
# Enough for a forced call with bounded strings.
CALL_TOKENS = 256

EVENT_TYPES = {
    "message_start",
    "content_block_start",
    "ping",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


def client(server, api_key: str = "unused") -> anthropic.Anthropic:
    """An Anthropic client of `server` that never retries (429 and 5xx must reach the test)."""
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=120.0)


def sdk_kwargs(kw: dict) -> dict:
    """`kw` as the SDK takes it: the sampling fields its typed parameters no longer list go in
    `extra_body` (the API still has them)."""
    kw = dict(kw)
    extra = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    if extra:
        kw["extra_body"] = {**kw.get("extra_body", {}), **extra}
    return kw


def create(server, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 16)
    return client(server).messages.create(model=server.model_id, **sdk_kwargs(kw))


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def check_message(m, server):
    assert m.id.startswith("msg_"), m.id
    assert m.type == "message" and m.role == "assistant"
    assert m.model == server.model_id
    assert m.usage.input_tokens > 0
    for b in m.content:
        assert b.type in ("text", "thinking", "tool_use"), b


def raw_stream(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """The `(event, data)` pairs of a streamed message, read off the wire."""
    pairs = []
    with server.http() as http, http.stream(
        "POST", "/v1/messages", json={**body, "stream": True}, headers=headers or {}
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[len("event:"):].strip()
            elif line.startswith("data:"):
                assert event is not None, f"data without an event name: {line}"
                pairs.append((event, json.loads(line[len("data:"):])))
                event = None
    return pairs


def check_event_order(pairs: list[tuple[str, dict]]) -> dict:
    """Check Anthropic's event grammar and return the message the events add up to."""
    names = [e for e, _ in pairs]
    for name, data in pairs:
        assert name in EVENT_TYPES, name
        assert data["type"] == name, (name, data)
    assert names[0] == "message_start", names
    assert names[-1] == "message_stop", names
    assert names[-2] == "message_delta", names
    assert names.count("message_start") == names.count("message_delta") == names.count("message_stop") == 1
    message = pairs[0][1]["message"]
    assert message["content"] == [] and message["stop_reason"] is None
    open_index = None
    partial_json = ""
    for name, data in pairs[1:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_index is None, "a block started while another was open"
            assert data["index"] == len(message["content"])
            open_index = data["index"]
            message["content"].append(data["content_block"])
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = message["content"][-1], data["delta"]
            if delta["type"] == "text_delta":
                assert block["type"] == "text"
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                assert block["type"] == "thinking"
                block["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use", (block, delta)
                partial_json += delta["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index, (name, data)
            open_index = None
            if message["content"][-1]["type"] == "tool_use":
                message["content"][-1]["input"] = json.loads(partial_json)
                partial_json = ""
    assert open_index is None, "a block was left open"
    delta = pairs[-2][1]
    message["stop_reason"] = delta["delta"]["stop_reason"]
    message["stop_sequence"] = delta["delta"]["stop_sequence"]
    message["usage"]["output_tokens"] = delta["usage"]["output_tokens"]
    return message


# ---- messages -------------------------------------------------------------------------------


def test_a_message(server):
    m = create(server, max_tokens=8, temperature=0, system="You are terse.")
    check_message(m, server)
    assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason
    assert 1 <= m.usage.output_tokens <= 8
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 8
    assert m.stop_sequence is None


def test_max_tokens_is_lowered_to_the_cap(cap8_server):
    m = create(cap8_server, max_tokens=64000, temperature=0)
    assert m.usage.output_tokens <= 8
    assert m.stop_reason in ("end_turn", "max_tokens")


def test_a_stop_sequence_ends_the_message_and_is_named(server):
    whole = create(server, max_tokens=24, temperature=0)
    text = text_of(whole)
    # A piece of the greedy answer's middle, not at its start: the same request stopped by it
    # ends just before it.
    words = [w for w in text.split() if len(w) >= 2]
    assert len(words) >= 3, f"the greedy answer is too short to cut: {text!r}"
    stop = words[len(words) // 2]
    m = create(server, max_tokens=24, temperature=0, stop_sequences=[stop, "unlikely-stop-§"])
    assert m.stop_reason == "stop_sequence", m
    assert m.stop_sequence == stop
    assert text_of(m).strip() == text[: text.index(stop)].strip()
    assert m.usage.output_tokens < whole.usage.output_tokens


def test_a_streamed_message_has_anthropics_events_in_order(server):
    kw = dict(max_tokens=12, temperature=0, messages=ASK)
    whole = create(server, **kw)
    pairs = raw_stream(server, {"model": server.model_id, **kw})
    streamed = check_event_order(pairs)
    assert streamed["id"].startswith("msg_")
    assert streamed["content"] == [b.model_dump(exclude_none=True) for b in whole.content]
    assert streamed["stop_reason"] == whole.stop_reason
    assert streamed["usage"]["input_tokens"] == whole.usage.input_tokens
    assert streamed["usage"]["output_tokens"] == whole.usage.output_tokens

    # The SDK's own stream helper accumulates the same message.
    with client(server).messages.stream(model=server.model_id, **sdk_kwargs(kw)) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


# ---- tools ----------------------------------------------------------------------------------


def tool_uses(message):
    return [b for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize(
    "choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}], ids=["tool", "any"]
)
def test_a_forced_tool_use_round_trip(server, choice):
    first = create(server, tools=TOOLS, tool_choice=choice, max_tokens=CALL_TOKENS, temperature=0.8)
    check_message(first, server)
    assert first.stop_reason == "tool_use", first
    calls = tool_uses(first)
    assert len(calls) == 1, first.content
    call = calls[0]
    assert call.id.startswith("toolu_"), call.id
    if choice["type"] == "tool":
        assert call.name == "get_weather"
    schema = {t["name"]: t["input_schema"] for t in TOOLS}[call.name]
    assert isinstance(call.input, dict)
    jsonschema.validate(call.input, schema)

    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}]
    result = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps({"temperature_c": 21})},
        ],
    }
    answer = create(server, messages=history + [result], tools=TOOLS, max_tokens=8, temperature=0.7)
    check_message(answer, server)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    # The call and its result are part of the prompt.
    assert answer.usage.input_tokens > first.usage.input_tokens
    counted = client(server).messages.count_tokens(
        model=server.model_id, messages=history + [result], tools=TOOLS
    )
    assert counted.input_tokens == answer.usage.input_tokens
    without_result = client(server).messages.count_tokens(model=server.model_id, messages=history, tools=TOOLS)
    assert answer.usage.input_tokens > without_result.input_tokens


def test_a_streamed_tool_use_carries_its_input_as_json_deltas(server):
    body = {
        "model": server.model_id,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "max_tokens": CALL_TOKENS,
        "temperature": 0.8,
    }
    message = check_event_order(raw_stream(server, body))
    assert message["stop_reason"] == "tool_use"
    calls = [b for b in message["content"] if b["type"] == "tool_use"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert calls[0]["id"].startswith("toolu_")
    jsonschema.validate(calls[0]["input"], WEATHER_SCHEMA)


# ---- count_tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_tools", [False, True], ids=["plain", "tools"])
def test_count_tokens_equals_the_messages_input_tokens(server, with_tools):
    kw: dict = dict(
        system=[{"type": "text", "text": "You are terse."}],
        messages=ASK
        + [
            {"role": "assistant", "content": [{"type": "text", "text": "Which Paris?"}]},
            {"role": "user", "content": "France."},
        ],
    )
    if with_tools:
        kw.update(tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    counted = client(server).messages.count_tokens(model=server.model_id, **kw)
    m = create(server, max_tokens=CALL_TOKENS if with_tools else 1, temperature=0, **kw)
    assert counted.input_tokens == m.usage.input_tokens > 0


# ---- auth and errors ------------------------------------------------------------------------


def test_x_api_key_is_accepted_and_a_missing_key_is_a_401_in_anthropics_shape(auth_server):
    # The SDK sends the key as `x-api-key`.
    m = client(auth_server, api_key=API_KEY).messages.create(model=auth_server.model_id, max_tokens=2, messages=ASK)
    assert m.usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(auth_server, api_key="wrong-" + API_KEY).messages.create(
            model=auth_server.model_id, max_tokens=2, messages=ASK
        )
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    body = {"model": auth_server.model_id, "max_tokens": 2, "messages": ASK}
    with auth_server.http() as http:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = http.post(path, json=body)
            assert r.status_code == 401, r.text
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
            assert "x-api-key" in r.json()["error"]["message"]
        # Bearer works as well, and so does x-api-key on the OpenAI and tokenizer routes.
        r = http.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        r = http.post("/tokenize", json={"prompt": "Hi"}, headers={"x-api-key": API_KEY})
        assert r.status_code == 200, r.text
        r = http.post("/tokenize", json={"prompt": "Hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error", body
    assert set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_bad_requests_are_400s_in_anthropics_shape(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(server, max_tokens=0)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    ok = {"model": server.model_id, "max_tokens": 4, "messages": ASK}
    cases = [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, "max_tokens"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        ({**ok, "messages": [{"role": "system", "content": "Hi"}]}, "messages[0].role"),
        ({**ok, "temperature": 7}, "temperature"),
        ({**ok, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        ({**ok, "stop_sequences": [""]}, "stop_sequences"),
        ({**ok, "messages": []}, "messages"),
    ]
    with server.http() as http:
        for body, field in cases:
            message = anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
            assert field in message, (field, message)
        anthropic_error(http.post("/v1/messages", content=b"{not json"), 400, "invalid_request_error")
        message = anthropic_error(
            http.post("/v1/messages", json={**ok, "model": "claude-nope"}), 404, "not_found_error"
        )
        assert "claude-nope" in message
        anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
        anthropic_error(http.post("/v1/messages/nope", json=ok), 404, "not_found_error")
        anthropic_error(http.post("/v1/messages/count_tokens", json={"model": server.model_id}), 400, "invalid_request_error")


def test_a_body_over_the_limit_is_request_too_large(limits_server):
    body = {"model": limits_server.model_id, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 8000}]}
    with limits_server.http() as http:
        anthropic_error(http.post("/v1/messages", json=body), 413, "request_too_large")


def test_a_server_that_cannot_serve_is_overloaded_529(start_server):
    s = start_server(
        "--stay-up-on-load-failure", "--drain-secs", "2", env={"COLI_TEST_LOAD_PANIC": "1"},
        name="anthropic-529", wait_ready=False,
    )

    def failed():
        r = httpx.get(s.url + "/ready", timeout=5)
        return r.status_code == 503 and "failed to load" in r.json()["error"]["message"]

    wait_until(failed, 60, "/ready to report the failed load")
    body = {"model": "any", "max_tokens": 4, "messages": ASK}
    with s.http() as http:
        message = anthropic_error(http.post("/v1/messages", json={**body, "model": ""}), 529, "overloaded_error")
        assert "failed to load" in message
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
        assert r.status_code == 503


# ---- /tokenize and /detokenize --------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(server):
    text = "Hello, world! Ünïcödé and  spaces."
    with server.http() as http:
        r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) > 0
        assert body["max_model_len"] > 0
        r = http.post("/detokenize", json={"tokens": body["tokens"]})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": text}
        # With the special tokens (the default), a prompt tokenizes as /v1/completions does.
        with_specials = http.post("/tokenize", json={"prompt": text, "model": server.model_id}).json()
        completion = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
        assert with_specials["count"] == completion["usage"]["prompt_tokens"]
        # A conversation tokenizes as its chat prompt.
        chat = client(server).messages.count_tokens(model=server.model_id, messages=ASK)
        r = http.post("/tokenize", json={"messages": ASK})
        assert r.status_code == 200, r.text
        assert r.json()["count"] == chat.input_tokens
        openai_chat = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1}).json()
        assert r.json()["count"] == openai_chat["usage"]["prompt_tokens"]


def test_bad_tokenize_and_detokenize_requests_are_400s_naming_the_field(server):
    with server.http() as http:
        r = http.post("/detokenize", json={"tokens": [1, 10**9]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tokens[1]"
        r = http.post("/detokenize", json={"tokens": [1, -3]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tokens[1]"
        r = http.post("/detokenize", json={})
        assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
        r = http.post("/tokenize", json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = http.post("/tokenize", json={"prompt": "a", "messages": ASK})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = http.post("/tokenize", json={"prompt": "a", "model": "nope"})
        assert r.status_code == 404
