//! The server's Prometheus metrics (`GET /metrics`): request counts by endpoint and status,
//! queue and slot gauges, time-to-first-token and inter-token latency histograms, token
//! counters, and the expert store's hit rate, bytes read per drive and memory use — read from
//! the scheduler's and the store's own counters at scrape time. Running totals are exported as
//! counters (named `*_total`), levels as gauges (never named `*_total`).

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

use colibri::runtime::drafts::DraftSource;
use colibri::runtime::scheduler::SchedulerStats;
use colibri::store::StoreSnapshot;

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    pub prompt_tokens: IntCounter,
    pub generated_tokens: IntCounter,
    pub cached_tokens: IntCounter,
    queue_depth: IntGauge,
    active_slots: IntGauge,
    slots: IntGauge,
    engine_steps: IntCounter,
    engine_rows: IntCounter,
    draft_proposed: IntCounterVec,
    draft_accepted: IntCounterVec,
    draft_steps: IntCounter,
    draft_break_even: Gauge,
    step_fixed_seconds: Gauge,
    step_row_seconds: Gauge,
    prompt_budget: Gauge,
    expert_hits: IntCounter,
    expert_misses: IntCounter,
    expert_hit_rate: Gauge,
    expert_vram_hits: IntCounter,
    device_upload_bytes: IntCounter,
    device_seconds: GaugeVec,
    bytes_read: IntCounterVec,
    memory: GaugeVec,
    ready: IntGauge,
    /// Held by [`Metrics::render`]: raising a mirrored counter reads it first.
    refresh: Mutex<()>,
}

/// Raises `counter`, which mirrors an engine total, to `total` (such totals only grow while
/// the process runs, and the counter starts with the process).
fn mirror(counter: &IntCounter, total: u64) {
    let now = counter.get();
    if total > now {
        counter.inc_by(total - now);
    }
}

fn must<T>(r: prometheus::Result<T>) -> T {
    r.expect("metric definitions are static and valid")
}

