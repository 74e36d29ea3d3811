#!/usr/bin/env python3
"""Latency and throughput against offered load, from the per-rate JSONs of lb_saturation.sh.

    target/api-venv/bin/python loadtest/chart.py OUT_DIR

Reads OUT_DIR/rate-*.json (loadtest.py --out: {summary, records}) and, when present,
OUT_DIR/rates.csv (load average, max RSS per server); writes OUT_DIR/summary.json (one row per
offered load) and OUT_DIR/latency_vs_load.png (needs matplotlib:
`target/api-venv/bin/pip install matplotlib==3.11.2`).

Definitions: "ok" requests streamed a complete, valid answer. Achieved ok req/s = ok requests ÷
the run's wall time (first request sent → last answer received) and generated tok/s = their
completion tokens ÷ the same wall time (loadtest's aggregate_tok_s). Latency = request sent →
last byte, TTFT = request sent → first token, both over ok requests. Overload answers are 429
(queue full) and 503 (queue timeout), the latter also when it arrives as an error event inside
a stream that had already answered 200 (status `stream:service_unavailable`); everything else
that is not ok (other statuses, connection errors, invalid answers) counts as "other".
"""

import csv
import glob
import json
import os
import sys

from loadtest import percentile  # the same percentile the load test reports

OVERLOAD = {"429", "503", "stream:service_unavailable"}


def read_rates_csv(path):
    rows = {}
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        lines = [l for l in f if l.strip() and not l.startswith("#") and not l.startswith("server ")]
    for r in csv.DictReader(lines):
        rows[float(r["rate"])] = r
    return rows


def nginx_by_rate(path, extra):
    """Per offered load: nginx's client-facing statuses, and the 429s it passed to the other
    backend (proxy_next_upstream) with what came of them, from its access log."""
    import re

    out = {}
    if not os.path.exists(path) or not extra:
        return out
    line_re = re.compile(r"^(\S+) (\d+) up=(.*?) ust=(.*?) rt=")
    windows = sorted((float(e["start_unix"]), float(e["end_unix"]) + 0.5, rate) for rate, e in extra.items())
    with open(path) as f:
        for line in f:
            m = line_re.match(line)
            if not m or "chat/completions" not in line:
                continue
            t, status, ups = float(m.group(1)), m.group(2), m.group(4)
            for lo, hi, rate in windows:
                if lo <= t <= hi:
                    d = out.setdefault(rate, {"statuses": {}, "retried_429": 0, "retried_429_then_200": 0})
                    d["statuses"][status] = d["statuses"].get(status, 0) + 1
                    if ups.startswith("429, "):
                        d["retried_429"] += 1
                        d["retried_429_then_200"] += status == "200"
                    break
    return out


def summarise(out_dir):
    extra = read_rates_csv(os.path.join(out_dir, "rates.csv"))
    lb = nginx_by_rate(os.path.join(out_dir, "nginx-access.log"), extra)
    rows = []
    for path in glob.glob(os.path.join(out_dir, "rate-*.json")):
        with open(path) as f:
            data = json.load(f)
        s, recs = data["summary"], data["records"]
        ok = [r for r in recs if r["error"] is None]
        lat = [r["latency_s"] for r in ok]
        ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
        errors = {str(k): v for k, v in s["errors_by_status"].items()}
        overload = {k: v for k, v in errors.items() if k in OVERLOAD}
        other = {k: v for k, v in errors.items() if k not in OVERLOAD}
        wall = s["wall_s"]
        row = {
            "offered_req_s": s["rate"],
            "requests": s["requests"],
            "ok": len(ok),
            "wall_s": round(wall, 2),
            "achieved_ok_req_s": round(len(ok) / wall, 3),
            "generated_tok_s": round(s["aggregate_tok_s"], 2),
            "latency_s": {f"p{p}": percentile(lat, p) for p in (50, 90, 99)},
            "ttft_s": {f"p{p}": percentile(ttft, p) for p in (50, 90, 99)},
            "max_latency_any_s": max((r["latency_s"] for r in recs), default=None),
            "max_latency_overload_s": max((r["latency_s"] for r in recs if str(r["status"]) in OVERLOAD), default=None),
            "errors_by_status": errors,
            "overload_429": errors.get("429", 0),
            "overload_503": errors.get("503", 0) + errors.get("stream:service_unavailable", 0),
            "overload_503_in_stream": errors.get("stream:service_unavailable", 0),
            "other_errors": sum(other.values()),
            "other_errors_by_status": other,
            "error_samples": s["error_samples"][:3] if other else [],
        }
        e = extra.get(float(s["rate"]))
        if e:
            row["max_rss_mib"] = {"a": round(int(e["max_rss_a_kb"]) / 1024, 1), "b": round(int(e["max_rss_b_kb"]) / 1024, 1)}
            row["loadavg_before"] = e["loadavg_before"]
            row["loadavg_after"] = e["loadavg_after"]
        if float(s["rate"]) in lb:
            row["nginx"] = lb[float(s["rate"])]
        rows.append(row)
    rows.sort(key=lambda r: r["offered_req_s"])
    return rows


