"""Drafts through `coli serve`: the same text with drafting off, `--draft ngram` and
`--draft auto` — a code edit whose answer copies its prompt, a JSON schema whose keys the
grammar forces, greedy and seeded, streamed and not — and the drafts counted per source in
`/metrics`. On the session's random-weight model and on SmolLM2-135M-Instruct, a trained model
that really copies the code it is asked to edit, where the acceptance is measured and reported
in the suite's summary.
"""

from __future__ import annotations

import json
from pathlib import Path
import os

import jsonschema
import pytest

from helpers import SUMMARY

CODE_EDIT = """Add a docstring to this function. Reply with the complete function.

```python
def parse_config(path):
    settings = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings
```"""

CITY = {
    "type": "object",
    "properties": {
        "city_name": {"type": "string", "maxLength": 24},
        "country_name": {"type": "string", "maxLength": 24},
        "population_estimate": {"type": "integer"},
        "is_national_capital": {"type": "boolean"},
        "twin_cities": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
    },
    "required": ["city_name", "country_name", "population_estimate", "is_national_capital", "twin_cities"],
    "additionalProperties": False,
}


def response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def chat(server, content, **kw):
    """One chat completion: (text, finish reason, token logprobs)."""
    r = server.client().chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": content}],
        logprobs=True,
        top_logprobs=2,
        **kw,
    )
    choice = r.choices[0]
    logprobs = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in choice.logprobs.content]
    return choice.message.content, choice.finish_reason, logprobs


def streamed(server, content, **kw):
    stream = server.client().chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": content}], stream=True, **kw
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def drafts(server, source):
    m = server.metrics()
    proposed = m.get("coli_draft_proposed_tokens_total", 0.0, source=source)
    accepted = m.get("coli_draft_accepted_tokens_total", 0.0, source=source)
    return proposed, accepted


@pytest.fixture(scope="module")
def ngram_server(start_server):
    return start_server("--slots", "2", "--draft", "ngram", "--drain-secs", "5", name="drafts-ngram")


@pytest.fixture(scope="module")
def auto_server(start_server):
    return start_server("--slots", "2", "--draft", "auto", "--drain-secs", "5", name="drafts-auto")


SAMPLINGS = [
    pytest.param({"temperature": 0}, id="greedy"),
    pytest.param({"temperature": 0.8, "seed": 1234, "top_p": 0.9, "frequency_penalty": 0.2}, id="seeded"),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_code_edit_is_the_same_with_drafts(server, ngram_server, auto_server, sampling):
    plain = chat(server, CODE_EDIT, max_tokens=80, **sampling)
    assert plain[2], "no tokens"
    for s in (ngram_server, auto_server):
        assert chat(s, CODE_EDIT, max_tokens=80, **sampling) == plain
        assert streamed(s, CODE_EDIT, max_tokens=80, **sampling) == plain[:2]
    proposed, accepted = drafts(ngram_server, "ngram")
    assert proposed > 0 and 0 <= accepted <= proposed
    assert drafts(server, "ngram") == (0.0, 0.0), "drafting is off by default"


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_schema_output_is_the_same_with_grammar_drafts(server, ngram_server, auto_server, sampling):
    ask = "Describe a fictional city as JSON."
    plain = chat(server, ask, max_tokens=200, response_format=response_format(CITY), **sampling)
    assert plain[1] == "stop", plain
    jsonschema.validate(json.loads(plain[0]), CITY)
    before = drafts(ngram_server, "grammar")
    for s in (ngram_server, auto_server):
        assert chat(s, ask, max_tokens=200, response_format=response_format(CITY), **sampling) == plain
    proposed, accepted = drafts(ngram_server, "grammar")
    assert proposed > before[0], "no forced token was drafted"
    assert accepted > before[1], "no forced token was accepted"


# ---- a trained model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path():
    path = os.environ.get("COLI_TEST_SMOLLM2")
    if not path:
        why = os.environ.get("COLI_TEST_SMOLLM2_SKIP", "COLI_TEST_SMOLLM2 is not set")
        pytest.skip(f"SmolLM2 is not available: {why}")
    return Path(path)


@pytest.fixture(scope="module")
def smollm2_ngram(start_server, smollm2_path):
    return start_server("--slots", "1", "--draft", "ngram", "--drain-secs", "5", name="smollm2-ngram", model=smollm2_path)


@pytest.fixture(scope="module")
def smollm2_auto(start_server, smollm2_path):
    return start_server("--slots", "1", "--draft", "auto", "--drain-secs", "5", name="smollm2-auto", model=smollm2_path)


def test_smollm2_code_edit_is_the_same_and_mostly_drafted(smollm2_server, smollm2_ngram, smollm2_auto):
    plain = chat(smollm2_server, CODE_EDIT, max_tokens=160, temperature=0)
    # The answer copies the function (this small model rewrites a line or two of it).
    assert "settings[key.strip()] = value.strip()" in plain[0], plain[0]
    before = drafts(smollm2_ngram, "ngram")
    assert chat(smollm2_ngram, CODE_EDIT, max_tokens=160, temperature=0) == plain
    proposed, accepted = (a - b for a, b in zip(drafts(smollm2_ngram, "ngram"), before))
    SUMMARY.append(
        f"drafts: SmolLM2 code edit, ngram: {accepted:.0f} of {proposed:.0f} drafted tokens accepted "
        f"({100 * accepted / max(proposed, 1):.0f} %), {len(plain[2])} tokens generated"
    )
    # The answer copies the function: many of its tokens come from accepted drafts.
    assert accepted >= 0.3 * len(plain[2]), (accepted, proposed, len(plain[2]))
    assert chat(smollm2_auto, CODE_EDIT, max_tokens=160, temperature=0) == plain
    assert streamed(smollm2_auto, CODE_EDIT, max_tokens=160, temperature=0) == plain[:2]
    seeded = {"temperature": 0.7, "seed": 99}
    assert chat(smollm2_ngram, CODE_EDIT, max_tokens=120, **seeded) == chat(
        smollm2_server, CODE_EDIT, max_tokens=120, **seeded
    )


def test_smollm2_schema_is_the_same_with_grammar_drafts(smollm2_server, smollm2_ngram):
    ask = "Describe a fictional city as JSON."
    plain = chat(smollm2_server, ask, max_tokens=200, temperature=0, response_format=response_format(CITY))
    assert plain[1] == "stop", plain
    jsonschema.validate(json.loads(plain[0]), CITY)
    before = drafts(smollm2_ngram, "grammar")
    assert chat(smollm2_ngram, ask, max_tokens=200, temperature=0, response_format=response_format(CITY)) == plain
    proposed, accepted = (a - b for a, b in zip(drafts(smollm2_ngram, "grammar"), before))
    SUMMARY.append(
        f"drafts: SmolLM2 JSON schema, grammar: {accepted:.0f} of {proposed:.0f} forced tokens accepted, "
        f"{len(plain[2])} tokens generated"
    )
    assert proposed > 0 and accepted > 0
