#!/usr/bin/env python3
"""Load generator for `coli serve` (or any OpenAI-compatible server), on the official `openai`
client.

Closed loop (`--users N`: N clients, each sending its next request when the last one ends) or
open loop (`--rate R`: requests started at R per second whatever the server does), bounded by
`--duration` seconds and/or `--requests` count. Every request streams. Time to first token
(TTFT) is the time from sending the request to its first generated token: where the server
reports `timings` on its last chunk (colibri and llama.cpp's server do: `predicted_ms`, the time
from the first to the last generated token), the arrival of that chunk less `predicted_ms`;
otherwise the first chunk with text (`first_text_s`, also recorded; a token that brings no text,
as a synthetic model's reserved tokens do, sends no chunk, so this can be many tokens late).
Inter-token latency (ITL) is the gap between chunks with text; `server_itl_s` is each request's
mean gap between generated tokens from the same `timings`. Every response is checked (a
non-empty answer or a tool call; valid JSON that validates against the schema when
constrained). Loopback only unless `--allow-remote`.

Scenarios: short (a short chat turn), long (a long prompt), stream (same as short; kept for
symmetry with the non-streamed variant `short-json`), tools (a required tool call), json (a
json_schema answer), mixed (all of them in turn).

Prints a summary and writes it as JSON (`--out`): requests, errors by status, aggregate
generated tok/s, per-stream decode tok/s, TTFT and ITL percentiles. Each record has its status
(the HTTP status; 0 for a connection error or client timeout; `invalid` for an answer that fails
the check; `stream:TYPE` for an error event inside a stream that had started with 200), its
start time (`started_at`, Unix seconds) and `latency_s`.

    python loadtest/loadtest.py --url http://127.0.0.1:8080 --users 4 --requests 32 --max-tokens 64
"""

import argparse
import json
import random
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

try:
    import openai
except ImportError:  # pragma: no cover
    sys.exit("loadtest: needs the openai package: pip install -r loadtest/requirements.txt")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak "
    "tree near the river bank and count the stars in the evening sky"
).split()


