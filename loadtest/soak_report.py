#!/usr/bin/env python3
"""The soak's verdict, from what loadtest/soak.sh left in OUT_DIR.

    target/soak-venv/bin/python loadtest/soak_report.py OUT_DIR

Writes OUT_DIR/summary.json and OUT_DIR/soak.png (matplotlib), prints the summary, and exits 1
when a check fails:

- statuses: every request is answered (a checked, complete answer), 429 or 503 (also a 503 as an
  error event in a stream); any other status, a connection error, a timeout or an answer that
  fails loadtest.py's check fails the soak;
- memory: the server's RSS after the warm-up (the first 5 minutes, or a sixth of a shorter run) grows by less than
  2 % of its mean over the rest of the run (least-squares slope × duration);
- misbehaving clients: every slowloris connection closed within the header timeout plus slack,
  every mid-stream disconnect got a stream started (200) first; the slots and queue empty after
  the load (run.txt's idle_after_load); SIGTERM ended the server with status 0;
- Prometheus: it scraped the server all through the run (`up` 1 until SIGTERM, then 0), and each
  alert rule's observed state matches what the script's own samples (samples.csv, read from
  /metrics and /ready apart from Prometheus) and the load test's records say it should be:
  ColibriQueueSaturated fires iff the queue depth stayed >= 51 for its 5 minutes;
  ColibriHighErrorRate iff the 5xx share of requests over 5 minutes stayed above 5 % for 5
  minutes; ColibriNotReady iff /ready failed for 10 minutes; ColibriExpertHitRateCollapse iff the
  15-minute hit ratio stayed under 0.5 for 15 minutes; ColibriTargetDown is pending (not yet
  firing: its `for` is 5 minutes) once the server is gone. A run within a margin of a threshold
  (an evaluation interval each side) is "borderline" and not judged.
"""

import csv
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loadtest import percentile  # the same percentile the load test reports  # noqa: E402

WARMUP_S = 300
MARGIN_S = 15  # three scrape/evaluation intervals
OVERLOAD = {"429", "503", "stream:service_unavailable"}


def read_kv(path):
    out = {}
    for line in open(path):
        for part in line.split():
            if "=" in part:
                k, v = part.split("=", 1)
                out[k] = v
    return out


def longest_run(times, flags):
    """The longest stretch (seconds, first time) over which flags stay true, from sampled times."""
    best, best_start, start = 0.0, None, None
    for t, f in zip(times, flags):
        if f and start is None:
            start = t
        if not f:
            start = None
        if start is not None and t - start > best:
            best, best_start = t - start, start
    return best, best_start


def expect(longest_s, hold_s):
    if longest_s >= hold_s + MARGIN_S:
        return "firing"
    if longest_s <= max(0.0, hold_s - MARGIN_S):
        return "inactive"
    return "borderline"


def windowed(times, events, window_s, fn):
    """fn(list of events inside (t - window, t]) at each sample time."""
    out, lo = [], 0
    events = sorted(events)
    for t in times:
        while lo < len(events) and events[lo][0] <= t - window_s:
            lo += 1
        inside = [e for e in events[lo:] if e[0] <= t]
        out.append(fn(inside))
    return out


