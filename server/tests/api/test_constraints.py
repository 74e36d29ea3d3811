"""A request's constraint cannot hurt the server or the requests beside it, and JSON constraints
cannot run away (issue 13, items 2, 3 and 7):

- a grammar or schema nested too deep (a Lark rule chain, a `$ref` chain, objects nested through
  `$ref`) or too large is a 400 naming the limit, and the server keeps serving;
- one that no output can satisfy is a 400 at submission, streamed or not;
- one that fails during generation ends its own request (400) while a request in flight beside
  it, in the same engine batch, completes normally;
- a forced tool call is compact and fits in 64 tokens on a committed fixture, whose template
  does not render tools (which the response says), and has `content: null`;
- on a real model (SmolLM2-135M-Instruct), a schema with an unbounded integer and a required
  tool call without `additionalProperties` come back valid well inside `max_tokens`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from helpers import sse_events
from test_structured import ASK, NAMED, TOOLS


def lark_chain(n: int) -> str:
    """`start: r1`, `r1: r2`, ..., a chain of `n` rules ending in a string."""
    lines = ["start: r1"] + [f"r{i}: r{i + 1}" for i in range(1, n - 1)] + [f'r{n - 1}: "x"']
    return "\n".join(lines) + "\n"


def ref_chain(n: int) -> dict:
    """`$ref` hops a0 -> a1 -> ... -> a{n-1}, an integer."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n - 1)}
    defs[f"a{n - 1}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def nested_objects(n: int) -> dict:
    """Objects nested `n` deep through `$ref`: {"c": {"c": ... {"c": 1}}}."""
    defs = {}
    for i in range(n):
        child = {"$ref": f"#/$defs/n{i + 1}"} if i + 1 < n else {"type": "integer"}
        defs[f"n{i}"] = {"type": "object", "properties": {"c": child}, "required": ["c"]}
    return {"$defs": defs, "$ref": "#/$defs/n0"}


def json_schema(schema: dict, **kw) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **kw}}


def post_chat(server, **body):
    body.setdefault("messages", ASK)
    body.setdefault("max_tokens", 8)
    return server.http().post("/v1/chat/completions", json=body)


def assert_serving(server):
    assert server.proc.poll() is None, f"the server exited:\n{server.log()}"
    r = post_chat(server, max_tokens=2, temperature=0)
    assert r.status_code == 200, r.text


DEEP = {
    "lark-rule-chain-750": ("grammar", {"grammar": lark_chain(750)}),
    "lark-parens-5000": ("grammar", {"grammar": "start: " + "(" * 5000 + '"a"' + ")" * 5000}),
    "ref-chain-1000": ("response_format", {"response_format": json_schema(ref_chain(1000))}),
    "objects-300-through-ref": ("response_format", {"response_format": json_schema(nested_objects(300))}),
    "tool-parameters-300-deep": (
        "tools",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": nested_objects(300)}}],
            "tool_choice": "required",
        },
    ),
}


@pytest.mark.parametrize("case", list(DEEP), ids=list(DEEP))
def test_deep_constraints_are_400_naming_the_limit_and_the_server_keeps_serving(request, case):
    param, fields = DEEP[case]
    # The demo template renders tools into the prompt, where 300 nested objects do not fit the
    # context; the fixture's template leaves them out.
    server = request.getfixturevalue("fixture_server" if param == "tools" else "server")
    r = post_chat(server, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert "MAX_CONSTRAINT_DEPTH" in err["message"] and "128" in err["message"], err["message"]
    assert_serving(server)


def test_oversized_constraint_is_400_naming_the_limit(server):
    r = post_chat(server, grammar='start: "' + "a" * (600 * 1024) + '"')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "grammar"
    assert "MAX_CONSTRAINT_BYTES" in err["message"], err["message"]
    assert_serving(server)


UNSATISFIABLE = {
    "start-start": ("grammar", {"grammar": "start: start"}),
    "self-ref-schema": ("response_format", {"response_format": json_schema({"$ref": "#"})}),
    "alternation-20000": ("grammar", {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20000))}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(UNSATISFIABLE), ids=list(UNSATISFIABLE))
