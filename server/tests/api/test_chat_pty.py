"""`coli chat`, the terminal client, driven through a pseudo-terminal against the shared
server: streamed replies and their footer, prompt-prefix reuse across turns, `/reset`, `/save`,
Ctrl-C during an answer and at the prompt, and the exit status.

Every read is bounded by a deadline; nothing waits on a bare sleep.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import termios
import time
from pathlib import Path

import pytest

# How long one reply (or any awaited output) may take.
DEADLINE_S = 60.0

ANSI = re.compile(rb"\x1b\[[0-9;]*m")
FOOTER = re.compile(
    r"\[(?P<approx>~?)(?P<tokens>\d+) tokens?, (?P<rate>[0-9.]+|–) tok/s, "
    r"(?P<cached>\d+|\?) cached prompt tokens, finish: (?P<finish>\w+)\]\n"
)
PROMPT = "> "


class Chat:
    """`coli chat` on the slave side of a pty (its controlling terminal, so Ctrl-C is a real
    SIGINT from the terminal driver); the output is read from the master side."""

    def __init__(self, coli_bin: Path, *args: str, cwd: Path, env: dict[str, str] | None = None):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("COLI_") and k != "OPENAI_API_KEY"},
            **(env or {}),
        }
        argv = [str(coli_bin), "chat", *args]
        pid, fd = pty.fork()
        if pid == 0:  # the child: the pty is already its stdin/stdout/stderr and controlling tty
            try:
                os.chdir(cwd)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        # No echo: the output is only what coli chat writes.
        attrs = termios.tcgetattr(fd)
        attrs[3] &= ~termios.ECHO
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
        self.raw = b""
        self.pos = 0  # how much of the (normalised) output has been consumed
        self.status: int | None = None

    def text(self) -> str:
        """Everything written so far, without colours and with the pty's CRLF as LF."""
        return ANSI.sub(b"", self.raw).replace(b"\r\n", b"\n").decode("utf-8", "replace")

    def _read(self, until: float) -> bool:
        """Read what is available before `until`; False at end of output."""
        wait = max(0.0, until - time.monotonic())
        ready, _, _ = select.select([self.fd], [], [], min(wait, 0.5))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        if not data:
            return False
        self.raw += data
        return True

    def expect(self, pattern: str | re.Pattern, deadline_s: float = DEADLINE_S) -> tuple[str, re.Match]:
        """Wait for `pattern` after the consumed output; return the text before it and the match,
        and consume both."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        until = time.monotonic() + deadline_s
        while True:
            text = self.text()
            m = regex.search(text, self.pos)
            if m:
                before = text[self.pos : m.start()]
                self.pos = m.end()
                return before, m
            if time.monotonic() > until or not self._read(until):
                raise AssertionError(
                    f"no {regex.pattern!r} within {deadline_s} s; unread output:\n{text[self.pos:]!r}"
                )

    def send(self, line: str):
        os.write(self.fd, line.encode())

    def ask(self, message: str) -> tuple[str, re.Match]:
        """Send a message at the prompt; return the streamed reply and the footer match."""
        self.send(message + "\n")
        reply, footer = self.expect(FOOTER)
        self.expect(re.escape(PROMPT))
        return reply.strip("\n"), footer

    def wait(self, deadline_s: float = 30.0) -> int:
        until = time.monotonic() + deadline_s
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > until:
                raise AssertionError(f"coli chat did not exit within {deadline_s} s:\n{self.text()[-2000:]}")
            self._read(min(until, time.monotonic() + 0.1))
        return self.status

    def close(self):
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.status = -9
        os.close(self.fd)


@pytest.fixture
def chat(coli_bin, server, tmp_path):
    started: list[Chat] = []

    def start(*args: str) -> Chat:
        c = Chat(coli_bin, "--url", server.url, *args, cwd=tmp_path)
        started.append(c)
        c.expect(r"Ctrl-D to leave\.\n")
        c.expect(re.escape(PROMPT))
        return c

    yield start
    for c in started:
        c.close()


def saved(c: Chat, path: Path, count: int) -> list[dict]:
    c.send(f"/save {path}\n")
    c.expect(rf"saved {count} messages to ")
    c.expect(re.escape(PROMPT))
    return json.loads(path.read_text())


def test_chat_streams_reuses_the_prefix_and_resets(chat, tmp_path):
    c = chat("--temperature", "0", "--max-tokens", "8")

    first, footer = c.ask("Hello, who are you?")
    assert first, "an empty reply"
    assert footer["approx"] == "" and 1 <= int(footer["tokens"]) <= 8, footer.group(0)
    assert footer["finish"] in ("stop", "length"), footer.group(0)

    second, footer = c.ask("Tell me more.")
    # The second request's prompt starts with the whole first exchange, which the server keeps
    # in the slot's KV cache.
    assert int(footer["cached"]) > 0, footer.group(0)

    history = saved(c, tmp_path / "two-turns.json", 4)
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert [history[0]["content"], history[2]["content"]] == ["Hello, who are you?", "Tell me more."]
    assert history[1]["content"].strip() == first.strip()

    c.send("/reset\n")
    c.expect("conversation cleared")
    c.expect(re.escape(PROMPT))
    again, _ = c.ask("Hello, who are you?")
    # Greedy decoding of the same one-message conversation: the same reply.
    assert again == first
    # And the history really restarted from nothing.
    assert [m["role"] for m in saved(c, tmp_path / "after-reset.json", 2)] == ["user", "assistant"]

    c.send("/quit\n")
    assert c.wait() == 0


def test_multiline_input_and_system_message(chat, tmp_path):
    c = chat("--temperature", "0", "--max-tokens", "4", "--system", "Be brief.")
    c.send("first line \\\n")
    c.expect(re.escape("… "))
    c.send("second line\n")
    c.expect(FOOTER)
    c.expect(re.escape(PROMPT))
    c.send('"""\n')
    c.send("block one\n")
    c.send("\n")
    c.send('block two\n"""\n')
    c.expect(FOOTER)
    c.expect(re.escape(PROMPT))
    history = saved(c, tmp_path / "multi.json", 5)
    assert history[0] == {"role": "system", "content": "Be brief."}
    assert history[1] == {"role": "user", "content": "first line \nsecond line"}
    assert history[3] == {"role": "user", "content": "block one\n\nblock two"}

    c.send("/system Be verbose.\n")
    c.expect("conversation cleared")
    c.expect(re.escape(PROMPT))
    assert saved(c, tmp_path / "system.json", 1) == [{"role": "system", "content": "Be verbose."}]
    c.send("\x04")  # Ctrl-D at an empty prompt
    assert c.wait() == 0


