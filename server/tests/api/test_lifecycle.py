"""Start-up and shutdown seen from outside: a failed load (an error or a panic) is reported as
failed — exit 1 by default, 503 with the error when told to stay up — and clients that never
finish sending cannot hold the server: headers and bodies time out, and SIGTERM exits by the
drain deadline whatever open connections are waiting for."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time

import httpx

from helpers import wait_until

# What the server gives connections after the drain deadline (CLOSE_GRACE in serve/mod.rs),
# plus room for saving the usage history and exiting on a loaded machine.
AFTER_DRAIN_S = 2 + 3


def broken_model(model_dir, tmp_path):
    """A copy of the session's model whose config.json is not JSON."""
    bad = tmp_path / "broken-model"
    shutil.copytree(model_dir, bad)
    (bad / "config.json").write_text('{"model_type": "olmoe", ')
    return bad


def wait_exit(s, deadline_s: float) -> int:
    try:
        return s.proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{s.name} did not exit within {deadline_s} s:\n{s.log()}")


def failed_load_error(s) -> dict | None:
    """The error `/ready` answers once the load has failed (None while it says anything else)."""
    r = httpx.get(s.url + "/ready", timeout=5)
    if r.status_code == 503 and "failed to load" in r.json()["error"]["message"]:
        return r
    return None


# ---- a failed load --------------------------------------------------------------------------


def test_a_model_that_fails_to_load_exits_1_with_the_error(start_server, model_dir, tmp_path):
    bad = broken_model(model_dir, tmp_path)
    s = start_server(model=bad, name="badload", wait_ready=False)
    assert wait_exit(s, 60) == 1, s.log()
    wait_until(lambda: any("failed to load" in line for line in s.lines), 5, "the error line")
    errors = [line for line in s.lines if "failed to load" in line]
    assert len(errors) == 1, s.log()
    assert errors[0].startswith("coli: error: the model failed to load: ")
    assert str(bad / "config.json") in errors[0], errors[0]
    assert "stay_up_on_load_failure" in errors[0]
    assert not any("coli: ready" in line for line in s.lines)


def test_staying_up_after_a_failed_load_answers_503_with_the_error(start_server, model_dir, tmp_path):
    bad = broken_model(model_dir, tmp_path)
    s = start_server("--stay-up-on-load-failure", "--drain-secs", "2", model=bad, name="badload-up", wait_ready=False)
    r = wait_until(lambda: failed_load_error(s), 60, "/ready to report the failed load")
    err = r.json()["error"]
    assert err["type"] == "service_unavailable"
    assert str(bad / "config.json") in err["message"], err
    assert "still loading" not in err["message"]
    # A failure is not temporary: no Retry-After.
    assert "retry-after" not in r.headers
    # Requests get the same error; the process is alive and says so.
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=5)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == err["message"]
    assert httpx.get(s.url + "/health", timeout=5).json() == {"status": "ok"}
    assert s.proc.poll() is None
    assert any(line.startswith("coli: error: the model failed to load: ") for line in s.lines)
    s.proc.send_signal(signal.SIGTERM)
    assert wait_exit(s, 2 + AFTER_DRAIN_S) == 0, s.log()


def test_a_panic_while_loading_is_a_failed_load(start_server):
    """A panic on the loader thread used to leave `/ready` at "still loading" for ever."""
    env = {"COLI_TEST_LOAD_PANIC": "1"}
    s = start_server("--stay-up-on-load-failure", "--drain-secs", "2", env=env, name="panic-up", wait_ready=False)
    r = wait_until(lambda: failed_load_error(s), 60, "/ready to report the panic as a failed load")
    message = r.json()["error"]["message"]
    assert "panic: COLI_TEST_LOAD_PANIC is set" in message, message
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["message"] == message
    s.proc.send_signal(signal.SIGTERM)
    assert wait_exit(s, 2 + AFTER_DRAIN_S) == 0, s.log()

    # Without --stay-up-on-load-failure the process exits 1 with it.
    s = start_server(env=env, name="panic", wait_ready=False)
    assert wait_exit(s, 60) == 1, s.log()
    wait_until(lambda: any("failed to load" in line for line in s.lines), 5, "the error line")
    assert any("coli: error: the model failed to load: the loader stopped on a panic" in line for line in s.lines), s.log()


# ---- slow clients ---------------------------------------------------------------------------


def connect(s) -> socket.socket:
    return socket.create_connection(("127.0.0.1", s.port), timeout=30)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or resets it)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def half_sent_headers(s) -> socket.socket:
    sock = connect(s)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appli")
    return sock


def half_sent_body(s) -> socket.socket:
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    sock = connect(s)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body) + 100}\r\n\r\n".encode()
        + body
    )
    return sock


def closed_after_timeout(start_server, name, half_sent):
    """A server with 1-second header and body timeouts, and what it answers a half-sent request
    once it closes the connection (checked to take the timeout, not much less nor much more)."""
    s = start_server("--header-timeout-secs", "1", "--body-timeout-secs", "1", "--slots", "1", name=name)
    sock = half_sent(s)
    start = time.monotonic()
    data = read_until_closed(sock)
    took = time.monotonic() - start
    sock.close()
    assert 0.5 <= took < 10, took
    return s, data


def test_headers_that_never_end_time_out(start_server):
    _, data = closed_after_timeout(start_server, "timeouts", half_sent_headers)
    # hyper closes the connection, with a 408 or without a word.
    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data


def test_a_body_shorter_than_its_content_length_gets_408(start_server):
    s, data = closed_after_timeout(start_server, "timeouts408", half_sent_body)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert b"connection: close" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_timeout", err
    assert "body_timeout_secs" in err["message"], err
    # The server still serves.
    assert httpx.get(s.url + "/ready", timeout=5).status_code == 200


def test_clients_that_never_finish_sending_cannot_hold_sigterm(start_server):
    """With timeouts far beyond the drain, a connection whose headers never end and one whose
    body never ends are closed at the drain deadline, and the process exits 0."""
    drain = 2
    s = start_server(
        "--drain-secs", str(drain), "--header-timeout-secs", "600", "--body-timeout-secs", "600", "--slots", "1",
        name="slowloris",
    )
    headers, body = half_sent_headers(s), half_sent_body(s)
    # Connections are accepted in order: once a later one is answered, both are being served.
    assert httpx.get(s.url + "/health", timeout=5).status_code == 200
    s.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code = wait_exit(s, drain + AFTER_DRAIN_S)
    took = time.monotonic() - signalled
    print(f"exited {took:.2f} s after SIGTERM with two half-sent requests open (drain {drain} s)")
    assert code == 0, s.log()
    wait_until(lambda: any("coli: stopped" in line for line in s.lines), 5, "the `stopped` line")
    # Both were cut by the shutdown, not answered.
    for sock in (headers, body):
        data = read_until_closed(sock)
        sock.close()
        assert not data.startswith(b"HTTP/1.1 2"), data
