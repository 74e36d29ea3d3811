"""`/metrics` (Prometheus text), `/openapi.json` (a valid OpenAPI 3 document) and a bounded
schemathesis run against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from openapi_spec_validator import validate

from helpers import SUMMARY


def test_metrics_parse_and_name_the_server_metrics(server):
    m = server.metrics()
    assert m.types["coli_time_to_first_token_seconds"] == "histogram"
    assert m.types["coli_inter_token_latency_seconds"] == "histogram"
    assert m.types["coli_queue_depth"] == "gauge"
    assert m.types["coli_active_slots"] == "gauge"
    assert m.types["coli_expert_cache_hit_rate"] == "gauge"
    # The parser names a counter's family without `_total`; the sample keeps it.
    assert m.types["coli_requests"] == "counter"
    names = m.names()
    for name in (
        "coli_time_to_first_token_seconds_bucket",
        "coli_time_to_first_token_seconds_count",
        "coli_inter_token_latency_seconds_sum",
        "coli_queue_depth",
        "coli_active_slots",
        "coli_expert_cache_hit_rate",
        "coli_slots",
        "coli_ready",
        "coli_engine_rows_total",
    ):
        assert name in names, name
    assert m.get("coli_slots") == 4
    assert m.get("coli_ready") == 1
    assert 0.0 <= m.get("coli_expert_cache_hit_rate") <= 1.0


def test_only_counters_are_named_total(server):
    """Prometheus reserves `_total` for counters: the running totals are counters, and no
    other family's name ends in `_total`."""
    m = server.metrics()
    # The parser names a counter's family without `_total`; a gauge keeps its name whole.
    for family in ("coli_engine_steps", "coli_engine_rows", "coli_expert_cache_hits", "coli_expert_cache_misses",
                   "coli_bytes_read", "coli_requests", "coli_generated_tokens"):
        assert m.types.get(family) == "counter", (family, m.types.get(family), m.types.get(family + "_total"))
    for family, kind in m.types.items():
        assert not family.endswith("_total"), f"the {kind} {family} is named like a counter"
    declared = dict(line.split()[2:4] for line in m.text.splitlines() if line.startswith("# TYPE "))
    for name, kind in declared.items():
        assert name.endswith("_total") == (kind == "counter"), f"{kind} {name}"


def test_metrics_count_a_request(server):
    server.wait_idle()
    before = server.metrics()
    r = server.client().chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": "Count me."}],
        max_tokens=9,
        temperature=0.5,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics()

    def delta(name, **labels):
        return after.get(name, default=0.0, **labels) - before.get(name, default=0.0, **labels)

    assert "coli_requests_total" in after.names()
    assert delta("coli_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("coli_time_to_first_token_seconds_count") == 1
    assert delta("coli_time_to_first_token_seconds_sum") > 0
    assert delta("coli_inter_token_latency_seconds_count") == 9 - 1
    assert delta("coli_request_duration_seconds_count") == 1
    assert delta("coli_generated_tokens_total") == r.usage.completion_tokens == 9
    assert delta("coli_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("coli_cached_prompt_tokens_total") == r.usage.prompt_tokens_details.cached_tokens
    assert delta("coli_engine_steps_total") >= 9
    # Histogram buckets are cumulative.
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in after.samples.items()
        if name == "coli_time_to_first_token_seconds_bucket"
    )
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)
    assert buckets[-1][0] == float("inf")
    assert buckets[-1][1] == after.get("coli_time_to_first_token_seconds_count")

    # Errors are counted by status.
    bad = server.http().post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
    assert bad.status_code == 400
    assert server.metrics().get("coli_requests_total", endpoint="/v1/chat/completions", status="400") == (
        after.get("coli_requests_total", default=0.0, endpoint="/v1/chat/completions", status="400") + 1
    )


