#!/usr/bin/env python3
"""Misbehaving clients for the soak (loadtest/soak.sh), run beside the load generator.

Two kinds, each on its own schedule until --duration seconds have passed:

- slowloris: every --slowloris-every seconds, --slowloris-conns connections each send a request
  line and then one more header line every 2 s, never finishing the headers. The server must
  close each within its header timeout (--header-timeout, the server's header_timeout_secs) plus
  --slack seconds; the time each connection stayed open is recorded.
- disconnect: every --disconnect-every seconds, a streamed chat completion is sent and its socket
  closed as soon as the first SSE event arrives (a client that goes away mid-stream). The server
  must free the slot; soak.sh checks that coli_active_slots and coli_queue_depth return to 0 once
  the load ends.

Writes a JSON summary (--out): per kind the count, how many behaved as the server promises, and
the slowloris hold times (seconds). Loopback only.
"""

import argparse
import json
import socket
import threading
import time
from urllib.parse import urlparse


def slowloris(host, port, deadline_s):
    """Holds one connection with never-ending headers; returns seconds until the server closed
    it, or None when it was still open at deadline_s."""
    start = time.monotonic()
    s = socket.create_connection((host, port), timeout=5)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n")
        s.settimeout(2)
        n = 0
        while time.monotonic() - start < deadline_s:
            try:
                data = s.recv(4096)
                if not data:
                    return time.monotonic() - start  # closed by the server
                # Anything answered (a 408 or 400) then a close also ends the hold.
                continue
            except socket.timeout:
                pass
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - start
            try:
                s.sendall(b"X-Slow-%d: x\r\n" % n)
                n += 1
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - start
        return None
    finally:
        s.close()


def disconnect_mid_stream(host, port, model, api_key):
    """Sends a streamed request and closes the socket at the first SSE event. Returns the HTTP
    status line's code (200 when a stream had started), or 0 when nothing came back."""
    body = json.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": 64,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story about a hummingbird."}],
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {api_key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    s = socket.create_connection((host, port), timeout=120)
    try:
        s.sendall(head + body)
        buf = b""
        while b"data:" not in buf:
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
        try:
            return int(buf.split(b" ", 2)[1])
        except (IndexError, ValueError):
            return 0
    finally:
        # RST rather than FIN: the harshest way a client can vanish.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--slowloris-every", type=float, default=120)
    ap.add_argument("--slowloris-conns", type=int, default=16)
    ap.add_argument("--header-timeout", type=float, required=True)
    ap.add_argument("--slack", type=float, default=5)
    ap.add_argument("--disconnect-every", type=float, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    u = urlparse(args.url)
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("abuse: loopback only")
    host, port = u.hostname, u.port

    lock = threading.Lock()
    holds, disconnects, threads = [], [], []
    end = time.monotonic() + args.duration

    def hold():
        try:
            t = slowloris(host, port, args.header_timeout + args.slack + 30)
        except OSError as e:
            t = f"error: {e}"
        with lock:
            holds.append(t)

    def cut():
        try:
            st = disconnect_mid_stream(host, port, args.model, args.api_key)
        except OSError as e:
            st = f"error: {e}"
        with lock:
            disconnects.append(st)

    next_hold = time.monotonic() + 5
    next_cut = time.monotonic() + 2
    while time.monotonic() < end:
        now = time.monotonic()
        if now >= next_hold:
            for _ in range(args.slowloris_conns):
                th = threading.Thread(target=hold, daemon=True)
                th.start()
                threads.append(th)
            next_hold += args.slowloris_every
        if now >= next_cut:
            th = threading.Thread(target=cut, daemon=True)
            th.start()
            threads.append(th)
            next_cut += args.disconnect_every
        time.sleep(max(0.05, min(next_hold, next_cut, end) - time.monotonic()))
    for th in threads:
        th.join(timeout=args.header_timeout + args.slack + 180)

    limit = args.header_timeout + args.slack
    closed = [h for h in holds if isinstance(h, float)]
    statuses = [str(d) for d in disconnects]
    summary = {
        "slowloris": {
            "connections": len(holds),
            "closed_within_limit": sum(1 for h in closed if h <= limit),
            "limit_s": limit,
            "hold_s_min": min(closed) if closed else None,
            "hold_s_max": max(closed) if closed else None,
            "not_closed_or_error": [h for h in holds if not isinstance(h, float) or h > limit][:10],
        },
        "disconnect": {
            "requests": len(disconnects),
            "by_status": {k: statuses.count(k) for k in sorted(set(statuses))},
        },
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
