#!/usr/bin/env python3
"""The client side of docker/replicas.sh: load through the router, every answer checked, and the
analyses that turn the recorded requests into PASS or FAIL. Python's standard library only.

  reference URL OUT                    greedy answers to PROMPTS from one replica (JSON)
  same URL REFS                        another replica gives the same answers (exit 1 if not)
  load URL REFS OUT STOP_FILE          closed-loop workers until STOP_FILE exists (JSON lines)
  count OUT SINCE [UPSTREAM]           requests of OUT that ended since SINCE (on UPSTREAM)
  kill OUT DEAD SURVIVOR KILL READY    scenario a: analysis of `load` records around a kill
  rolling OUT STOPS                    scenario b: analysis of `load` records of a rolling restart
  conversations URL OUT LABEL          scenario c: two-turn conversations, cached_tokens of turn 2
  affinity WITH WITHOUT                scenario c: the comparison

Every request of `load` asks for MAX_TOKENS greedy tokens of one of PROMPTS (ignore_eos), as a
stream or not; an answer counts as `ok` only when it is complete (a stream's `data: [DONE]`, the
finish reason `length`, usage with MAX_TOKENS completion tokens) and its text is the reference
answer the replicas gave before the scenario. Anything else is classified: `wrong` (a complete
answer with other text), `truncated` (the stream or body ended early: the connection closed
without the terminating chunk, or no [DONE]), `conn_error` (no response at all), `http_NNN`,
`stream_error` (an error event in the stream), `timeout` (no byte for TIMEOUT s: a hang).
Each record also carries the router's X-Colibri-Upstream header (the replicas nginx tried, in
order, e.g. "10.0.0.2:8080, 10.0.0.3:8080" after a retry).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import sys
import threading
import time
import urllib.parse
import uuid

MAX_TOKENS = int(os.environ.get("REPLICAS_MAX_TOKENS", "24"))
WORKERS = int(os.environ.get("REPLICAS_WORKERS", "4"))
TIMEOUT = float(os.environ.get("REPLICAS_TIMEOUT", "120"))
THINK = float(os.environ.get("REPLICAS_THINK", "1.0"))
PROMPTS = [
    "Tell me about the sea.",
    "Write a short poem about mountains.",
    "Explain how a bicycle works.",
    "List three colours and why you like them.",
]


def post(url: str, body: dict, headers: dict | None = None, stream: bool = False) -> dict:
    """POST /v1/chat/completions; the outcome as a dict (see the module's doc)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT)
    out: dict = {"stream": stream, "upstream": "", "outcome": None}
    payload = dict(body, stream=stream)
    if stream:
        payload["stream_options"] = {"include_usage": True}
    try:
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=json.dumps(payload),
                headers={"Content-Type": "application/json", **(headers or {})},
            )
            resp = conn.getresponse()
        except socket.timeout:
            return out | {"outcome": "timeout", "detail": "no response"}
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            return out | {"outcome": "conn_error", "detail": repr(e)}
        out["upstream"] = resp.getheader("X-Colibri-Upstream", "")
        out["status"] = resp.status
        try:
            if resp.status != 200:
                out["detail"] = resp.read().decode("utf-8", "replace")[:300]
                return out | {"outcome": f"http_{resp.status}"}
            if not stream:
                data = json.loads(resp.read())
                choice = data["choices"][0]
                return out | {
                    "text": choice["message"]["content"] or "",
                    "finish_reason": choice["finish_reason"],
                    "usage": data.get("usage"),
                    "complete": True,
                }
            # read1, not readline: http.client's readline returns b"" when the connection
            # closes between two chunks, while read1 raises IncompleteRead: a body cut short
            # (no terminating chunk) is told apart from one that ended without [DONE].
            parts, finish, usage, done, pending = [], None, None, False, b""
            while not done:
                block = resp.read1(65536)
                if not block:
                    break
                pending += block
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        return out | {"outcome": "stream_error", "detail": json.dumps(event)[:300]}
                    for choice in event.get("choices") or []:
                        parts.append((choice.get("delta") or {}).get("content") or "")
                        finish = choice.get("finish_reason") or finish
                    usage = event.get("usage") or usage
            out |= {"text": "".join(parts), "finish_reason": finish, "usage": usage, "complete": done}
            if not done:
                return out | {"outcome": "truncated", "detail": "the body ended (terminating chunk received) without [DONE]"}
            return out
        except socket.timeout:
            return out | {"outcome": "timeout", "detail": "the response stalled"}
        except (http.client.IncompleteRead, ConnectionError, http.client.HTTPException, OSError) as e:
            return out | {"outcome": "truncated", "detail": repr(e)[:300]}
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return out | {"outcome": "malformed", "detail": repr(e)[:300]}
    finally:
        conn.close()


