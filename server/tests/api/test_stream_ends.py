"""How every stream ends (docs/api.md, "How a stream ends"), read off the wire for chat and text
completions alike: a finished stream sends the chunk with `finish_reason`, the usage chunk when
asked for, then `data: [DONE]`; a stream that fails after it started sends one error event, then
`data: [DONE]`, and the OpenAI client raises the error."""

from __future__ import annotations

import openai
import pytest

from helpers import sse_events

ENDPOINTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say something."}]}),
    "completions": ("/v1/completions", {"prompt": "Say something:"}),
}

# Passes submission (its first tokens lead somewhere) and is unsatisfiable once "ab" is
# written: it fails in the engine, after the stream has started.
FAILS_LATER = 'start: "a" "b" x\nx: x'


def stream(server, endpoint: str, **fields) -> list:
    path, base = ENDPOINTS[endpoint]
    body = {"model": server.model_id, "stream": True, **base, **fields}
    with server.http().stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(r))


def finish_reason(event) -> str | None:
    choices = event.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def body_of(events: list) -> list:
    """The events before `[DONE]`, which must be the last event and the only one."""
    assert events and events[-1] == "[DONE]", events[-3:]
    assert events.count("[DONE]") == 1, events
    return events[:-1]


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_finished_stream_ends_with_its_finish_then_done(server, endpoint, include_usage):
    fields = {"max_tokens": 6, "temperature": 0.8, "seed": 5, "ignore_eos": True}
    if include_usage:
        fields["stream_options"] = {"include_usage": True}
    body = body_of(stream(server, endpoint, **fields))
    assert all("error" not in e for e in body), body
    finished = [i for i, e in enumerate(body) if finish_reason(e)]
    assert len(finished) == 1, body
    assert finish_reason(body[finished[0]]) == "length"
    if include_usage:
        # The finish, then the usage chunk, then [DONE].
        assert finished[0] == len(body) - 2, body
        assert body[-1]["choices"] == [] and body[-1]["usage"]["completion_tokens"] == 6
    else:
        assert finished[0] == len(body) - 1, body
        assert all("usage" not in e for e in body)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_stream_that_fails_in_the_engine_ends_with_an_error_then_done(server, endpoint):
    events = stream(
        server, endpoint, grammar=FAILS_LATER, max_tokens=16, temperature=0.8, seed=1,
        stream_options={"include_usage": True},
    )
    body = body_of(events)
    *before, last = body
    assert set(last) == {"error"}, body
    assert last["error"]["type"] == "invalid_request_error"
    assert "output constraint failed" in last["error"]["message"], last
    # Nothing before the error finished the choice or carried usage.
    assert all("error" not in e and not finish_reason(e) and not e.get("usage") for e in before), body
    server.wait_idle()


def test_the_openai_client_raises_on_a_failed_stream(server):
    client = server.client()
    chunks = client.completions.create(
        model=server.model_id, prompt="Say something:", stream=True, max_tokens=16, temperature=0.8,
        seed=1, extra_body={"grammar": FAILS_LATER},
    )
    with pytest.raises(openai.APIError, match="output constraint failed"):
        for _ in chunks:
            pass
