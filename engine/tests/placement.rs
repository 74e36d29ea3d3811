//! Placement changes speed, never results: the same logits bits and the same greedy tokens
//! whether every expert is resident, or read from disk through a cache that holds no expert,
//! one expert, half of them or all of them, on 1 or 2 threads.

use std::path::{Path, PathBuf};

use colibri::format::safetensors::Checkpoint;
use colibri::model::{self, CausalLm, Logits};
use colibri::runtime::generate::{generate, GenerateParams};
use colibri::runtime::sampling::SamplingParams;
use colibri::store::StoreOptions;

fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(arch)
}

fn prompt(arch: &str) -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(arch).join("reference.json")).unwrap(),
    )
    .unwrap();
    v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits of the prompt as a batch, then 8 greedy tokens decoded through the cache.
fn outputs(m: &dyn CausalLm, ids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut cache = m.new_cache(ids.len());
    let logits = m.forward(ids, &mut cache, Logits::All).unwrap();
    let params = GenerateParams {
        max_tokens: 8,
        eos_token_ids: vec![],
        stop_strings: vec![],
        sampling: SamplingParams::greedy(),
    };
    let g = generate(m, None, ids, &params, |_| {}, |_| {}).unwrap();
    (logits.iter().map(|x| x.to_bits()).collect(), g.tokens)
}

#[test]
fn every_budget_and_thread_count_gives_identical_bits() {
    for arch in ["mixtral", "olmoe", "qwen3_moe"] {
        let dir = fixture(arch);
        let ids = prompt(arch);
        let reference = outputs(model::load(&dir).unwrap().as_ref(), &ids);
        let resident = model::load(&dir).unwrap();
        let info = resident.info().clone();
        let dense = info.dense_bytes as u64;
        let experts = info.routed_expert_bytes as u64;
        let one_expert = experts / (info.moe_layers * info.routed_experts) as u64;
        assert_eq!(
            dense + experts,
            Checkpoint::open(&dir).unwrap().total_bytes() as u64
        );
        for (what, budget) in [
            ("no expert", dense),
            ("one expert", dense + one_expert),
            ("half", dense + experts / 2),
            ("all", dense + experts),
        ] {
            for (threads, prefetch) in [(1, false), (2, false), (1, true), (2, true)] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let opts = StoreOptions {
                    ram_budget: Some(budget),
                    io_threads: 2,
                    prefetch,
                };
                let got = pool.install(|| {
                    let m = model::load_with(&dir, &opts).unwrap();
                    outputs(m.as_ref(), &ids)
                });
                assert!(
                    got.0 == reference.0,
                    "{arch}: logits differ: budget `{what}`, {threads} threads, prefetch {prefetch}"
                );
                assert_eq!(
                    got.1, reference.1,
                    "{arch}: tokens differ: budget `{what}`, {threads} threads, prefetch {prefetch}"
                );
            }
        }
    }
}

#[test]
fn a_budget_below_the_resident_set_is_refused_with_numbers() {
    let dir = fixture("olmoe");
    let opts = StoreOptions {
        ram_budget: Some(1000),
        ..StoreOptions::default()
    };
    let e = model::load_with(&dir, &opts)
        .err()
        .expect("must fail")
        .to_string();
    assert!(
        e.contains("resident") && e.contains("budget") && e.contains("--ram"),
        "{e}"
    );
}

#[test]
fn the_tiered_store_really_reads_from_disk_and_prefetch_guesses() {
    let dir = fixture("olmoe");
    let ids = prompt("olmoe");
    let resident = model::load(&dir).unwrap().info().dense_bytes as u64;
    // Budget for no expert: every expert of every step is read.
    let m = model::load_with(
        &dir,
        &StoreOptions {
            ram_budget: Some(resident),
            io_threads: 2,
            prefetch: true,
        },
    )
    .unwrap();
    let _ = outputs(m.as_ref(), &ids);
    let s = m.store_stats().expect("tiered store keeps stats");
    assert_eq!(s.hits, 0, "nothing fits, so nothing can hit");
    assert!(s.misses > 0 && s.bytes_read >= s.miss_bytes, "{s:?}");
    assert!(
        s.prefetch_needed > 0,
        "hints were given before layer 1: {s:?}"
    );
    // Budget for everything: after the first step, steps hit.
    let all = resident + m.info().routed_expert_bytes as u64;
    let m = model::load_with(
        &dir,
        &StoreOptions {
            ram_budget: Some(all),
            io_threads: 2,
            prefetch: false,
        },
    )
    .unwrap();
    let _ = outputs(m.as_ref(), &ids);
    let s = m.store_stats().unwrap();
    assert!(
        s.hits > 0 && s.bytes_read <= m.info().routed_expert_bytes as u64,
        "{s:?}"
    );
}