def main():
    d = sys.argv[1]
    run = read_kv(os.path.join(d, "run.txt"))
    t0, t1 = float(run["start_unix"]), float(run["end_unix"])
    global WARMUP_S
    WARMUP_S = min(WARMUP_S, (t1 - t0) / 6)
    down = float(run["down_unix"])
    checks = {}

    # Requests.
    recs = json.load(open(os.path.join(d, "rate.json")))["records"]
    outcome = lambda r: "ok" if r["error"] is None else str(r["status"])  # noqa: E731
    counts = {}
    for r in recs:
        counts[outcome(r)] = counts.get(outcome(r), 0) + 1
    others = {k: v for k, v in counts.items() if k != "ok" and k not in OVERLOAD}
    checks["only 429/503 as errors"] = not others
    minutes = []
    for m in range(int((t1 - t0) // 60) + 1):
        lo, hi = t0 + 60 * m, t0 + 60 * (m + 1)
        inside = [r for r in recs if lo <= r["started_at"] < hi]
        ok = [r for r in inside if r["error"] is None]
        lat = [r["latency_s"] for r in ok]
        ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
        minutes.append(
            {
                "minute": m,
                "requests": len(inside),
                "ok": len(ok),
                "429": sum(1 for r in inside if str(r["status"]) == "429"),
                "503": sum(1 for r in inside if str(r["status"]) in ("503", "stream:service_unavailable")),
                "latency_p50": percentile(lat, 50),
                "latency_p90": percentile(lat, 90),
                "latency_p99": percentile(lat, 99),
                "ttft_p50": percentile(ttft, 50),
                "ttft_p90": percentile(ttft, 90),
            }
        )

    # Samples.
    rows = list(csv.DictReader(open(os.path.join(d, "samples.csv"))))
    times = [float(r["unix_s"]) for r in rows]
    num = lambda v: float(v) if v not in ("", None) else None  # noqa: E731
    rss = [(t, num(r["rss_kb"])) for t, r in zip(times, rows) if num(r["rss_kb"])]
    after = [(t, v / 1024) for t, v in rss if t0 + WARMUP_S <= t <= t1]
    n = len(after)
    mean_t = sum(t for t, _ in after) / n
    mean_v = sum(v for _, v in after) / n
    slope = sum((t - mean_t) * (v - mean_v) for t, v in after) / sum((t - mean_t) ** 2 for t, _ in after)
    span = after[-1][0] - after[0][0]
    growth = slope * span
    memory = {
        "samples_after_warmup": n,
        "mean_mib": mean_v,
        "min_mib": min(v for _, v in after),
        "max_mib": max(v for _, v in after),
        "first_mib": after[0][1],
        "last_mib": after[-1][1],
        "slope_mib_per_hour": slope * 3600,
        "fitted_growth_mib": growth,
        "fitted_growth_pct": 100 * growth / mean_v,
        "max_during_warmup_mib": max(v / 1024 for t, v in rss if t < t0 + WARMUP_S),
    }
    checks["RSS flat after warm-up (fitted growth < 2 %)"] = abs(memory["fitted_growth_pct"]) < 2

    # Misbehaving clients and the end.
    abuse = json.load(open(os.path.join(d, "abuse.json")))
    sl = abuse["slowloris"]
    checks["slowloris cut off by the header timeout"] = sl["connections"] > 0 and sl["closed_within_limit"] == sl["connections"]
    dc = abuse["disconnect"]
    checks["mid-stream disconnects had started streams"] = dc["requests"] > 0 and set(dc["by_status"]) <= {"200", "429", "503"}
    checks["slots and queue empty after the load"] = run.get("idle_after_load") == "1"
    checks["SIGTERM: exit status 0"] = run.get("server_exit_status") == "0"

    # Prometheus.
    def series(name):
        return json.load(open(os.path.join(d, f"prom-{name}.json")))["data"]["result"]

    up = [(float(t), v) for s in series("up") for t, v in s["values"]]
    up_before = [v for t, v in up if t < down - 5]
    up_after = [v for t, v in up if t > down + 15]
    scraping = {
        "up_samples_before_sigterm": len(up_before),
        "up_1_before_sigterm": up_before.count("1"),
        "up_0_after_sigterm": up_after.count("0"),
        "up_samples_after_sigterm": len(up_after),
    }
    checks["Prometheus scraped all through (up 1, then 0 after SIGTERM)"] = (
        len(up_before) > 0.9 * (down - t0) / 5 and up_before.count("1") == len(up_before) and up_after and set(up_after) == {"0"}
    )
    observed = {}
    for s in series("alerts"):
        name, state = s["metric"]["alertname"], s["metric"]["alertstate"]
        ts = [float(t) for t, _ in s["values"]]
        o = observed.setdefault(name, {})
        o[state] = {"first_s": min(ts) - t0, "last_s": max(ts) - t0}

    live = [i for i, t in enumerate(times) if t <= down]
    lt = [times[i] for i in live]
    qd = [num(rows[i]["queue_depth"]) or 0 for i in live]
    q_long, q_start = longest_run(lt, [q >= 51 for q in qd])
    ready_long, _ = longest_run(lt, [rows[i]["ready"] != "200" for i in live])
    fivexx = [(r["started_at"] + r["latency_s"], str(r["status"]) in ("503", "stream:service_unavailable") or str(r["status"]).startswith("5")) for r in recs]
    share = windowed(lt, fivexx, 300, lambda e: (sum(1 for _, f in e if f) / len(e)) if e else 0.0)
    err_long, _ = longest_run(lt, [s > 0.05 for s in share])
    hits = [(num(rows[i]["cache_hits"]), num(rows[i]["cache_misses"])) for i in live]
    ratio_low = []
    for j, t in enumerate(lt):
        k = next((i for i, tt in enumerate(lt) if tt >= t - 900), 0)
        if k == j or None in hits[j] or None in hits[k]:
            ratio_low.append(False)
            continue
        dh, dm = hits[j][0] - hits[k][0], hits[j][1] - hits[k][1]
        ratio_low.append(dh + dm > 0 and dh / (dh + dm) < 0.5)
    hit_long, _ = longest_run(lt, ratio_low)
    expected = {
        "ColibriQueueSaturated": expect(q_long, 300),
        "ColibriHighErrorRate": expect(err_long, 300),
        "ColibriNotReady": expect(ready_long, 600),
        "ColibriExpertHitRateCollapse": expect(hit_long, 900),
    }
    alerts = {}
    for name, exp in expected.items():
        obs = "firing" if "firing" in observed.get(name, {}) else "inactive"
        alerts[name] = {"expected": exp, "observed": obs, "detail": observed.get(name, {})}
        if exp != "borderline":
            checks[f"alert {name}: {exp}"] = obs == exp
    if q_start is not None and "firing" in observed.get("ColibriQueueSaturated", {}):
        alerts["ColibriQueueSaturated"]["queue_full_from_s"] = q_start - t0
    td = observed.get("ColibriTargetDown", {})
    alerts["ColibriTargetDown"] = {"expected": "pending after SIGTERM", "detail": td}
    checks["alert ColibriTargetDown: pending after SIGTERM"] = "pending" in td and td["pending"]["first_s"] >= down - t0 - 5
    evidence = {
        "queue_ge_51_longest_s": q_long,
        "ready_failing_longest_s": ready_long,
        "fivexx_share_over_5pct_longest_s": err_long,
        "fivexx_share_max": max(share) if share else 0,
        "hit_ratio_15m_under_half_longest_s": hit_long,
    }

    summary = {
        "run": run,
        "duration_s": t1 - t0,
        "requests": len(recs),
        "outcomes": counts,
        "memory": memory,
        "abuse": abuse,
        "prometheus": scraping,
        "alerts": alerts,
        "alert_evidence": evidence,
        "checks": checks,
        "passed": all(checks.values()),
        "minutes": minutes,
    }
    tmp = os.path.join(d, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, os.path.join(d, "summary.json"))
    plot(d, t0, rss, times, rows, minutes, down)
    print(json.dumps({k: v for k, v in summary.items() if k != "minutes"}, indent=1))
    sys.exit(0 if summary["passed"] else 1)


def plot(d, t0, rss, times, rows, minutes, down):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax[0].plot([(t - t0) / 60 for t, _ in rss], [v / 1024 for _, v in rss], lw=1)
    ax[0].axvline(WARMUP_S / 60, color="grey", ls=":", lw=1)
    ax[0].axvline((down - t0) / 60, color="red", ls=":", lw=1)
    ax[0].set_ylabel("server RSS (MiB)")
    ax[0].set_title("soak: RSS, latency and outcomes (dotted: end of warm-up, SIGTERM)")
    mx = [m["minute"] + 0.5 for m in minutes]
    for key, style in (("latency_p50", "-"), ("latency_p90", "--"), ("latency_p99", ":"), ("ttft_p50", "-.")):
        ax[1].plot(mx, [float("nan") if m[key] is None else m[key] for m in minutes], style, label=key.replace("_", " "))
    ax[1].set_ylabel("seconds (answered requests)")
    ax[1].legend(loc="upper left", fontsize=8)
    bottom = [0] * len(minutes)
    for key in ("ok", "429", "503"):
        vals = [m[key] for m in minutes]
        ax[2].bar(mx, vals, bottom=bottom, width=0.9, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[2].set_ylabel("requests started per minute")
    q = ax[2].twinx()
    q.plot([(t - t0) / 60 for t in times], [float(r["queue_depth"] or 0) for r in rows], color="black", lw=0.8)
    q.set_ylabel("queue depth")
    ax[2].legend(loc="upper left", fontsize=8)
    ax[2].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(os.path.join(d, "soak.png"), dpi=90)


if __name__ == "__main__":
    main()
