"""The scheduler seen through the API: batching does not change tokens, a departed client
frees its slot, a follow-up turn reuses the slot's KV (with the exact row count), and SIGTERM
drains in-flight streams and exits 0."""

from __future__ import annotations

import json
import socket

import signal
import subprocess
import time

import httpx

from helpers import REPO, batched_equals_solo, sse_events, wait_until

IGNORE_EOS = {"ignore_eos": True}


# ---- batching -------------------------------------------------------------------------------


def test_concurrent_clients_get_the_tokens_they_get_alone(server):
    """8 clients on 4 slots, each with its own seed and prompt: batched output == solo output."""
    n = 8

    def request(i):
        r = server.client().chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": f"Client {i}: tell me something about the number {i * 7}."}],
            max_tokens=32,
            temperature=0.8,
            seed=1000 + i,
            logprobs=True,
            extra_body=IGNORE_EOS,
        )
        tokens = [t.token for t in r.choices[0].logprobs.content]
        return r.choices[0].message.content, tokens, r.usage.completion_tokens

    alone, _, _ = batched_equals_solo(server, request, n)
    assert all(a[2] == 32 for a in alone)
    assert len({a[0] for a in alone}) == n, "distinct seeds and prompts should give distinct texts"


def test_deepseek_v4_concurrent_requests_get_their_solo_tokens(start_server):
    """DeepSeek-V4 (hyper-connection streams, compressed attention, hash-routed layers) batched
    through `coli serve`: 4 concurrent requests get exactly the tokens each gets alone, in fewer
    engine steps."""
    fixture = REPO / "engine" / "tests" / "fixtures" / "deepseek_v4"
    s = start_server("--slots", "4", "--drain-secs", "5", name="v4", model=fixture)
    prompt = json.loads((fixture / "reference.json").read_text())["prompt_ids"]

    def request(i):
        with s.http() as c:
            r = c.post(
                "/v1/completions",
                json={"model": s.model_id, "prompt": prompt[i * 4 :] + prompt[: i * 4], "max_tokens": 32,
                      "temperature": 0.8, "seed": 70 + i, "ignore_eos": True},
            )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    alone, _, _ = batched_equals_solo(s, request, 4)
    assert len(set(alone)) == 4


# ---- cancellation ---------------------------------------------------------------------------