def percentile(values, p):
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_request(scenario, i, args, rng):
    """The chat request of scenario `scenario` (the i-th request)."""
    if scenario == "mixed":
        scenario = ["short", "long", "tools", "json"][i % 4]
    req = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed + i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        req["extra_body"] = {"ignore_eos": True}
    if scenario in ("short", "stream"):
        req["messages"] = [{"role": "user", "content": f"Tell me about {rng.choice(WORDS)} number {i}."}]
    elif scenario == "long":
        text = " ".join(rng.choice(WORDS) for _ in range(args.long_words))
        req["messages"] = [{"role": "user", "content": f"Summarise: {text}"}]
    elif scenario == "tools":
        req["messages"] = [{"role": "user", "content": "What is the weather in Paris?"}]
        req["tools"] = [WEATHER_TOOL]
        req["tool_choice"] = "required"
    elif scenario == "json":
        req["messages"] = [{"role": "user", "content": "Invent a person."}]
        req["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        }
    else:
        raise ValueError(f"unknown scenario {scenario}")
    return scenario, req


def check(scenario, content, tool_calls):
    """Why the answer is wrong, or None."""
    if scenario == "tools":
        if not tool_calls:
            return "no tool call"
        for c in tool_calls.values():
            if c["name"] != "get_weather":
                return f"wrong tool {c['name']}"
            try:
                args = json.loads(c["arguments"])
            except ValueError as e:
                return f"tool arguments are not JSON: {e}"
            if not isinstance(args, dict) or not isinstance(args.get("city"), str):
                return "tool arguments do not match the schema"
        return None
    if scenario == "json":
        try:
            v = json.loads(content)
        except ValueError as e:
            return f"not JSON: {e}"
        if set(v) != {"name", "age"} or not isinstance(v["name"], str) or not isinstance(v["age"], int):
            return "does not match the schema"
        return None
    return None if content or tool_calls else "empty answer"


def one_request(client, scenario, req):
    """Run one streamed request; returns its record."""
    rec = {"scenario": scenario, "status": 200, "error": None, "started_at": time.time()}
    start = time.perf_counter()
    token_times = []
    content = []
    tool_calls = {}
    usage = None
    finish = None
    # The server's own timings (an extension: colibri and llama-server send them on the last
    # chunk) and when the chunk carrying them arrived.
    timings = None
    timings_at = None
    try:
        extra = req.pop("extra_body", None)
        stream = client.chat.completions.create(**req, extra_body=extra)
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            extra = getattr(chunk, "model_extra", None) or {}
            if isinstance(extra.get("timings"), dict):
                timings = extra["timings"]
                timings_at = now
            for ch in chunk.choices:
                if ch.finish_reason:
                    finish = ch.finish_reason
                d = ch.delta
                if d.content:
                    content.append(d.content)
                    token_times.append(now)
                if d.tool_calls:
                    token_times.append(now)
                    for tc in d.tool_calls:
                        slot = tool_calls.setdefault(tc.index, {"name": "", "arguments": ""})
                        if tc.function and tc.function.name:
                            slot["name"] += tc.function.name
                        if tc.function and tc.function.arguments:
                            slot["arguments"] += tc.function.arguments
    except openai.APIStatusError as e:
        rec["status"] = e.status_code
        rec["error"] = str(e)[:300]
    except openai.APIConnectionError as e:
        rec["status"] = 0
        rec["error"] = str(e)[:300]
    except openai.APIError as e:
        # An error event inside a stream that had already answered 200 (e.g. a queue timeout
        # after the first chunk): "stream:" and the error's type, e.g. stream:service_unavailable.
        rec["status"] = f"stream:{e.type}" if getattr(e, "type", None) else 0
        rec["error"] = str(e)[:300]
    end = time.perf_counter()
    rec["latency_s"] = end - start
    if rec["error"] is None:
        rec["first_text_s"] = (token_times[0] - start) if token_times else None
        rec["ttft_s"] = rec["first_text_s"]
        rec["ttft_source"] = "first_text"
        predicted_ms = (timings or {}).get("predicted_ms")
        predicted_n = (timings or {}).get("predicted_n")
        if isinstance(predicted_ms, (int, float)) and isinstance(predicted_n, int) and predicted_n >= 1:
            rec["server_timings"] = timings
            rec["ttft_s"] = max(0.0, (timings_at - start) - predicted_ms / 1e3)
            rec["ttft_source"] = "timings"
            if predicted_n > 1:
                rec["server_itl_s"] = predicted_ms / 1e3 / (predicted_n - 1)
        rec["itl_s"] = [b - a for a, b in zip(token_times, token_times[1:])]
        rec["completion_tokens"] = usage.completion_tokens if usage else None
        rec["prompt_tokens"] = usage.prompt_tokens if usage else None
        # Streamed chunks that carried text or a tool call: the token count of a server that
        # sends no usage (one token per chunk there).
        rec["content_chunks"] = len(token_times)
        generated = usage.completion_tokens if usage else len(token_times)
        # A tool call arrives whole in one delta: no per-token timing to speak of.
        if generated > 1 and token_times and scenario != "tools":
            rec["decode_tok_s"] = (generated - 1) / max(end - token_times[0], 1e-9)
        rec["finish_reason"] = finish
        # A constrained answer cut by max_tokens cannot be complete: counted, not judged.
        bad = None if finish == "length" and scenario in ("tools", "json") else check(scenario, "".join(content), tool_calls)
        if bad:
            rec["status"] = "invalid"
            rec["error"] = bad
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--scenario", default="short", choices=["short", "long", "stream", "tools", "json", "mixed"])
    ap.add_argument("--users", type=int, default=1, help="closed loop: concurrent clients")
    ap.add_argument("--rate", type=float, default=None, help="open loop: requests per second")
    ap.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    ap.add_argument("--duration", type=float, default=60.0, help="stop starting requests after this many seconds")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (colibri extension)")
    ap.add_argument("--long-words", type=int, default=400)
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    ap.add_argument("--allow-remote", action="store_true", help="allow a non-loopback URL")
    args = ap.parse_args()

    host = urlparse(args.url).hostname or ""
    if not args.allow_remote and host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"loadtest: {args.url} is not loopback; pass --allow-remote to load it")
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, timeout=600)
    if args.model is None:
        args.model = client.models.list().data[0].id

    records = []
    lock = threading.Lock()
    counter = iter(range(1 << 62))
    t0 = time.perf_counter()

    def next_index():
        with lock:
            i = next(counter)
        if args.requests is not None and i >= args.requests:
            return None
        if time.perf_counter() - t0 > args.duration:
            return None
        return i

    def run(i):
        rng = random.Random(args.seed * 1000003 + i)
        scenario, req = make_request(args.scenario, i, args, rng)
        rec = one_request(client, scenario, req)
        with lock:
            records.append(rec)

    threads = []
    if args.rate:
        while True:
            i = next_index()
            if i is None:
                break
            th = threading.Thread(target=run, args=(i,))
            th.start()
            threads.append(th)
            target = t0 + (i + 1) / args.rate
            delay = target - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # pacing the open loop, not synchronisation
    else:
        def user():
            while True:
                i = next_index()
                if i is None:
                    return
                run(i)

        threads = [threading.Thread(target=user) for _ in range(args.users)]
        for th in threads:
            th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0

    ok = [r for r in records if r["error"] is None]
    errors = {}
    for r in records:
        if r["error"] is not None:
            errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
    # Usage when the server sent it, else the streamed chunks (counted in `without_usage`).
    without_usage = [r for r in ok if r.get("completion_tokens") is None]
    generated = sum(r["completion_tokens"] for r in ok if r.get("completion_tokens") is not None)
    generated += sum(r.get("content_chunks", 0) for r in without_usage)
    # Every token a server generated for a request it answered, including answers the content
    # check refused (a synthetic model's tokens can decode to no text): the throughput figure
    # for comparing servers, which the content check must not skew.
    answered_tokens = sum(r["completion_tokens"] for r in records if r.get("completion_tokens") is not None)
    # TTFT and the server's inter-token gaps of every answered request, including answers the
    # content check refused: their tokens were generated all the same.
    answered = [r for r in records if r["status"] in (200, "invalid")]
    ttft = [r["ttft_s"] for r in answered if r.get("ttft_s") is not None]
    ttft_sources = sorted({r["ttft_source"] for r in answered if r.get("ttft_s") is not None})
    server_itl = [r["server_itl_s"] for r in answered if r.get("server_itl_s") is not None]
    itl = [x for r in ok for x in r.get("itl_s", [])]
    decode = [r["decode_tok_s"] for r in ok if r.get("decode_tok_s")]

    def pct(v):
        return {f"p{p}": percentile(v, p) for p in (50, 90, 99)}

    summary = {
        "url": args.url,
        "model": args.model,
        "scenario": args.scenario,
        "users": None if args.rate else args.users,
        "rate": args.rate,
        "max_tokens": args.max_tokens,
        "requests": len(records),
        "ok": len(ok),
        "errors_by_status": errors,
        "truncated_by_max_tokens": sum(1 for r in ok if r.get("finish_reason") == "length"),
        "error_samples": [r["error"] for r in records if r["error"]][:5],
        "wall_s": wall,
        "generated_tokens": generated,
        "without_usage": len(without_usage),
        "aggregate_tok_s": generated / wall if wall > 0 else None,
        "answered_tokens": answered_tokens,
        "aggregate_answered_tok_s": answered_tokens / wall if wall > 0 else None,
        "per_stream_decode_tok_s": {"mean": statistics.mean(decode) if decode else None, **pct(decode)},
        "ttft_s": pct(ttft),
        "ttft_source": "+".join(ttft_sources) or None,
        "itl_s": pct(itl),
        "server_itl_s": pct(server_itl),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"summary": summary, "records": records}, f, indent=1)
        import os

        os.replace(tmp, args.out)
    sys.exit(0 if not errors else 1)


if __name__ == "__main__":
    main()