def request_body(prompt: str, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def judge(r: dict, reference: str | None) -> dict:
    """Sets r["outcome"] for a response that came back whole (see the module's doc)."""
    if r["outcome"] is not None:
        return r
    usage = r.get("usage") or {}
    if r.get("finish_reason") != "length" or usage.get("completion_tokens") != MAX_TOKENS:
        r["outcome"] = "wrong"
        r["detail"] = f"finish_reason {r.get('finish_reason')}, usage {usage}"
    elif reference is not None and r.get("text") != reference:
        r["outcome"] = "wrong"
        r["detail"] = f"text {r.get('text')!r} is not the reference {reference!r}"
    else:
        r["outcome"] = "ok"
    return r


def cmd_reference(url: str, out: str) -> None:
    refs = []
    for p in PROMPTS:
        r = judge(post(url, request_body(p)), None)
        assert r["outcome"] == "ok", r
        s = judge(post(url, request_body(p), stream=True), r["text"])
        assert s["outcome"] == "ok", f"the stream differs from the plain answer: {s}"
        refs.append(r["text"])
    write_json(out, {"max_tokens": MAX_TOKENS, "prompts": PROMPTS, "answers": refs})
    print(f"{len(refs)} reference answers of {MAX_TOKENS} tokens (stream and plain agree)")


def cmd_same(url: str, refs_path: str) -> None:
    refs = json.load(open(refs_path))["answers"]
    for p, ref in zip(PROMPTS, refs):
        r = judge(post(url, request_body(p)), ref)
        if r["outcome"] != "ok":
            sys.exit(f"replica {url} answers otherwise: {r}")
    print(f"the same {len(refs)} answers")


def cmd_load(url: str, refs_path: str, out: str, stop_file: str) -> None:
    """WORKERS threads, each sending one request after the other (alternately streamed and
    not, a fresh x-session-id each time, so the router spreads them) until stop_file exists."""
    refs = json.load(open(refs_path))["answers"]
    lock = threading.Lock()
    f = open(out, "a", buffering=1)
    counter = iter(range(10**9))

    def worker(w: int) -> None:
        while not os.path.exists(stop_file):
            with lock:
                n = next(counter)
            k = n % len(PROMPTS)
            t0 = time.time()
            r = post(url, request_body(PROMPTS[k]), {"x-session-id": uuid.uuid4().hex}, stream=n % 2 == 0)
            judge(r, refs[k])
            r |= {"n": n, "worker": w, "prompt": k, "t0": t0, "t1": time.time()}
            r.pop("text", None)
            with lock:
                f.write(json.dumps(r) + "\n")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f.close()


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def cmd_count(path: str, since: str, upstream: str = "") -> None:
    """How many requests of `path` ended at or after `since` (and, with `upstream`, were
    answered whole by that replica): what docker/replicas.sh polls for."""
    n = 0
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line being written
            if r["t1"] >= float(since) and (not upstream or (upstreams(r)[-1:] == [upstream] and r["outcome"] == "ok")):
                n += 1
    print(n)


def upstreams(r: dict) -> list[str]:
    return [u.strip() for u in r.get("upstream", "").split(",") if u.strip()]


def counts(records: list[dict]) -> str:
    c: dict[str, int] = {}
    for r in records:
        c[r["outcome"]] = c.get(r["outcome"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: (kv[0] != "ok", kv[0])))


def verdict(ok: bool, what: str) -> bool:
    print(f"   {'PASS' if ok else 'FAIL'}: {what}")
    return ok


def cmd_kill(out: str, dead: str, survivor: str, kill_at: float, ready_at: float) -> None:
    """Scenario a. `dead` was killed at kill_at and was ready again at ready_at."""
    rs = read_records(out)
    print(f"   {len(rs)} requests: {counts(rs)}")
    before = [r for r in rs if r["t1"] < kill_at]
    during = [r for r in rs if r["t1"] >= kill_at and r["t0"] < ready_at]
    after = [r for r in rs if r["t0"] >= ready_at]
    print(f"   before the kill {len(before)} ({counts(before)}); between the kill and the restart's "
          f"readiness {len(during)} ({counts(during) or '-'}); after {len(after)} ({counts(after) or '-'})")
    bad = [r for r in rs if r["outcome"] in ("wrong", "timeout", "malformed")]
    on_survivor = [r for r in rs if upstreams(r)[-1:] == [survivor]]
    survivor_bad = [r for r in on_survivor if r["outcome"] != "ok"]
    in_flight = [r for r in rs if r["t0"] < kill_at <= r["t1"] and dead in upstreams(r)]
    failed = [r for r in rs if r["outcome"] != "ok"]
    # A clean failure: a request that was on the dead replica when it died, failing as an
    # error the client sees (a cut stream, a 502) within seconds of the kill.
    clean = [
        r for r in failed
        if upstreams(r)[-1:] == [dead] and r["t0"] < kill_at and r["t1"] - kill_at < 15
        and r["outcome"] in ("truncated", "http_502", "conn_error", "stream_error")
    ]
    retried = [r for r in rs if upstreams(r) == [dead, survivor] and r["outcome"] == "ok"]
    rejoined = [r for r in after if upstreams(r)[-1:] == [dead] and r["outcome"] == "ok"]
    print(f"   in flight on the killed replica: {len(in_flight)} — "
          f"{sum(r['outcome'] == 'ok' for r in in_flight)} answered whole by the survivor "
          f"(nginx passed them on: no byte had reached the client), "
          f"{len([r for r in in_flight if r in clean])} failed cleanly "
          f"({counts([r for r in in_flight if r in clean]) or '-'})")
    print(f"   retried from the killed replica to the survivor and answered: {len(retried)}; "
          f"served by the restarted replica after it was ready: {len(rejoined)}")
    for r in [r for r in failed if r not in clean][:5]:
        print(f"   unexplained: {json.dumps(r)[:400]}")
    ok = verdict(not bad, f"no wrong answer and no hang among {len(rs)} ({len(bad)} bad)")
    ok &= verdict(len(in_flight) > 0, f"the kill caught requests in flight on the killed replica ({len(in_flight)})")
    ok &= verdict(not survivor_bad, f"all {len(on_survivor)} requests routed to the survivor succeeded")
    ok &= verdict(len(clean) == len(failed), f"every failure ({len(failed)}) is a request in flight on the killed replica, failed as an error")
    ok &= verdict(len(rejoined) > 0, f"the restarted replica serves again through the router ({len(rejoined)} requests)")
    sys.exit(0 if ok else 1)


def cmd_rolling(out: str, stops: str) -> None:
    """Scenario b: nothing lost; `stops` is a JSON list of {replica, t_stop, t_exit, exit_code}."""
    rs = read_records(out)
    events = json.loads(stops)
    print(f"   {len(rs)} requests: {counts(rs)}")
    t_first, t_last = min(e["t_stop"] for e in events), max(e["t_ready"] for e in events)
    window = [r for r in rs if r["t1"] >= t_first and r["t0"] <= t_last]
    print(f"   during the restarts ({t_last - t_first:.1f} s): {len(window)} requests ({counts(window)})")
    retried = [r for r in rs if len(upstreams(r)) > 1]
    print(f"   retried on the other replica by nginx (a 503 from the draining one, or a refused "
          f"connection): {len(retried)}, {counts(retried) or '-'}")
    rejected = [r for r in rs if r["outcome"] in ("http_429", "http_503")]
    lost = [r for r in rs if r["outcome"] not in ("ok", "http_429", "http_503")]
    for r in lost[:5]:
        print(f"   lost: {json.dumps(r)[:400]}")
    ok = verdict(not lost, f"no accepted request lost ({len(lost)} lost; {len(rejected)} clean 429/503 rejections)")
    for e in events:
        ok &= verdict(e["exit_code"] == 0, f"{e['replica']}: exit code {e['exit_code']} "
                      f"{e['t_exit'] - e['t_stop']:.1f} s after SIGTERM; ready again {e['t_ready'] - e['t_exit']:.1f} s after its start")
    sys.exit(0 if ok else 1)


def cmd_conversations(url: str, out: str, label: str) -> None:
    """Two-turn conversations, WORKERS at a time: turn 2 repeats turn 1's messages, the
    assistant's answer and a new user message. Even conversations carry their key in the
    x-session-id header, odd ones in the OpenAI `user` field. Each turn follows a think time
    of 0-THINK s (seeded by the conversation's number)."""
    n = int(os.environ.get("REPLICAS_CONVERSATIONS", "24"))
    results: list[dict] = []
    lock = threading.Lock()
    todo = iter(range(n))
    tag = uuid.uuid4().hex[:8]

    def one(i: int) -> dict:
        # A user's think time before each turn (0-THINK s, the same for every router): without
        # it, equal-length requests in a closed loop fall into a lockstep in which round robin
        # and least_conn send a worker's next request back to the same replica.
        think = random.Random(i)
        key = f"conv-{tag}-{i}"
        headers, extra = ({"x-session-id": key}, {}) if i % 2 == 0 else ({}, {"user": key})
        # A different opening per conversation: only the template's first tokens are shared.
        first = f"{uuid.uuid4().hex} {PROMPTS[i % len(PROMPTS)]}"
        time.sleep(think.uniform(0, THINK))
        t1 = judge(post(url, request_body(first, **extra), headers), None)
        if t1["outcome"] != "ok":
            return {"i": i, "outcome": f"turn 1: {t1['outcome']}", "detail": t1.get("detail")}
        messages = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": t1["text"]},
            {"role": "user", "content": "And then? Tell me more."},
        ]
        body = request_body("", **extra) | {"messages": messages}
        time.sleep(think.uniform(0, THINK))
        t2 = judge(post(url, body, headers), None)
        if t2["outcome"] != "ok":
            return {"i": i, "outcome": f"turn 2: {t2['outcome']}", "detail": t2.get("detail")}
        details = (t2["usage"] or {}).get("prompt_tokens_details") or {}
        return {
            "i": i,
            "outcome": "ok",
            "key_in": "header" if i % 2 == 0 else "user",
            "turn1_upstream": t1["upstream"],
            "turn2_upstream": t2["upstream"],
            "turn1_prompt_tokens": t1["usage"]["prompt_tokens"],
            "turn2_prompt_tokens": t2["usage"]["prompt_tokens"],
            "turn2_cached_tokens": details.get("cached_tokens", 0),
        }

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            r = one(i)
            with lock:
                results.append(r)

    t0 = time.time()
    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort(key=lambda r: r["i"])
    summary = summarise(results) | {"label": label, "wall_s": round(time.time() - t0, 1), "url": url}
    write_json(out, {"summary": summary, "conversations": results})
    print(f"   {label}: {line(summary)}")