def chart(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    x = [r["offered_req_s"] for r in rows]
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 11), sharex=True)

    def series(key, p):
        return [r[key][p] for r in rows]

    a1.plot(x, series("latency_s", "p50"), "o-", color="C0", label="end-to-end p50")
    a1.plot(x, series("latency_s", "p90"), "o--", color="C0", label="end-to-end p90")
    a1.plot(x, series("ttft_s", "p50"), "s-", color="C1", label="TTFT p50")
    a1.plot(x, series("ttft_s", "p90"), "s--", color="C1", label="TTFT p90")
    a1.set_yscale("log")
    a1.yaxis.set_major_formatter(plain)
    a1.set_ylabel("seconds (ok requests)")
    a1.set_title("Two coli serve (1 thread, 2 slots, queue 4) behind nginx — latency vs offered load")
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(loc="upper left", fontsize=8)

    a2.plot(x, x, ":", color="grey", label="offered")
    a2.plot(x, [r["achieved_ok_req_s"] for r in rows], "o-", color="C2", label="achieved ok req/s")
    a2.set_yscale("log")
    a2.yaxis.set_major_formatter(plain)
    a2.set_ylabel("requests / s")
    a2.grid(True, which="both", alpha=0.3)
    t2 = a2.twinx()
    t2.plot(x, [r["generated_tok_s"] for r in rows], "^-", color="C3", label="generated tok/s")
    t2.set_ylabel("generated tokens / s")
    t2.set_ylim(bottom=0)
    h1, l1 = a2.get_legend_handles_labels()
    h2, l2 = t2.get_legend_handles_labels()
    a2.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    a2.set_title("Throughput")

    # Bars at the rates themselves (shared log x axis), side by side, widths proportional to x.
    w = [xi * 0.12 for xi in x]
    ok = [r["ok"] for r in rows]
    e429 = [r["overload_429"] for r in rows]
    e503 = [r["overload_503"] for r in rows]
    other = [r["other_errors"] for r in rows]
    shift = lambda k: [xi * (1.13 ** k) for xi in x]
    a3.bar(shift(-1.5), ok, width=w, color="C2", label="ok")
    a3.bar(shift(-0.5), e429, width=w, color="C1", label="429 queue full")
    a3.bar(shift(0.5), e503, width=w, color="C4", label="503 queue timeout (incl. in-stream)")
    a3.bar(shift(1.5), other, width=w, color="C3", label="other errors / 5xx")
    for xi, o in zip(shift(1.5), other):
        a3.annotate(str(o), (xi, o), ha="center", va="bottom", fontsize=7)
    a3.set_yscale("symlog", linthresh=1)
    a3.yaxis.set_major_formatter(plain)
    a3.set_ylabel("requests per run (symlog)")
    a3.set_title("Outcomes")
    a3.grid(True, axis="y", alpha=0.3)
    a3.legend(loc="upper left", fontsize=8)
    a3.set_xscale("log", base=2)
    a3.set_xticks(x)
    a3.set_xticklabels([f"{v:g}" for v in x])
    a3.set_xlabel("offered load (requests / s, open loop)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: chart.py OUT_DIR")
    out = sys.argv[1]
    rows = summarise(out)
    if not rows:
        sys.exit(f"chart: no rate-*.json in {out}")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    chart(rows, os.path.join(out, "latency_vs_load.png"))
    for r in rows:
        lat, ttft = r["latency_s"], r["ttft_s"]
        fmt = lambda v: "-" if v is None else f"{v:.2f}"
        print(
            f"{r['offered_req_s']:>5g} req/s: {r['ok']}/{r['requests']} ok, {r['achieved_ok_req_s']:.2f} ok req/s, "
            f"{r['generated_tok_s']:.1f} tok/s, latency {fmt(lat['p50'])}/{fmt(lat['p90'])} s, "
            f"TTFT {fmt(ttft['p50'])}/{fmt(ttft['p90'])} s, 429 {r['overload_429']}, 503 {r['overload_503']}, "
            f"other {r['other_errors']}, RSS {r.get('max_rss_mib')}, load [{r.get('loadavg_before')}]"
        )


if __name__ == "__main__":
    main()
