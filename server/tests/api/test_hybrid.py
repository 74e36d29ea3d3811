"""A hybrid linear-attention model (the committed Qwen3.5/3.6 MoE fixture: Gated DeltaNet
layers whose state is a fixed-size recurrence, beside gated attention) through `coli serve`:
greedy decoding gives transformers' reference continuation; a request that extends the
previous one's prompt and output reuses the slot's state (from its end-of-turn checkpoint) and
gives exactly what a fresh server gives, and so does a request that branches off before every
checkpoint; concurrent requests get exactly their solo tokens, in fewer engine steps."""

from __future__ import annotations

import json

import pytest

from helpers import REPO, batched_equals_solo

FIXTURE = REPO / "engine" / "tests" / "fixtures" / "qwen3_5_moe"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
PROMPT = REFERENCE["prompt_ids"]
GREEDY = REFERENCE["greedy_ids"]


@pytest.fixture(scope="module")
def hybrid_server(start_server):
    return start_server("--slots", "4", "--drain-secs", "5", name="hybrid", model=FIXTURE)


@pytest.fixture(scope="module")
def fresh_server(start_server):
    """Another server on the same model, used once per request: nothing cached."""
    return start_server("--slots", "4", "--drain-secs", "5", name="hybrid-fresh", model=FIXTURE)


def complete(server, prompt, max_tokens, **kw):
    with server.http() as c:
        r = c.post(
            "/v1/completions",
            json={
                "model": server.model_id,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": kw.pop("temperature", 0),
                "ignore_eos": True,
                **kw,
            },
        )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]


def test_hybrid_greedy_decoding_is_the_reference_continuation(hybrid_server):
    text, usage = complete(hybrid_server, PROMPT, len(GREEDY))
    assert usage["completion_tokens"] == len(GREEDY)
    assert text == REFERENCE["greedy_text"]


def test_hybrid_follow_up_reuses_the_state_and_matches_a_fresh_server(hybrid_server, fresh_server):
    hybrid_server.wait_idle()
    first, _ = complete(hybrid_server, PROMPT, 8)
    # The slot ran the prompt and 7 of the 8 tokens (the last one is never fed back); the
    # follow-up extends prompt + output with more tokens.
    follow_up = PROMPT + GREEDY[:8] + PROMPT[:5]
    text, usage = complete(hybrid_server, follow_up, 10)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(PROMPT) + 7, usage
    fresh_text, fresh_usage = complete(fresh_server, follow_up, 10)
    assert fresh_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert text == fresh_text

    # A prompt that leaves the cached one before every checkpoint starts from the zero state.
    branch = PROMPT[:20] + [t ^ 1 for t in PROMPT[20:30]]
    text, usage = complete(hybrid_server, branch, 10)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    assert text == complete(fresh_server, branch, 10)[0]


def test_hybrid_concurrent_requests_get_their_solo_tokens(hybrid_server):
    n = 4
    prompts = [PROMPT[i * 3 :] + PROMPT[: i * 3] for i in range(n)]

    def request(i):
        return complete(hybrid_server, prompts[i], 16, temperature=0.8, seed=500 + i)[0]

    alone, _, _ = batched_equals_solo(hybrid_server, request, n)
    assert len(set(alone)) == n
