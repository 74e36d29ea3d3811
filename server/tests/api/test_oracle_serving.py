"""The sparse-attention families through `coli serve`: greedy completions of the reference prompt
equal transformers' continuation, for the committed fixtures and the generated variant grid
(engine/tests/fixtures/variants), one request alone and two in the same batch."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from helpers import REPO, Server

FIXTURES = REPO / "engine" / "tests" / "fixtures"
FAMILIES = ("glm_moe_dsa", "deepseek_v4")


def sparse_fixtures() -> list[Path]:
    dirs = [FIXTURES / f for f in FAMILIES]
    for d in sorted((FIXTURES / "variants").iterdir()):
        ref = d / "reference.json"
        if ref.is_file() and json.loads(ref.read_text())["model_type"] in FAMILIES:
            dirs.append(d)
    return dirs


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def expected_text(ref: dict) -> str:
    # The server runs one prefill and then one cached step per token, as transformers' generate();
    # its text leaves special tokens out (generate() may emit one where its pick differs by a tie).
    text = ref.get("generate_text", ref["greedy_text"])
    for special in SPECIAL_TOKENS:
        text = text.replace(special, "")
    return text


@pytest.fixture(scope="module")
def oracle_servers(coli_bin, tmp_path_factory):
    started: list[Server] = []

    def start(model: Path) -> Server:
        workdir = tmp_path_factory.mktemp("oracle-" + model.name)
        s = Server(coli_bin, model, workdir, ["--slots", "2", "--drain-secs", "2"], model.name)
        started.append(s)
        return s.start()

    yield start
    for s in started:
        s.stop()


@pytest.mark.parametrize("model", sparse_fixtures(), ids=lambda p: p.name)
def test_greedy_through_the_server_is_the_reference_continuation(oracle_servers, model):
    ref = json.loads((model / "reference.json").read_text())
    server = oracle_servers(model)
    n = len(ref["greedy_ids"])

    def complete():
        r = server.client().completions.create(
            model=server.model_id, prompt=ref["prompt_ids"], max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.prompt_tokens == len(ref["prompt_ids"])
        assert r.usage.completion_tokens == n
        return r.choices[0].text

    assert complete() == expected_text(ref), f"{model.name}: alone"
    # Two requests in flight at once (they share engine steps while both run): neither may change.
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(complete())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [expected_text(ref)] * 2, f"{model.name}: batched"
