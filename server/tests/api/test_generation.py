"""Chat and text completions through the official `openai` client: usage accounting,
streaming against non-streaming, seeds, stop strings and log-probabilities."""

from __future__ import annotations

import math
import re

import pytest

IGNORE_EOS = {"ignore_eos": True}
USER = [{"role": "user", "content": "Write a short note about the colour of the sea."}]


def chat(server, **kw):
    kw.setdefault("messages", USER)
    return server.client().chat.completions.create(model=server.model_id, **kw)


def complete(server, **kw):
    kw.setdefault("prompt", "Once upon a time, in a small village by the sea,")
    return server.client().completions.create(model=server.model_id, **kw)


def assert_usage(usage, completion_tokens=None):
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 <= cached < usage.prompt_tokens


def assert_one_choice(r, server, kind, id_prefix):
    """A non-streamed answer of `server`'s model: its object type, id and single choice."""
    assert r.object == kind
    assert r.model == server.model_id
    assert r.id.startswith(id_prefix)
    assert len(r.choices) == 1


def test_models_lists_the_served_model(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model_id]
    assert models.data[0].object == "model"
    assert models.data[0].model_extra["max_model_len"] == 4096
    assert server.client().models.retrieve(server.model_id).id == server.model_id


def test_chat_completion(server):
    r = chat(server, max_tokens=16, temperature=0.7, seed=1, extra_body=IGNORE_EOS)
    assert_one_choice(r, server, "chat.completion", "chatcmpl-")
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "length"
    assert_usage(r.usage, completion_tokens=16)


