//! The server's Prometheus metrics (`GET /metrics`): request counts by endpoint and status,
//! queue and slot gauges, time-to-first-token and inter-token latency histograms, token
//! counters, and the expert store's hit rate, bytes read per drive and memory use — read from
//! the scheduler's and the store's own counters at scrape time.

use std::sync::atomic::Ordering;

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

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
    engine_steps: IntGauge,
    engine_rows: IntGauge,
    expert_hits: IntGauge,
    expert_misses: IntGauge,
    expert_hit_rate: Gauge,
    bytes_read: GaugeVec,
    memory: GaugeVec,
    ready: IntGauge,
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
            engine_steps: gauge("coli_engine_steps_total", "Batched engine steps run"),
            engine_rows: gauge("coli_engine_rows_total", "Token rows run through the model"),
            expert_hits: gauge(
                "coli_expert_cache_hits_total",
                "Routed experts found in memory",
            ),
            expert_misses: gauge(
                "coli_expert_cache_misses_total",
                "Routed experts that had to be read",
            ),
            expert_hit_rate: must(Gauge::new(
                "coli_expert_cache_hit_rate",
                "Share of routed-expert uses served from memory",
            )),
            bytes_read: must(GaugeVec::new(
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
            Box::new(m.expert_hits.clone()),
            Box::new(m.expert_misses.clone()),
            Box::new(m.expert_hit_rate.clone()),
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

    /// Render the text exposition format, refreshing the gauges that mirror engine counters.
    pub fn render(
        &self,
        ready: bool,
        scheduler: Option<&SchedulerStats>,
        store: Option<StoreSnapshot>,
        resident_bytes: u64,
        kv_bytes: u64,
    ) -> String {
        self.ready.set(ready as i64);
        if let Some(s) = scheduler {
            self.queue_depth
                .set(s.queued.load(Ordering::Relaxed) as i64);
            self.active_slots
                .set(s.active.load(Ordering::Relaxed) as i64);
            self.engine_steps
                .set(s.steps.load(Ordering::Relaxed) as i64);
            self.engine_rows.set(s.rows.load(Ordering::Relaxed) as i64);
        }
        self.memory
            .with_label_values(&["ram", "resident_weights"])
            .set(resident_bytes as f64);
        self.memory
            .with_label_values(&["ram", "kv_cache"])
            .set(kv_bytes as f64);
        if let Some(st) = store {
            self.expert_hits.set(st.hits as i64);
            self.expert_misses.set(st.misses as i64);
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
            if st.drives.is_empty() {
                self.bytes_read
                    .with_label_values(&["disk", "model"])
                    .set(st.bytes_read as f64);
            }
            for (drive, bytes) in &st.drives {
                self.bytes_read
                    .with_label_values(&["disk", drive])
                    .set(*bytes as f64);
            }
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("encoding metrics text");
        String::from_utf8(out).expect("metrics text is UTF-8")
    }
}
