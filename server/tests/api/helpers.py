"""Helpers of the HTTP API suite: a `coli serve` process, a parsed `/metrics` scrape, SSE
parsing and deadline-bounded polling."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

# How long a server may take to print its port, then to load the model.
LISTEN_DEADLINE_S = 30.0
READY_DEADLINE_S = 60.0

REPO = Path(__file__).resolve().parents[3]

SYNTH_ARGS = [
    "--arch", "olmoe",
    "--layers", "2",
    "--hidden", "128",
    "--experts", "8",
    "--top-k", "2",
    "--moe-intermediate", "64",
    "--vocab", "1024",
]

LISTENING = re.compile(r"coli: listening on http://([0-9.]+):(\d+)")

# One TLS context for every `Server.http()` client: building one loads the CA bundle, tens of
# milliseconds that would stagger requests meant to reach the server together.
_TLS_CONTEXT = ssl.create_default_context()

# The key of the server started with --api-key.
API_KEY = "test-key-3f9c"

# Lines for the end-of-run summary (schemathesis totals, ...).
SUMMARY: list[str] = []


def wait_until(predicate: Callable[[], object], deadline_s: float, what: str, interval: float = 0.02):
    """Poll `predicate` until it returns something truthy; fail after `deadline_s`."""
    end = time.monotonic() + deadline_s
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def run_together(request: Callable[[int], object], n: int, timeout_s: float = 120) -> list:
    """`[request(0), …, request(n-1)]`, each on its own thread, all released at once by a
    barrier (so they reach the server together); raises if one of them failed."""
    results: list = [None] * n
    errors: list = []
    barrier = threading.Barrier(n)

    def worker(i):
        try:
            barrier.wait(timeout=30)
            results[i] = request(i)
        except Exception as e:  # reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    return results


def batched_equals_solo(
    server, request: Callable[[int], object], n: int, tries: int = 3
) -> tuple[list, float, float]:
    """Run `request(i)` for `i < n` one after another, then all at once: asserts each gets the
    same answer both ways and that together they took fewer engine steps. Returns (the answers,
    solo steps, together steps).

    Requests released together can still reach the server one after another on a loaded
    machine (each a few milliseconds of work), so the together run is repeated, up to `tries`
    times, until they overlapped; every repetition must give the solo answers."""
    server.wait_idle()
    before = server.metrics().get("coli_engine_steps_total")
    alone = [request(i) for i in range(n)]
    solo_steps = server.metrics().get("coli_engine_steps_total") - before
    for _ in range(tries):
        server.wait_idle()
        before = server.metrics().get("coli_engine_steps_total")
        together = run_together(request, n)
        together_steps = server.metrics().get("coli_engine_steps_total") - before
        for i in range(n):
            assert together[i] == alone[i], f"request {i}: batched {together[i]!r}, alone {alone[i]!r}"
        if together_steps < solo_steps:
            break
    # The requests really ran together: fewer engine steps than one after another.
    assert together_steps < solo_steps, (together_steps, solo_steps)
    return alone, solo_steps, together_steps


class Metrics:
    """A parsed `/metrics` scrape: every sample by name and labels, and every family's type."""

    def __init__(self, text: str):
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def get(self, name: str, default: float | None = None, **labels) -> float:
        key = (name, frozenset(labels.items()))
        if key in self.samples:
            return self.samples[key]
        if default is not None:
            return default
        raise KeyError(f"no sample {name}{labels} in /metrics")


