"""Errors in OpenAI's shape with the right status: 401 (API key), 400 naming the field,
400 for a prompt over the context (with the numbers), 404 (model), 413 (body), 429 (queue)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from helpers import API_KEY, wait_until

HI = [{"role": "user", "content": "Hi"}]


def error_body(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


# ---- 401 ------------------------------------------------------------------------------------


def test_missing_api_key_is_401(auth_server):
    with auth_server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        err = error_body(r)
        assert err["type"] == "authentication_error"
        assert err["code"] == "invalid_api_key"
        assert r.status_code == http.get("/v1/models").status_code == 401


def test_wrong_api_key_is_401(auth_server):
    client = auth_server.client(api_key="wrong-" + API_KEY)
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model=auth_server.model_id, messages=HI, max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # A key that is a prefix of the right one is wrong too.
    with pytest.raises(openai.AuthenticationError):
        auth_server.client(api_key=API_KEY[:-1]).models.list()


def test_right_api_key_is_200(auth_server):
    client = auth_server.client(api_key=API_KEY)
    r = client.chat.completions.create(model=auth_server.model_id, messages=HI, max_tokens=2, temperature=0)
    assert r.choices[0].message.content is not None
    assert [m.id for m in client.models.list().data] == [auth_server.model_id]
    # `x-api-key` works as well.
    with auth_server.http() as http:
        assert http.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200


def test_the_bearer_scheme_is_case_insensitive(auth_server):
    with auth_server.http() as http:
        for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
            r = http.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
            assert r.status_code == 200, (scheme, r.text)
        r = http.get("/v1/models", headers={"Authorization": f"bearer wrong-{API_KEY}"})
        assert r.status_code == 401 and error_body(r)["message"] == "invalid API key"
        # Another scheme is no key at all.
        r = http.get("/v1/models", headers={"Authorization": f"Basic {API_KEY}"})
        assert r.status_code == 401 and "missing API key" in error_body(r)["message"]


def test_no_api_key_on_a_public_address_is_warned_about_once(start_server):
    s = start_server("--slots", "1", "--drain-secs", "2", host="0.0.0.0", name="public")
    warnings = [line for line in s.lines if "without an API key" in line]
    assert len(warnings) == 1, s.log()
    assert "0.0.0.0" in warnings[0] and "--api-key" in warnings[0]


def test_health_and_metrics_need_no_key(auth_server):
    with auth_server.http() as http:
        r = http.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert http.get("/ready").status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/openapi.json").status_code == 200


# ---- 400 ------------------------------------------------------------------------------------


LONG = "The quick brown fox jumps over the lazy dog near the quiet river bank. " * 6


def test_prompt_over_the_context_is_400_with_the_numbers(server, limits_server):
    messages = [{"role": "user", "content": LONG}]
    # The same prompt's length, measured on a server with room for it.
    n = server.client().chat.completions.create(
        model=server.model_id, messages=messages, max_tokens=1
    ).usage.prompt_tokens
    assert n > 64
    client = limits_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=limits_server.model_id, messages=messages, max_tokens=4)
    err = e.value
    assert err.status_code == 400
    assert err.code == "context_length_exceeded"
    assert err.param == "messages"
    assert f"{n} tokens" in err.message
    assert "64 tokens" in err.message
    assert err.body["type"] == "invalid_request_error"


def test_prompt_over_the_context_on_completions(server, limits_server):
    n = server.client().completions.create(model=server.model_id, prompt=LONG, max_tokens=1).usage.prompt_tokens
    assert n > 64
    with pytest.raises(openai.BadRequestError) as e:
        limits_server.client().completions.create(model=limits_server.model_id, prompt=LONG, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    assert e.value.param == "prompt"
    assert f"{n} tokens" in e.value.message and "64 tokens" in e.value.message


def test_generation_stops_at_the_context(limits_server):
    # A short prompt asking for more than the context holds: cut at the context, not refused.
    r = limits_server.client().completions.create(
        model=limits_server.model_id, prompt="Hello", max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 64


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", 5, "temperature"),
        ("temperature", -0.5, "temperature"),
        ("n", 2, "n"),
        ("top_p", 0, "top_p"),
        ("presence_penalty", 3, "presence_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("max_tokens", 0, "max_tokens"),
        ("max_completion_tokens", -1, "max_completion_tokens"),
        ("top_logprobs", 3, "top_logprobs"),  # without logprobs: true
        ("stop", [""], "stop"),
        ("messages", [], "messages"),
        ("messages", [{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ("temperature", "hot", "temperature"),
    ],
)
def test_bad_field_is_400_naming_it(server, field, value, param):
    body = {"model": server.model_id, "messages": HI, "max_tokens": 2, field: value}
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = error_body(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err


def test_bad_values_through_the_openai_client(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=HI, temperature=5)
    assert e.value.param == "temperature"
    assert "5" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=HI, n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model_id, prompt="x", logprobs=21)
    assert e.value.param == "logprobs"


def test_max_tokens_over_the_cap_is_400(cap8_server):
    with pytest.raises(openai.BadRequestError) as e:
        cap8_server.client().chat.completions.create(model=cap8_server.model_id, messages=HI, max_tokens=9)
    assert e.value.param == "max_tokens"
    assert "8" in e.value.message
    # Without max_tokens the cap is the default.
    r = cap8_server.client().chat.completions.create(
        model=cap8_server.model_id, messages=HI, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8


def test_completions_default_max_tokens_respects_the_cap(cap8_server):
    # OpenAI's default for /v1/completions is 16; a request that does not ask for more than the
    # server allows must not be refused for it.
    r = cap8_server.client().completions.create(
        model=cap8_server.model_id, prompt="Hello", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length"


def test_malformed_json_is_400(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert error_body(r)["type"] == "invalid_request_error"


def test_anything_after_the_json_body_is_400(server):
    body = json.dumps({"model": server.model_id, "messages": HI, "max_tokens": 1}).encode()
    bodies = {
        "/v1/chat/completions": body,
        "/v1/completions": json.dumps({"model": server.model_id, "prompt": "x", "max_tokens": 1}).encode(),
    }
    json_type = {"content-type": "application/json"}
    with server.http() as http:
        for path, request in bodies.items():
            for junk in (b"GARBAGE", b"{}", b" 1", b"\n]"):
                r = http.post(path, content=request + junk, headers=json_type)
                assert r.status_code == 400, (path, junk, r.text)
                err = error_body(r)
                assert err["type"] == "invalid_request_error"
                assert "trailing characters" in err["message"], err
        # Trailing whitespace is JSON.
        r = http.post("/v1/chat/completions", content=body + b" \r\n\t\n", headers=json_type)
        assert r.status_code == 200, r.text


def test_a_text_part_without_text_names_the_field(server):
    body = {"model": server.model_id, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = error_body(r)
        assert err["param"] == "messages[0].content[0].text", err
        assert "`text`" in err["message"] and "not supported" not in err["message"], err
        # A part of another type is refused as unsupported, naming its type.
        body["messages"][0]["content"] = [{"type": "text", "text": "Hi"}, {"type": "image_url"}]
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        err = error_body(r)
        assert err["param"] == "messages[0].content[1]" and "`image_url`" in err["message"], err


# ---- 404, 405 -------------------------------------------------------------------------------


def test_unknown_model_is_404(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=HI, max_tokens=2)
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"
    assert e.value.param == "model"
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_a_model_path_that_does_not_decode_gets_an_openai_error(server):
    with server.http() as http:
        r = http.get("/v1/models/%ff%fe")
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = error_body(r)
    assert err["type"] == "invalid_request_error" and err["param"] == "model", err
    assert "UTF-8" in err["message"], err


def test_unknown_route_is_404_and_wrong_method_405(server):
    with server.http() as http:
        r = http.get("/v1/nothing-here")
        assert r.status_code == 404
        assert error_body(r)["type"] == "not_found_error"
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405
        error_body(r)


# ---- 413 ------------------------------------------------------------------------------------


def test_body_over_max_body_bytes_is_413(limits_server):
    big = [{"role": "user", "content": "a" * 8000}]
    with limits_server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": big, "max_tokens": 2})
    assert r.status_code == 413
    err = error_body(r)
    assert err["type"] == "invalid_request_error"
    assert "max_body_bytes" in err["message"]
    with pytest.raises(openai.APIStatusError) as e:
        limits_server.client().chat.completions.create(model=limits_server.model_id, messages=big, max_tokens=2)
    assert e.value.status_code == 413
    # Just under the limit is parsed (and then refused for the context, not the size).
    with limits_server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 3000}]})
    assert r.status_code == 400
    assert error_body(r)["code"] == "context_length_exceeded"


# ---- 429 ------------------------------------------------------------------------------------


def test_queue_full_is_429_with_retry_after(queue_server):
    s = queue_server
    s.wait_idle()
    client = s.client()
    long = dict(model=s.model_id, max_tokens=4000, temperature=0.8, seed=1, stream=True, extra_body={"ignore_eos": True})
    first = client.completions.create(prompt="first", **long)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    second = None
    try:
        # The first one is generating: it holds the only slot.
        chunk = next(iter(first))
        assert chunk.choices[0].text is not None
        assert s.metrics().get("coli_active_slots") == 1
        # A stream's response starts when a slot takes the request, so the second one waits
        # (in a thread) in the one queue place.
        second = pool.submit(client.completions.create, prompt="second", **long)
        wait_until(lambda: s.metrics().get("coli_queue_depth") == 1, 10, "the second request to queue")
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=s.model_id, prompt="third", max_tokens=4)
        err = e.value
        assert err.status_code == 429
        assert err.code == "queue_full"
        assert err.body["type"] == "rate_limit_error"
        retry_after = err.response.headers.get("retry-after")
        assert retry_after is not None and int(retry_after) >= 1
        # Chat is refused the same way.
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=s.model_id, messages=HI, max_tokens=4)
        m = s.metrics()
        assert m.get("coli_requests_total", endpoint="/v1/completions", status="429") >= 1
    finally:
        first.close()
        if second is not None:
            # The first left, so the second got the slot and its stream started.
            second.result(timeout=60).close()
        pool.shutdown()
    # Both clients left: the slot and the queue empty, and the server serves again.
    s.wait_idle()
    r = client.completions.create(model=s.model_id, prompt="after", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def test_a_stream_that_never_gets_a_slot_is_a_real_503(start_server):
    """A streamed request that times out in the queue gets HTTP 503 with Retry-After (its
    response is held until a slot takes it), not a 200 with an error event."""
    s = start_server(
        "--slots", "1", "--queue-timeout-secs", "1", "--max-tokens-cap", "4000", "--drain-secs", "5",
        name="qtimeout",
    )
    client = s.client().with_options(max_retries=0)
    long = dict(model=s.model_id, max_tokens=4000, temperature=0.8, seed=1, stream=True, extra_body={"ignore_eos": True})
    first = client.completions.create(prompt="first", **long)
    try:
        assert next(iter(first)).choices[0].text is not None
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=s.model_id, messages=HI, max_tokens=4, stream=True)
        assert e.value.status_code == 503
        assert "slot" in e.value.message
        assert int(e.value.response.headers["retry-after"]) >= 1
        m = s.metrics()
        assert m.get("coli_requests_total", endpoint="/v1/chat/completions", status="503") == 1
    finally:
        first.close()