def test_unsatisfiable_constraints_are_400_at_submission(server, case, stream):
    param, fields = UNSATISFIABLE[case]
    r = post_chat(server, stream=stream, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert "cannot produce an output" in err["message"], err["message"]
    assert_serving(server)


# Passes submission (its first tokens lead somewhere) and is unsatisfiable once "ab" is
# written: it fails in the engine, a token or two into the output.
FAILS_LATER = 'start: "a" "b" x\nx: x'


def test_a_constraint_failing_in_the_engine_ends_only_its_own_request(server):
    server.wait_idle()
    long = dict(
        model=server.model_id,
        messages=ASK,
        max_tokens=3000,
        temperature=0.8,
        seed=11,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    with server.http().stream("POST", "/v1/chat/completions", json=long) as a:
        assert a.status_code == 200
        events = sse_events(a)
        # A decodes: it has sent text.
        for e in events:
            assert e != "[DONE]", "the long request ended before the other was sent"
            if e["choices"] and e["choices"][0]["delta"].get("content"):
                break
        b = post_chat(server, grammar=FAILS_LATER, max_tokens=16, temperature=0.8, seed=1)
        assert b.status_code == 400, b.text
        assert "output constraint failed" in b.json()["error"]["message"], b.text
        # A was still running when B failed: B's whole life lay inside A's, in the same steps.
        assert server.metrics().get("coli_active_slots") >= 1, "the long request finished first"
        finish, usage = None, None
        for e in events:
            if e == "[DONE]":
                break
            assert "error" not in e, e
            if e["choices"] and e["choices"][0]["finish_reason"]:
                finish = e["choices"][0]["finish_reason"]
            if e.get("usage"):
                usage = e["usage"]
    assert finish == "length"
    assert usage["completion_tokens"] == 3000
    assert_serving(server)


# ---- forced tool calls on a committed fixture -------------------------------------------------

# The fixture's tokenizer (384 tokens, trained on English prose) spells JSON about a byte per
# token, so a call must be short to fit 64 tokens at all: `<tool_call>\n{"name":"switch",
# "arguments":{"on":true}}\n</tool_call>` is 66 bytes. Whitespace the grammar allowed between
# JSON tokens would have a random model pad it past the budget.
SWITCH_PARAMS = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
SMALL_TOOLS = [
    {"type": "function", "function": {"name": "switch", "parameters": SWITCH_PARAMS}},
    {"type": "function", "function": {"name": "ping"}},
]
SMALL_PARAMS = {"switch": {**SWITCH_PARAMS, "additionalProperties": False},
                "ping": {"type": "object", "additionalProperties": False}}
SWITCH = {"type": "function", "function": {"name": "switch"}}


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("tool_choice", [SWITCH, "required"], ids=["named", "required"])
def test_forced_tool_call_fits_in_64_tokens_on_a_fixture(fixture_server, tool_choice, seed):
    raw = fixture_server.client().chat.completions.with_raw_response.create(
        model=fixture_server.model_id,
        messages=ASK,
        tools=SMALL_TOOLS,
        tool_choice=tool_choice,
        max_tokens=64,
        temperature=1.0,
        seed=seed,
    )
    r = raw.parse()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, r.usage, choice.message)
    assert r.usage.completion_tokens <= 64
    (call,) = choice.message.tool_calls
    assert call.function.name in SMALL_PARAMS
    jsonschema.validate(json.loads(call.function.arguments), SMALL_PARAMS[call.function.name])
    # OpenAI sends `content: null` with a tool call, not "".
    body = json.loads(raw.text)
    assert body["choices"][0]["message"]["content"] is None
    # The fixture's ChatML template ignores `tools`: the response says so.
    (warning,) = body["warnings"]
    assert "does not render `tools`" in warning


def test_forced_tool_call_stream_has_no_content_and_carries_the_warning(fixture_server):
    body = dict(model=fixture_server.model_id, messages=ASK, tools=SMALL_TOOLS, tool_choice=SWITCH, max_tokens=64,
                temperature=1.0, seed=1, stream=True)
    with fixture_server.http().stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    first = chunks[0]
    assert first["choices"][0]["delta"] == {"role": "assistant"}, first
    assert "does not render `tools`" in first["warnings"][0]
    assert all("warnings" not in c for c in chunks[1:])
    assert not any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert len(calls) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SMALL_PARAMS["switch"])


def test_a_template_that_renders_tools_gives_no_warning(server):
    r = post_chat(server, tools=TOOLS, tool_choice=NAMED, max_tokens=256, temperature=0.8, seed=1)
    assert r.status_code == 200, r.text
    assert "warnings" not in r.json()


# ---- a real model: SmolLM2-135M-Instruct ------------------------------------------------------

# Measured with this model, greedy: without number bounds the population runs "1111…" to
# `max_tokens` (compact or not); without closed objects a tool call adds keys (`search`:
# "description", "type", …; `get_weather`: "temperature", "temperature_scale").
POPULATION = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


@pytest.mark.parametrize("closed", [False, True], ids=["open", "additionalProperties-false"])
def test_smollm2_unbounded_integer_schema_is_valid_well_inside_max_tokens(smollm2_server, closed):
    schema = {**POPULATION, "additionalProperties": False} if closed else POPULATION
    r = smollm2_server.client().chat.completions.create(
        model=smollm2_server.model_id,
        messages=[{"role": "user", "content": "What is the population of Paris? Answer in JSON."}],
        response_format=json_schema(schema),
        max_tokens=128,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", (r.usage, choice.message.content)
    value = json.loads(choice.message.content)
    jsonschema.validate(value, {**POPULATION, "additionalProperties": False})
    assert abs(value["population"]) < 10**16
    assert r.usage.completion_tokens <= 64, (r.usage, choice.message.content)


WEATHER_OPEN = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
SEARCH_OPEN = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                                  "parameters": WEATHER_OPEN}}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "description": "Search the web",
                                                 "parameters": SEARCH_OPEN}}
OPEN_PARAMS = {"get_weather": WEATHER_OPEN, "search": SEARCH_OPEN}


@pytest.mark.parametrize(
    "ask, tools",
    [
        # The ask names the action: "Find recent news about the Mars rover." sent greedy
        # SmolLM2-135M into a loop inside the query string ("search.twitter.com/search.twitter…"
        # until max_tokens) once attention's exp changed by a few ulps. The grammar allows any
        # string, so that is the model's answer, not a parser failure; this test checks that an
        # open schema's call comes back closed and parsed.
        ("Search the web for recent news about the Mars rover.", [SEARCH_TOOL]),
        ("What's the weather in Tokyo in fahrenheit?", [WEATHER_TOOL, SEARCH_TOOL]),
    ],
    ids=["search", "weather-or-search"],
)
def test_smollm2_required_tool_call_without_additional_properties_comes_back(smollm2_server, ask, tools):
    r = smollm2_server.client().chat.completions.create(
        model=smollm2_server.model_id,
        messages=[{"role": "user", "content": ask}],
        tools=tools,
        tool_choice="required",
        max_tokens=300,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (r.usage, choice.message)
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, {**OPEN_PARAMS[call.function.name], "additionalProperties": False})
    assert choice.message.content is None
    assert r.usage.completion_tokens <= 100, r.usage
