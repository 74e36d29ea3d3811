"""The families added with issues 15 and 16 through `coli serve`: the hybrid linear-attention
Qwen3.5/3.6 MoE (Gated DeltaNet layers: a fixed-size recurrence beside gated attention), gpt-oss
(sliding-window layers beside full ones, attention sinks; its window is below the prompt
length), MiniMax-M2 (plain key/value rows) and Inkling / Inkling 2 (short convolutions on keys,
values and the attention and MLP outputs, whose windows are part of the state; sliding and full
layers). For each committed fixture: greedy decoding gives transformers' reference
continuation; a request that extends the previous one's prompt and output reuses the slot's
state (a recurrent model from its end-of-turn checkpoint) and gives exactly what a fresh server
gives, and so does a request that branches off mid-prompt; concurrent requests get exactly
their solo tokens, in fewer engine steps."""

from __future__ import annotations

import json

import pytest

from helpers import REPO, batched_equals_solo, complete_tokens as complete

FIXTURES = REPO / "engine" / "tests" / "fixtures"
# fixture -> whether its state is recurrent (reused only from a checkpoint, not from any prefix)
FAMILIES = {"qwen3_5_moe": True, "gpt_oss": False, "minimax_m2": False, "inkling": True, "inkling2": True}


class Family:
    def __init__(self, name, server, fresh):
        self.name, self.server, self.fresh = name, server, fresh
        self.recurrent = FAMILIES[name]
        self.reference = json.loads((FIXTURES / name / "reference.json").read_text())
        self.prompt = self.reference["prompt_ids"]
        self.greedy = self.reference["greedy_ids"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, start_server):
    name = request.param
    model = FIXTURES / name
    server = start_server("--slots", "4", "--drain-secs", "5", name=name, model=model)
    # Another server on the same model, used once per request: nothing cached.
    fresh = start_server("--slots", "4", "--drain-secs", "5", name=name + "-fresh", model=model)
    return Family(name, server, fresh)


def test_greedy_decoding_is_the_reference_continuation(family):
    text, usage = complete(family.server, family.prompt, len(family.greedy))
    assert usage["completion_tokens"] == len(family.greedy)
    assert text == family.reference["greedy_text"]


def test_follow_up_reuses_the_state_and_matches_a_fresh_server(family):
    server, fresh, prompt = family.server, family.fresh, family.prompt
    server.wait_idle()
    first, _ = complete(server, prompt, 8)
    # The slot ran the prompt and 7 of the 8 tokens (the last one is never fed back); the
    # follow-up extends prompt + output with more tokens.
    follow_up = prompt + family.greedy[:8] + prompt[:5]
    text, usage = complete(server, follow_up, 10)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(prompt) + 7, usage
    fresh_text, fresh_usage = complete(fresh, follow_up, 10)
    assert fresh_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert text == fresh_text

    # A prompt that leaves the cached one at token 20: a recurrent state goes back to its
    # newest checkpoint before that (here: none, the zero state); key/value rows are kept up
    # to the branch.
    branch = prompt[:20] + [t ^ 1 for t in prompt[20:30]]
    text, usage = complete(server, branch, 10)
    want_cached = 0 if family.recurrent else 20
    assert usage["prompt_tokens_details"]["cached_tokens"] == want_cached, usage
    assert text == complete(fresh, branch, 10)[0]


def test_concurrent_requests_get_their_solo_tokens(family):
    n = 4
    prompts = [family.prompt[i * 3 :] + family.prompt[: i * 3] for i in range(n)]

    # Long enough that requests released together overlap even on a loaded machine.
    def request(i):
        return complete(family.server, prompts[i], 48, temperature=0.8, seed=500 + i)[0]

    alone, _, _ = batched_equals_solo(family.server, request, n)
    assert len(set(alone)) == n