def summarise(results: list[dict]) -> dict:
    done = [r for r in results if r["outcome"] == "ok"]
    n = len(done)

    def share(pred) -> float:
        return round(100.0 * sum(1 for r in done if pred(r)) / n, 1) if n else 0.0

    return {
        "conversations": len(results),
        "completed": n,
        "failed": [r for r in results if r["outcome"] != "ok"],
        "same_replica_pct": share(lambda r: r["turn1_upstream"] == r["turn2_upstream"]),
        "cached_gt0_pct": share(lambda r: r["turn2_cached_tokens"] > 0),
        "cached_turn1_pct": share(lambda r: r["turn2_cached_tokens"] >= r["turn1_prompt_tokens"]),
        "mean_cached_tokens": round(sum(r["turn2_cached_tokens"] for r in done) / n, 1) if n else 0.0,
        "mean_turn2_prompt_tokens": round(sum(r["turn2_prompt_tokens"] for r in done) / n, 1) if n else 0.0,
    }


def line(s: dict) -> str:
    return (f"{s['completed']}/{s['conversations']} conversations; turn 2 on turn 1's replica "
            f"{s['same_replica_pct']} %, cached_tokens > 0 {s['cached_gt0_pct']} %, cached_tokens "
            f">= turn 1's prompt {s['cached_turn1_pct']} % (mean {s['mean_cached_tokens']} of "
            f"{s['mean_turn2_prompt_tokens']} prompt tokens)")