def test_ctrl_c_stops_the_answer_then_leaves_at_the_prompt(chat, tmp_path):
    # Thousands of tokens: the answer is still streaming when Ctrl-C arrives.
    c = chat("--temperature", "0", "--max-tokens", "3000")
    start = c.pos
    c.send("Tell me a long story.\n")
    c.expect(r"\S{8}")  # the answer has started
    c.send("\x03")
    _, footer = c.expect(FOOTER)
    printed = c.text()[start : footer.start()]
    assert footer["finish"] == "interrupted", footer.group(0)
    assert footer["approx"] == "~" and footer["cached"] == "?", footer.group(0)
    c.expect(re.escape(PROMPT))

    # The REPL is alive, and what was printed is kept as the (interrupted) assistant turn.
    history = saved(c, tmp_path / "interrupted.json", 2)
    assert history[1]["role"] == "assistant" and history[1]["interrupted"] is True
    kept = history[1]["content"]
    assert kept and " ".join(kept.split()) == " ".join(printed.split())

    c.send("\x03")  # Ctrl-C at the prompt leaves
    assert c.wait() == 0


def test_errors_keep_the_repl_alive(chat):
    c = chat("--model-name", "no-such-model", "--max-tokens", "4")
    c.send("hi\n")
    line, _ = c.expect(re.escape(PROMPT))
    assert "answered 404" in line and "no-such-model" in line and "--model-name" in line, line
    c.send("/quit\n")
    assert c.wait() == 0


def test_connection_refused_at_startup_exits_1(coli_bin, tmp_path):
    import socket

    with socket.socket() as s:  # a port that is (almost certainly) closed once released
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Chat(coli_bin, "--url", f"http://127.0.0.1:{port}", cwd=tmp_path)
    try:
        c.expect(rf"cannot connect to http://127\.0\.0\.1:{port}: connection refused")
        assert c.wait() == 1
    finally:
        c.close()


def test_model_flag_runs_a_private_server_and_stops_it(coli_bin, model_dir, tmp_path):
    import socket

    # The server it starts keeps its caches in this test's directory.
    env = {"COLI_CACHE_DIR": str(tmp_path / "cache"), "COLI_STATE_DIR": str(tmp_path / "state")}
    c = Chat(coli_bin, "--model", str(model_dir), "--temperature", "0", "--max-tokens", "4", cwd=tmp_path, env=env)
    try:
        _, banner = c.expect(r"coli chat: http://127\.0\.0\.1:(\d+), model `[^`]+`")
        port = int(banner.group(1))
        c.expect(re.escape(PROMPT))
        reply, footer = c.ask("Hello")
        assert reply and footer["finish"] in ("stop", "length"), footer.group(0)
        c.send("/quit\n")
        assert c.wait() == 0
    finally:
        c.close()
    # coli chat waits for its server to exit before it exits itself: the port is closed now.
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"the server on port {port} still answers"