def test_cancelled_client_frees_its_slot(server):
    server.wait_idle()
    before = server.metrics()
    max_tokens = 4000
    stream = server.client().completions.create(
        model=server.model_id,
        prompt="Tell me a very long story.",
        max_tokens=max_tokens,
        temperature=0.8,
        seed=1,
        stream=True,
        extra_body=IGNORE_EOS,
    )
    first = next(iter(stream))
    assert first.choices[0].text is not None
    assert server.metrics().get("coli_active_slots") == 1
    stream.close()

    wait_until(lambda: server.metrics().get("coli_active_slots") == 0, 20, "the slot to be freed")
    after = server.metrics()
    rows = after.get("coli_engine_rows_total") - before.get("coli_engine_rows_total")
    # Far fewer rows than the whole request (prompt + 3999 decode rows) would have run.
    assert 0 < rows < max_tokens - 1, rows
    # A cancelled request is not counted as generated tokens of a finished one.
    assert after.get("coli_generated_tokens_total") == before.get("coli_generated_tokens_total")

    r = server.client().chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": "Still there?"}], max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_cancelled_queued_request_leaves_the_queue(queue_server):
    s = queue_server
    s.wait_idle()
    client = s.client()
    long = dict(model=s.model_id, max_tokens=4000, temperature=0.8, seed=2, stream=True, extra_body=IGNORE_EOS)
    first = client.completions.create(prompt="first", **long)
    next(iter(first))
    # The second waits for the slot; its response has not started, so the client leaving is
    # a closed socket.
    host, port = s.url.removeprefix("http://").split(":")
    body = json.dumps({"model": s.model_id, "prompt": "second", "max_tokens": 4000, "stream": True}).encode()
    second = socket.create_connection((host, int(port)))
    second.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: s.metrics().get("coli_queue_depth") == 1, 10, "the second request to queue")
    second.close()
    wait_until(lambda: s.metrics().get("coli_queue_depth") == 0, 10, "the departed request to leave the queue")
    first.close()
    s.wait_idle(20)
    r = client.completions.create(model=s.model_id, prompt="third", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


# ---- prefix reuse ---------------------------------------------------------------------------


def test_second_turn_reuses_the_first_turns_kv(server):
    """Rows the engine runs for a request: the prompt tokens not reused from the slot's cache
    (prefill), then one row per decode step. The first generated token comes from the prefill's
    logits and the last one is never fed back, so `n` generated tokens take `n - 1` decode rows
    (with ignore_eos, finishing on length):  rows = (prompt - cached) + (completion - 1)."""
    server.wait_idle()
    client = server.client()
    m = 12
    turn1 = [
        {"role": "system", "content": "You are a terse assistant who answers in one line."},
        {"role": "user", "content": "Name three colours of the evening sky over the harbour."},
    ]
    rows0 = server.metrics().get("coli_engine_rows_total")
    r1 = client.chat.completions.create(
        model=server.model_id, messages=turn1, max_tokens=m, temperature=0, extra_body=IGNORE_EOS
    )
    rows1 = server.metrics().get("coli_engine_rows_total")
    u1 = r1.usage
    assert u1.completion_tokens == m and r1.choices[0].finish_reason == "length"
    assert rows1 - rows0 == (u1.prompt_tokens - u1.prompt_tokens_details.cached_tokens) + (m - 1)

    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And three animals that live there?"},
    ]
    cached0 = server.metrics().get("coli_cached_prompt_tokens_total")
    r2 = client.chat.completions.create(
        model=server.model_id, messages=turn2, max_tokens=m, temperature=0, extra_body=IGNORE_EOS
    )
    after = server.metrics()
    u2 = r2.usage
    cached = u2.prompt_tokens_details.cached_tokens
    assert u2.prompt_tokens > u1.prompt_tokens
    assert cached > 0
    # The whole first prompt is a prefix of the second one, and its slot still holds it.
    assert u1.prompt_tokens <= cached < u2.prompt_tokens
    assert after.get("coli_engine_rows_total") - rows1 == (u2.prompt_tokens - cached) + (u2.completion_tokens - 1)
    assert after.get("coli_cached_prompt_tokens_total") - cached0 == cached


# ---- SIGTERM --------------------------------------------------------------------------------


def not_admitted(url: str) -> bool:
    """Whether a new request is refused with 503 and Retry-After (the server keeps listening
    while it drains, so load balancers see it leave)."""
    r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
    return r.status_code == 503 and "retry-after" in r.headers


def test_sigterm_drains_streams_and_exits_zero(start_server):
    drain = 2
    s = start_server("--drain-secs", str(drain), "--slots", "2", name="drain")
    body = {
        "model": s.model_id,
        "prompt": "A story that goes on and on:",
        "max_tokens": 4000,
        "temperature": 0.8,
        "seed": 3,
        "stream": True,
        "ignore_eos": True,
    }
    events: list = []
    with httpx.Client(base_url=s.url, timeout=httpx.Timeout(30.0)) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            it = sse_events(response)
            events.append(next(it))
            assert "choices" in events[0]
            s.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # Draining: new requests get 503, /ready is 503, /health says so.
            wait_until(lambda: not_admitted(s.url), drain, "new requests to be refused")
            assert httpx.get(s.url + "/ready", timeout=5).status_code == 503
            assert httpx.get(s.url + "/health", timeout=5).json() == {"status": "draining"}
            for e in it:
                events.append(e)
    ended = [e for e in events if e != "[DONE]"]
    last = ended[-1]
    finished = "choices" in last and last["choices"] and last["choices"][0]["finish_reason"] is not None
    failed = "error" in last
    assert finished or failed, last
    print("SIGTERM stream end:", len(ended), "events; last:", last)
    if failed:
        assert last["error"]["message"]
        assert last["error"]["type"] == "service_unavailable"
    # At most one [DONE], and nothing after it.
    assert events.count("[DONE]") <= 1
    assert "[DONE]" not in events[:-1]
    # Tokens kept flowing until the end: more than the first chunk arrived.
    assert len(ended) > 1
    try:
        code = s.proc.wait(timeout=max(0.0, drain + 5 - (time.monotonic() - signalled)))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"coli serve did not exit within {drain + 5} s of SIGTERM:\n{s.log()}")
    assert code == 0, s.log()
    wait_until(lambda: any("coli: stopped" in line for line in s.lines), 5, "the `stopped` line")