def _die_with_parent():
    """In the child before exec: on Linux, get SIGKILL when pytest dies, so that an interrupted
    run leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Server:
    """A `coli serve` process on a free port."""

    def __init__(
        self,
        coli_bin: Path,
        model: Path,
        workdir: Path,
        flags: list[str],
        name: str,
        host: str = "127.0.0.1",
        env: dict | None = None,
    ):
        self.coli_bin = coli_bin
        self.model = model
        self.workdir = workdir
        self.flags = flags
        self.name = name
        self.host = host
        self.extra_env = env or {}
        self.lines: list[str] = []
        self.port: int | None = None
        self._listening = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.model_id: str | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, wait_ready: bool = True) -> "Server":
        """Start the process and wait for its `listening` line, then (with `wait_ready`) for
        `/ready` to answer 200."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
        env["COLI_CACHE_DIR"] = str(self.workdir / "cache")
        env["COLI_STATE_DIR"] = str(self.workdir / "state")
        env.update(self.extra_env)
        cmd = [
            str(self.coli_bin), "serve",
            "--model", str(self.model),
            "--host", self.host,
            "--port", "0",
            *self.flags,
        ]
        # The working directory is a fresh one, so no ./colibri.toml is picked up.
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._read_stderr, daemon=True).start()
        if not self._listening.wait(LISTEN_DEADLINE_S) or self.port is None:
            self.kill()
            raise AssertionError(f"{self.name}: no `listening` line within {LISTEN_DEADLINE_S} s:\n{self.log()}")
        if not wait_ready:
            return self

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name}: exited with {self.proc.returncode} while loading:\n{self.log()}")
            try:
                return httpx.get(self.url + "/ready", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, READY_DEADLINE_S, f"{self.name} /ready")
        models = self.http().get("/v1/models", headers=self._auth_headers()).json()
        self.model_id = models["data"][0]["id"]
        return self

    def _auth_headers(self) -> dict:
        if "--api-key" in self.flags:
            return {"Authorization": "Bearer " + self.flags[self.flags.index("--api-key") + 1]}
        return {}

    def _read_stderr(self):
        assert self.proc is not None and self.proc.stderr is not None
        with open(self.workdir / "stderr.log", "w") as log:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                log.write(line)
                log.flush()
                if self.port is None:
                    m = LISTENING.search(line)
                    if m:
                        self.port = int(m.group(2))
                        self._listening.set()
        self._listening.set()

    def log(self, last: int = 40) -> str:
        return "\n".join(self.lines[-last:])

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self):
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    # ---- clients ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        """An OpenAI client that never retries (429 and 5xx must reach the test)."""
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=api_key,
            max_retries=0,
            timeout=kw.pop("timeout", 120.0),
            **kw,
        )

    def http(self, **kw) -> httpx.Client:
        kw.setdefault("verify", _TLS_CONTEXT)
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120.0), **kw)

    def metrics(self) -> Metrics:
        r = httpx.get(self.url + "/metrics", timeout=30)
        assert r.status_code == 200, r.text
        return Metrics(r.text)

    def wait_idle(self, deadline_s: float = 30.0):
        """Wait until no request is running or queued."""

        def idle():
            m = self.metrics()
            return m.get("coli_active_slots") == 0 and m.get("coli_queue_depth") == 0

        wait_until(idle, deadline_s, f"{self.name} to be idle")


def sse_events(response: httpx.Response) -> Iterator[object]:
    """The `data:` payloads of an SSE response: parsed JSON, or the string `[DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        yield data if data == "[DONE]" else json.loads(data)




def complete_json_prefix(text: str) -> str:
    """Close a prefix of a JSON document (an open string, a partial literal or number, a key
    waiting for its value, open containers) so that `json.loads` accepts it if and only if the
    prefix could be continued into valid JSON. Used on output cut by `max_tokens`."""
    stack: list[str] = []
    in_str = esc = is_key = False
    hex_left = 0
    last = None  # last significant thing outside strings: '{', '[', ':', ',', 'key', 'value'
    lit = ""
    for ch in text:
        if in_str:
            if hex_left:
                hex_left -= 1
            elif esc:
                esc = False
                hex_left = 4 if ch == "u" else 0
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                last = "key" if is_key else "value"
            continue
        if ch in "-+.0123456789eEtrufalsn":
            lit += ch
            continue
        if lit:
            lit, last = "", "value"
        if ch in " \t\r\n":
            continue
        if ch == '"':
            in_str = True
            is_key = bool(stack) and stack[-1] == "{" and last in ("{", ",")
        elif ch in "{[":
            stack.append(ch)
            last = ch
        elif ch in "}]":
            if stack:
                stack.pop()
            last = "value"
        elif ch in ":,":
            last = ch
        else:
            last = ch  # invalid; json.loads will say so
    suffix = ""
    if in_str:
        suffix += ("n" if esc else "") + "0" * hex_left + '"'
        last = "key" if is_key else "value"
    elif lit:
        for word in ("true", "false", "null"):
            if word.startswith(lit):
                suffix += word[len(lit):]
                break
        else:
            if lit[-1] in "-+.eE":
                suffix += "0"
        last = "value"
    if stack and stack[-1] == "{":
        if last == "key":
            suffix += ":null"
        elif last == ":":
            suffix += "null"
        elif last == ",":
            suffix += '"":null'
    elif stack and stack[-1] == "[" and last == ",":
        suffix += "null"
    for opener in reversed(stack):
        suffix += "}" if opener == "{" else "]"
    return text + suffix


def complete_tokens(server, prompt, max_tokens, **kw):
    """A `/v1/completions` request for token ids `prompt` (greedy unless `temperature` is
    given, never stopping at EOS): returns (text, usage)."""
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