impl Metrics {
    /// Register every metric.
    pub fn new(slots: usize) -> Metrics {
        let registry = Registry::new();
        let latency = || {
            vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            ]
        };
        let requests = must(IntCounterVec::new(
            Opts::new(
                "coli_requests_total",
                "HTTP API requests by endpoint and status",
            ),
            &["endpoint", "status"],
        ));
        let ttft = must(Histogram::with_opts(
            HistogramOpts::new(
                "coli_time_to_first_token_seconds",
                "Time from request arrival to its first generated token",
            )
            .buckets(latency()),
        ));
        let inter_token = must(Histogram::with_opts(
            HistogramOpts::new(
                "coli_inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        ));
        let e2e = must(Histogram::with_opts(
            HistogramOpts::new(
                "coli_request_duration_seconds",
                "Time from request arrival to its last token",
            )
            .buckets(latency()),
        ));
        let counter = |name: &str, help: &str| must(IntCounter::new(name, help));
        let gauge = |name: &str, help: &str| must(IntGauge::new(name, help));
        let float_gauge = |name: &str, help: &str| must(Gauge::new(name, help));
        let m = Metrics {
            requests,
            ttft,
            inter_token,
            e2e,
            prompt_tokens: counter(
                "coli_prompt_tokens_total",
                "Prompt tokens of finished requests",
            ),
            generated_tokens: counter("coli_generated_tokens_total", "Generated tokens"),
            cached_tokens: counter(
                "coli_cached_prompt_tokens_total",
                "Prompt tokens reused from a slot's KV cache",
            ),
            queue_depth: gauge("coli_queue_depth", "Requests waiting for a slot"),
            active_slots: gauge("coli_active_slots", "Slots running a request"),
            slots: gauge("coli_slots", "Sequence slots"),
            engine_steps: counter("coli_engine_steps_total", "Batched engine steps run"),
            engine_rows: counter("coli_engine_rows_total", "Token rows run through the model"),
            draft_proposed: must(IntCounterVec::new(
                Opts::new(
                    "coli_draft_proposed_tokens_total",
                    "Draft tokens verified by the main model, by source (ngram, grammar)",
                ),
                &["source"],
            )),
            draft_accepted: must(IntCounterVec::new(
                Opts::new(
                    "coli_draft_accepted_tokens_total",
                    "Draft tokens that were the model's own choice (each one a token without a step of its own), by source",
                ),
                &["source"],
            )),
            draft_steps: counter(
                "coli_draft_steps_total",
                "Decode rows of a sequence that carried a draft",
            ),
            draft_break_even: float_gauge(
                "coli_draft_break_even_acceptance",
                "Measured acceptance at which a drafted row pays for itself (one decoding sequence); NaN until measured",
            ),
            step_fixed_seconds: float_gauge(
                "coli_step_fixed_seconds",
                "Fitted seconds of an engine step beside its rows (step time = fixed + per row × rows); NaN until measured",
            ),
            step_row_seconds: float_gauge(
                "coli_step_row_seconds",
                "Fitted seconds each row adds to an engine step; NaN until measured",
            ),
            prompt_budget: float_gauge(
                "coli_prompt_budget_tokens",
                "Prompt tokens the last step with prompts waiting could prefill (prefill_budget, or measured from the step cost); NaN while none applies",
            ),
            expert_hits: counter(
                "coli_expert_cache_hits_total",
                "Routed experts found in memory",
            ),
            expert_misses: counter(
                "coli_expert_cache_misses_total",
                "Routed experts that had to be read",
            ),
            expert_hit_rate: float_gauge(
                "coli_expert_cache_hit_rate",
                "Share of routed-expert uses served from memory",
            ),
            expert_vram_hits: counter(
                "coli_expert_vram_hits_total",
                "Routed experts computed from their copy in VRAM (also counted as hits)",
            ),
            device_upload_bytes: counter(
                "coli_device_upload_bytes_total",
                "Bytes of matrices uploaded to the compute device",
            ),
            device_seconds: must(GaugeVec::new(
                Opts::new(
                    "coli_device_seconds",
                    "Cumulative seconds on the compute device, by stage: upload (matrices), \
                     product (host view of products), kernel (device timestamps)",
                ),
                &["stage"],
            )),
            bytes_read: must(IntCounterVec::new(
                Opts::new(
                    "coli_bytes_read_total",
                    "Bytes of expert weights read, by tier and drive",
                ),
                &["tier", "drive"],
            )),
            memory: must(GaugeVec::new(
                Opts::new("coli_memory_bytes", "Bytes held, by tier and kind"),
                &["tier", "kind"],
            )),
            ready: gauge("coli_ready", "1 once the model is loaded and warm"),
            refresh: Mutex::new(()),
            registry,
        };
        m.slots.set(slots as i64);
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.requests.clone()),
            Box::new(m.ttft.clone()),
            Box::new(m.inter_token.clone()),
            Box::new(m.e2e.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.generated_tokens.clone()),
            Box::new(m.cached_tokens.clone()),
            Box::new(m.queue_depth.clone()),
            Box::new(m.active_slots.clone()),
            Box::new(m.slots.clone()),
            Box::new(m.engine_steps.clone()),
            Box::new(m.engine_rows.clone()),
            Box::new(m.draft_proposed.clone()),
            Box::new(m.draft_accepted.clone()),
            Box::new(m.draft_steps.clone()),
            Box::new(m.draft_break_even.clone()),
            Box::new(m.step_fixed_seconds.clone()),
            Box::new(m.step_row_seconds.clone()),
            Box::new(m.prompt_budget.clone()),
            Box::new(m.expert_hits.clone()),
            Box::new(m.expert_misses.clone()),
            Box::new(m.expert_hit_rate.clone()),
            Box::new(m.expert_vram_hits.clone()),
            Box::new(m.device_upload_bytes.clone()),
            Box::new(m.device_seconds.clone()),
            Box::new(m.bytes_read.clone()),
            Box::new(m.memory.clone()),
            Box::new(m.ready.clone()),
        ];
        for c in collectors {
            must(m.registry.register(c));
        }
        m
    }