def test_chat_completion_max_completion_tokens(server):
    r = chat(server, max_completion_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    assert r.choices[0].finish_reason == "length"
    assert_usage(r.usage, completion_tokens=5)


def test_chat_completion_without_ignore_eos_stays_within_max_tokens(server):
    r = chat(server, max_tokens=12, temperature=1.0, seed=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 0 <= r.usage.completion_tokens <= 12
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12
    assert_usage(r.usage)


def test_text_completion(server):
    r = complete(server, max_tokens=16, temperature=0.7, seed=1, extra_body=IGNORE_EOS)
    assert_one_choice(r, server, "text_completion", "cmpl-")
    assert isinstance(r.choices[0].text, str) and r.choices[0].text.strip()
    assert r.choices[0].finish_reason == "length"
    assert_usage(r.usage, completion_tokens=16)


def test_text_completion_echo_prepends_the_prompt(server):
    prompt = "The lighthouse keeper said"
    plain = complete(server, prompt=prompt, max_tokens=6, temperature=0, extra_body=IGNORE_EOS)
    echoed = complete(server, prompt=prompt, max_tokens=6, temperature=0, echo=True, extra_body=IGNORE_EOS)
    assert echoed.choices[0].text == prompt + plain.choices[0].text


def test_text_completion_default_max_tokens_is_16(server):
    r = complete(server, temperature=0.5, seed=2, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length"


# ---- streaming ------------------------------------------------------------------------------

STREAM_KW = dict(max_tokens=24, temperature=0.9, seed=1234, extra_body=IGNORE_EOS)


def test_chat_stream_equals_non_stream(server):
    whole = chat(server, **STREAM_KW)
    stream = chat(server, stream=True, stream_options={"include_usage": True}, **STREAM_KW)
    chunks = list(stream)
    assert chunks, "no chunks"
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    # The first chunk carries the role; the last one only the usage.
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == []
    assert all(len(c.choices) == 1 for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in body)

    assert text == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length"
    assert_same_usage(last.usage, whole.usage, completion_tokens=24)


def assert_same_usage(u, w, completion_tokens):
    """The streamed usage chunk counts what the whole answer counts."""
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        w.prompt_tokens,
        w.completion_tokens,
        w.total_tokens,
    )
    assert u.completion_tokens == completion_tokens


def test_chat_stream_without_include_usage_has_no_usage_chunk(server):
    chunks = list(chat(server, stream=True, **STREAM_KW))
    assert all(c.usage is None for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_stream_equals_non_stream(server):
    whole = complete(server, **STREAM_KW)
    chunks = list(complete(server, stream=True, stream_options={"include_usage": True}, **STREAM_KW))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in body)
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert text == whole.choices[0].text
    assert_same_usage(last.usage, whole.usage, completion_tokens=24)


# ---- seeds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_seed_reproducibility(server, endpoint):
    def text(seed):
        kw = dict(max_tokens=24, temperature=1.0, seed=seed, extra_body=IGNORE_EOS)
        if endpoint == "chat":
            return chat(server, **kw).choices[0].message.content
        return complete(server, **kw).choices[0].text

    a, b, c = text(11), text(11), text(12)
    assert a == b
    assert a != c


# ---- stop strings ---------------------------------------------------------------------------


def pick_stop(text: str) -> tuple[str, int]:
    """A 3-character piece from the middle of `text` whose first occurrence is there, after a
    character that is not whitespace (chat content is trimmed, so the cut text stays as is)."""
    for i in range(len(text) // 2, len(text) - 3):
        s = text[i : i + 3]
        if "\ufffd" in s or not s.strip() or text[i - 1].isspace():
            continue
        if text.find(s) == i:
            return s, i
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text_before_it(server):
    kw = dict(max_tokens=40, temperature=0, extra_body=IGNORE_EOS)
    full = chat(server, **kw)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length"
    stop, at = pick_stop(text)
    assert at > 0

    r = chat(server, stop=[stop], **kw)
    assert r.choices[0].message.content == text[:at]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40

    # Streamed, the held-back text never leaks the stop string either.
    chunks = list(chat(server, stop=stop, stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_in_text_completion(server):
    kw = dict(max_tokens=40, temperature=0, extra_body=IGNORE_EOS)
    text = complete(server, **kw).choices[0].text
    stop, at = pick_stop(text)
    r = complete(server, stop=[stop, "\x00never\x00"], **kw)
    assert r.choices[0].text == text[:at]
    assert r.choices[0].finish_reason == "stop"


# ---- logprobs -------------------------------------------------------------------------------


def test_chat_logprobs(server):
    r = chat(server, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert all(t <= 0.0 and math.isfinite(t) for t in tops)
        # A text token that is a whole character or more: its bytes spell its text (special
        # tokens have no bytes: they are not text).
        for t in entry.top_logprobs:
            if SPECIAL.match(t.token):
                assert t.bytes == [], t
            elif "\ufffd" not in t.token:
                assert t.bytes == list(t.token.encode()), t
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)


def test_chat_logprobs_are_off_by_default(server):
    r = chat(server, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_chat_logprobs_sampled_token_is_among_the_scored(server):
    r = chat(server, max_tokens=12, temperature=1.0, seed=5, logprobs=True, top_logprobs=5, extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        # A sampled token is never more likely than the most likely one.
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6


SPECIAL = re.compile(r"^<\|[^|]*\|>$")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chat_logprob_bytes_reassemble_the_content(server, seed):
    """`bytes` is each token's own UTF-8 bytes, so that tokens holding part of a character can
    be joined back: the chosen tokens' bytes, in order, decode to the content. (Special tokens
    such as `<|reserved_N|>` are left out of the content, so they are left out here too.)"""
    r = chat(
        server,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=40,
        temperature=1.0,
        seed=seed,
        logprobs=True,
        extra_body=IGNORE_EOS,
    )
    content = r.choices[0].logprobs.content
    joined = b"".join(bytes(t.bytes) for t in content if not SPECIAL.match(t.token))
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content, [
        (t.token, t.bytes) for t in content
    ]


def test_completion_logprobs(server):
    r = complete(server, max_tokens=10, temperature=0, logprobs=2, extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert n == 10
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        # Two alternatives (one when two token ids decode to the same text).
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(logprob, abs=1e-6)
        assert top[token] == pytest.approx(logprob, abs=1e-6)
