#!/usr/bin/env python3
"""Summarise loadtest/vs_llama_server.sh's runs.jsonl as a markdown table: per stream count and
engine, the median over repetitions of aggregate tok/s (every token of every answered request,
`aggregate_answered_tok_s`, where the run has it: answers the content check refused still cost
the server their tokens), TTFT p50/p90 (from the servers' own `timings` where they send them:
see loadtest/loadtest.py), ITL p50/p90 (each request's mean gap between generated tokens from the
same `timings`, else the gap between chunks with text), the ratio colibri ÷ llama-server of
aggregate tok/s (each colibri run, `colibri` and `colibri-alt`), the load averages seen and what TTFT and ITL were measured from; then the TTFT
percentiles of every request of every repetition together (from the runs' JSON files beside
runs.jsonl).

    python3 loadtest/summarise_servers.py docs/bench/servers-X/runs.jsonl
"""

import json
import os
import statistics
import sys


# The engines vs_llama_server.sh runs, the peer last.
ENGINES = ("colibri", "colibri-alt", "llama.cpp")


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, scale=1.0, digits=1):
    return "–" if v is None else f"{v * scale:.{digits}f}"


def main():
    runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    by = {}
    for r in runs:
        by.setdefault((r["streams"], r["engine"]), []).append(r)
    print("| streams | engine | reps | aggregate tok/s | TTFT p50 / p90 ms | ITL p50 / p90 ms | errors | load avg (1 min) | measured from |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for streams in sorted({s for s, _ in by}):
        agg = {}
        for engine in ENGINES:
            rs = by.get((streams, engine), [])
            if not rs:
                continue
            s = [r["summary"] for r in rs]
            agg[engine] = median([x.get("aggregate_answered_tok_s", x["aggregate_tok_s"]) for x in s])
            ttft50 = median([x["ttft_s"]["p50"] for x in s])
            ttft90 = median([x["ttft_s"]["p90"] for x in s])
            itl_key = "server_itl_s" if all((x.get("server_itl_s") or {}).get("p50") is not None for x in s) else "itl_s"
            itl50 = median([x[itl_key]["p50"] for x in s])
            itl90 = median([x[itl_key]["p90"] for x in s])
            sources = sorted({x.get("ttft_source") or "first_text" for x in s} | {"itl:" + itl_key})
            errors = sum(sum(x["errors_by_status"].values()) for x in s)
            loads = ", ".join(r["loadavg_before"].split()[0] for r in rs)
            print(f"| {streams} | {engine} | {len(rs)} | {fmt(agg[engine])} | {fmt(ttft50, 1000, 0)} / {fmt(ttft90, 1000, 0)} "
                  f"| {fmt(itl50, 1000)} / {fmt(itl90, 1000)} | {errors} | {loads} | {', '.join(sources)} |")
        for engine in ENGINES[:-1]:
            if agg.get(engine) and agg.get("llama.cpp"):
                ratios[(streams, engine)] = agg[engine] / agg["llama.cpp"]
    print()
    for (streams, engine), ratio in ratios.items():
        print(f"- {streams} streams: {engine} ÷ llama-server aggregate tok/s = {ratio:.2f}×")
    # Every request's TTFT, all repetitions together: a closed loop's requests arrive in waves,
    # so one run's median is that of a few waves and jumps between repetitions.
    records = {}
    base = os.path.dirname(sys.argv[1])
    for r in runs:
        path = os.path.join(base, f"{r['engine']}-n{r['streams']}-r{r['rep']}.json")
        if os.path.exists(path):
            for rec in json.load(open(path))["records"]:
                if rec.get("ttft_s") is not None:
                    records.setdefault((r["streams"], r["engine"]), []).append(rec["ttft_s"])
    if records:
        print()
        print("| streams | engine | requests | TTFT p50 / p90 / mean ms, every request of every repetition |")
        print("|---|---|---|---|")
        for (streams, engine), v in sorted(records.items()):
            v.sort()
            p90 = v[min(len(v) - 1, int(0.9 * (len(v) - 1) + 0.5))]
            print(f"| {streams} | {engine} | {len(v)} | {statistics.median(v) * 1000:.0f} / {p90 * 1000:.0f} / {statistics.mean(v) * 1000:.0f} |")


if __name__ == "__main__":
    main()