    /// Count a finished HTTP request.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .with_label_values(&[endpoint, &status.to_string()])
            .inc();
    }

    /// Render the text exposition format, refreshing the metrics that mirror engine counters.
    pub fn render(
        &self,
        ready: bool,
        scheduler: Option<&SchedulerStats>,
        store: Option<StoreSnapshot>,
        resident_bytes: u64,
        kv_bytes: u64,
    ) -> String {
        let _refreshing = self.refresh.lock().unwrap_or_else(|e| e.into_inner());
        self.ready.set(ready as i64);
        if let Some(s) = scheduler {
            self.queue_depth
                .set(s.queued.load(Ordering::Relaxed) as i64);
            self.active_slots
                .set(s.active.load(Ordering::Relaxed) as i64);
            mirror(&self.engine_steps, s.steps.load(Ordering::Relaxed));
            mirror(&self.engine_rows, s.rows.load(Ordering::Relaxed));
            for source in DraftSource::ALL {
                let (proposed, accepted) = s.drafts(source);
                mirror(
                    &self.draft_proposed.with_label_values(&[source.name()]),
                    proposed,
                );
                mirror(
                    &self.draft_accepted.with_label_values(&[source.name()]),
                    accepted,
                );
            }
            mirror(&self.draft_steps, s.draft_steps.load(Ordering::Relaxed));
            let break_even = *s.draft_break_even.lock().unwrap_or_else(|e| e.into_inner());
            self.draft_break_even.set(break_even.unwrap_or(f64::NAN));
            let cost = *s.step_cost.lock().unwrap_or_else(|e| e.into_inner());
            self.step_fixed_seconds
                .set(cost.map_or(f64::NAN, |(a, _)| a));
            self.step_row_seconds.set(cost.map_or(f64::NAN, |(_, b)| b));
            let budget = *s.prompt_budget.lock().unwrap_or_else(|e| e.into_inner());
            self.prompt_budget
                .set(budget.map_or(f64::NAN, |n| n as f64));
        }
        self.memory
            .with_label_values(&["ram", "resident_weights"])
            .set(resident_bytes as f64);
        self.memory
            .with_label_values(&["ram", "kv_cache"])
            .set(kv_bytes as f64);
        if let Some(st) = store {
            mirror(&self.expert_hits, st.hits);
            mirror(&self.expert_misses, st.misses);
            self.expert_hit_rate.set(st.hit_rate());
            self.memory
                .with_label_values(&["ram", "expert_cache"])
                .set(st.cache_used as f64);
            self.memory
                .with_label_values(&["ram", "expert_cache_capacity"])
                .set(st.cache_capacity as f64);
            self.memory
                .with_label_values(&["ram", "pinned_experts"])
                .set(st.pinned_bytes as f64);
            if !st.device.is_empty() {
                mirror(&self.expert_vram_hits, st.vram_hits);
                mirror(&self.device_upload_bytes, st.device_upload_bytes);
                self.memory
                    .with_label_values(&["vram", "experts"])
                    .set(st.vram_bytes as f64);
                self.memory
                    .with_label_values(&["vram", "dense"])
                    .set(st.device_bytes.saturating_sub(st.vram_bytes) as f64);
                for (stage, secs) in [
                    ("upload", st.device_upload_seconds),
                    ("product", st.device_product_seconds),
                    ("kernel", st.device_kernel_seconds),
                ] {
                    self.device_seconds.with_label_values(&[stage]).set(secs);
                }
            }
            if st.drives.is_empty() {
                mirror(
                    &self.bytes_read.with_label_values(&["disk", "model"]),
                    st.bytes_read,
                );
            }
            for (drive, bytes) in &st.drives {
                mirror(&self.bytes_read.with_label_values(&["disk", drive]), *bytes);
            }
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("encoding metrics text");
        String::from_utf8(out).expect("metrics text is UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(name, type)` of every `# TYPE` line.
    fn families(text: &str) -> Vec<(String, String)> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (name, kind) = l.split_once(' ').expect("`# TYPE name kind`");
                (name.to_string(), kind.to_string())
            })
            .collect()
    }

    fn sample(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
            .parse()
            .unwrap()
    }

    fn snapshot(hits: u64, misses: u64, drives: &[(&str, u64)]) -> StoreSnapshot {
        StoreSnapshot {
            hits,
            misses,
            drives: drives.iter().map(|(d, b)| (d.to_string(), *b)).collect(),
            ..StoreSnapshot::default()
        }
    }

    /// A scrape of a ready server with these engine and store totals, no requests in flight.
    fn render(m: &Metrics, stats: &SchedulerStats, store: StoreSnapshot) -> String {
        m.render(true, Some(stats), Some(store), 0, 0)
    }

    #[test]
    fn totals_are_counters_and_only_counters_are_named_total() {
        let m = Metrics::new(4);
        m.request("/v1/models", 200);
        let stats = SchedulerStats::default();
        let text = render(&m, &stats, snapshot(1, 1, &[("a", 1)]));
        let families = families(&text);
        assert!(families.len() >= 18, "{families:?}");
        for (name, kind) in &families {
            match kind.as_str() {
                "counter" => assert!(name.ends_with("_total"), "counter {name}"),
                _ => assert!(!name.ends_with("_total"), "{kind} {name}"),
            }
        }
        for name in [
            "coli_engine_steps_total",
            "coli_engine_rows_total",
            "coli_expert_cache_hits_total",
            "coli_expert_cache_misses_total",
            "coli_bytes_read_total",
            "coli_requests_total",
        ] {
            assert!(
                families.contains(&(name.to_string(), "counter".to_string())),
                "{name} is not a counter: {families:?}"
            );
        }
    }

    #[test]
    fn mirrored_counters_follow_the_engine_totals() {
        let m = Metrics::new(1);
        let stats = SchedulerStats::default();
        stats.steps.store(7, Ordering::Relaxed);
        stats.rows.store(40, Ordering::Relaxed);
        let text = render(&m, &stats, snapshot(3, 2, &[("model", 100), ("m1", 50)]));
        assert_eq!(sample(&text, "coli_engine_steps_total"), 7.0);
        assert_eq!(sample(&text, "coli_engine_rows_total"), 40.0);
        assert_eq!(
            sample(&text, "coli_draft_proposed_tokens_total{source=\"ngram\"}"),
            0.0
        );
        assert!(sample(&text, "coli_draft_break_even_acceptance").is_nan());
        assert!(sample(&text, "coli_step_fixed_seconds").is_nan());
        assert!(sample(&text, "coli_step_row_seconds").is_nan());
        assert!(sample(&text, "coli_prompt_budget_tokens").is_nan());
        *stats.step_cost.lock().unwrap() = Some((0.03, 0.002));
        *stats.prompt_budget.lock().unwrap() = Some(96);
        stats.draft_tokens[DraftSource::Ngram as usize].store(12, Ordering::Relaxed);
        stats.draft_accepted[DraftSource::Ngram as usize].store(5, Ordering::Relaxed);
        stats.draft_tokens[DraftSource::Grammar as usize].store(3, Ordering::Relaxed);
        *stats.draft_break_even.lock().unwrap() = Some(0.25);
        let text = render(&m, &stats, snapshot(3, 2, &[("model", 100), ("m1", 50)]));
        let series = |name: &str, source: &str| format!("{name}{{source=\"{source}\"}}");
        assert_eq!(
            sample(&text, &series("coli_draft_proposed_tokens_total", "ngram")),
            12.0
        );
        assert_eq!(
            sample(&text, &series("coli_draft_accepted_tokens_total", "ngram")),
            5.0
        );
        assert_eq!(
            sample(
                &text,
                &series("coli_draft_proposed_tokens_total", "grammar")
            ),
            3.0
        );
        assert_eq!(sample(&text, "coli_draft_break_even_acceptance"), 0.25);
        assert_eq!(sample(&text, "coli_step_fixed_seconds"), 0.03);
        assert_eq!(sample(&text, "coli_step_row_seconds"), 0.002);
        assert_eq!(sample(&text, "coli_prompt_budget_tokens"), 96.0);
        assert_eq!(sample(&text, "coli_expert_cache_hits_total"), 3.0);
        assert_eq!(sample(&text, "coli_expert_cache_misses_total"), 2.0);
        let drive = |d: &str| format!("coli_bytes_read_total{{drive=\"{d}\",tier=\"disk\"}}");
        assert_eq!(sample(&text, &drive("model")), 100.0);
        assert_eq!(sample(&text, &drive("m1")), 50.0);
        // A second scrape reports the new totals, not their sum with the old ones.
        stats.steps.store(9, Ordering::Relaxed);
        let text = render(&m, &stats, snapshot(5, 2, &[("model", 130), ("m1", 50)]));
        assert_eq!(sample(&text, "coli_engine_steps_total"), 9.0);
        assert_eq!(sample(&text, "coli_engine_rows_total"), 40.0);
        assert_eq!(sample(&text, "coli_expert_cache_hits_total"), 5.0);
        assert_eq!(sample(&text, &drive("model")), 130.0);
        assert_eq!(sample(&text, &drive("m1")), 50.0);
    }
}