def test_openapi_document_is_valid(server):
    r = server.http().get("/openapi.json")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    spec = r.json()
    validate(spec)
    assert spec["openapi"].startswith("3.")
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
    ):
        assert path in spec["paths"], path
    assert "post" in spec["paths"]["/v1/chat/completions"]
    assert "post" in spec["paths"]["/v1/completions"]
    assert "get" in spec["paths"]["/v1/models"]
    schemas = spec["components"]["schemas"]
    for name in ("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "Completion", "ErrorBody"):
        assert name in schemas, name
    assert "api_key" in spec["components"]["securitySchemes"]


def test_schemathesis_finds_no_server_errors(cap8_server, tmp_path):
    """Property-based requests from the server's own schema: no 5xx, responses match the schema.

    Bounded: 25 examples per operation (plus schemathesis' coverage phase), a fixed seed, and a
    server that generates at most 8 tokens per request. `schemathesis_hooks.py` points the
    generated bodies at the served model.
    """
    exe = Path(sys.executable).with_name("schemathesis")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "schemathesis.cli"]
    report, har = tmp_path / "report.json", tmp_path / "report.har"
    cmd += [
        "run",
        cap8_server.url + "/openapi.json",
        "--checks", "not_a_server_error,response_schema_conformance",
        "--max-examples", "25",
        "--seed", "20240601",
        "--workers", "1",
        "--request-timeout", "30",
        "--report", "json,har",
        "--report-json-path", str(report),
        "--report-har-path", str(har),
        "--no-color",
    ]
    env = dict(
        os.environ,
        NO_COLOR="1",
        SCHEMATHESIS_HOOKS=str(Path(__file__).with_name("schemathesis_hooks.py")),
        COLI_TEST_MODEL_ID=cap8_server.model_id,
        COLI_TEST_MAX_TOKENS_CAP="8",
    )
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    line = "schemathesis (25 examples per operation, --max-tokens-cap 8): "
    rep: dict = {}
    statuses: Counter = Counter()
    server_errors = 0
    if report.exists():
        rep = json.loads(report.read_text())
        line += json.dumps(rep["test_cases"])
    if har.exists():
        for entry in json.loads(har.read_text())["log"]["entries"]:
            path = "/" + entry["request"]["url"].split("/", 3)[-1]
            status = entry["response"]["status"]
            statuses[f"{entry['request']['method']} {path} {status}"] += 1
            server_errors += status >= 500
        line += "; responses: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
    SUMMARY.append(line)
    assert r.returncode == 0, out[-8000:]
    assert rep["failures"] == [] and rep["errors"] == [], rep["failures"] or rep["errors"]
    assert rep["operations"]["tested"] == rep["operations"]["total"] >= 6
    assert server_errors == 0, statuses


def test_a_span_per_request_goes_to_the_otlp_collector(start_server):
    """With `--otlp-endpoint` and `--otlp-protocol http/json`, each request becomes one
    OTLP/HTTP JSON span carrying its slot, token counts and timings; a refused request becomes a
    span with an error status. (server/tests/otel_tls.rs covers protobuf, https and
    `traceparent`.)"""
    import http.server
    import queue
    import threading

    received: "queue.Queue[dict]" = queue.Queue()

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.path == "/v1/traces", self.path
            assert self.headers["Content-Type"] == "application/json"
            for rs in json.loads(body)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        received.put(span)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    collector = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        s = start_server(
            "--otlp-endpoint",
            f"http://127.0.0.1:{collector.server_address[1]}",
            "--otlp-protocol",
            "http/json",
            "--slots",
            "1",
            "--drain-secs",
            "5",
            name="otlp",
        )
        r = s.client().chat.completions.create(
            model=s.model_id,
            messages=[{"role": "user", "content": "Trace me."}],
            max_tokens=7,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        span = received.get(timeout=30)
        attrs = {a["key"]: a["value"] for a in span["attributes"]}
        assert span["name"] == "POST /v1/chat/completions"
        assert span["status"]["code"] == 1
        assert int(attrs["coli.prompt_tokens"]["intValue"]) == r.usage.prompt_tokens
        assert int(attrs["coli.generated_tokens"]["intValue"]) == r.usage.completion_tokens == 7
        assert int(attrs["coli.cached_tokens"]["intValue"]) == r.usage.prompt_tokens_details.cached_tokens
        assert int(attrs["coli.slot"]["intValue"]) == 0
        assert attrs["coli.request_id"]["stringValue"] == r.id
        assert attrs["coli.finish_reason"]["stringValue"] == "length"
        assert int(span["endTimeUnixNano"]) > int(span["startTimeUnixNano"])
        assert len(span["traceId"]) == 32 and len(span["spanId"]) == 16

        # A refused request: an error span with its status.
        import openai

        try:
            s.client().chat.completions.create(
                model=s.model_id, messages=[{"role": "user", "content": "x"}], temperature=9
            )
            raise AssertionError("temperature 9 was accepted")
        except openai.BadRequestError:
            pass
        span = received.get(timeout=30)
        attrs = {a["key"]: a["value"] for a in span["attributes"]}
        assert span["status"]["code"] == 2 and "temperature" in span["status"]["message"]
        assert int(attrs["http.response.status_code"]["intValue"]) == 400
    finally:
        collector.shutdown()