def cmd_affinity(with_path: str, without_path: str) -> None:
    w = json.load(open(with_path))["summary"]
    wo = json.load(open(without_path))["summary"]
    ok = verdict(not w["failed"] and not wo["failed"], "every turn of every conversation answered")
    ok &= verdict(w["same_replica_pct"] == 100.0, f"with affinity every second turn reached its first turn's replica ({w['same_replica_pct']} %)")
    ok &= verdict(
        w["cached_turn1_pct"] > wo["cached_turn1_pct"],
        f"second turns reusing turn 1's prefix: {w['cached_turn1_pct']} % with affinity, {wo['cached_turn1_pct']} % {wo['label']}",
    )
    sys.exit(0 if ok else 1)


def write_json(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "reference":
        cmd_reference(*args)
    elif cmd == "same":
        cmd_same(*args)
    elif cmd == "load":
        cmd_load(*args)
    elif cmd == "count":
        cmd_count(*args)
    elif cmd == "kill":
        cmd_kill(args[0], args[1], args[2], float(args[3]), float(args[4]))
    elif cmd == "rolling":
        cmd_rolling(*args)
    elif cmd == "conversations":
        cmd_conversations(*args)
    elif cmd == "affinity":
        cmd_affinity(*args)
    else:
        sys.exit(f"unknown command {cmd!r} (see the module's doc)")
