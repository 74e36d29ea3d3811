//! Oracle comparison: every family this build runs against its committed transformers
//! fixture (engine/tests/fixtures/<arch>, written by engine/tests/oracle/generate.py).
//!
//! For each fixture: the batched prefill logits are within 1e-4 of transformers' at every
//! position; decoding token by token through the KV cache gives the same bits as the batch;
//! the greedy continuation is identical; and 1 and 2 threads give identical bits.

mod common;
use common::{bits, fixture, ids, reference_json};

use colibri::model::{self, CausalLm, Logits};
use colibri::runtime::generate::{generate, GenerateParams};
use colibri::runtime::sampling::SamplingParams;

const TOLERANCE: f32 = 1e-4;

struct Reference {
    prompt_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy_ids: Vec<u32>,
}

fn reference(arch: &str) -> Reference {
    let v = reference_json(arch);
    let ids = |key: &str| ids(&v, key);
    let logits = v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    Reference {
        prompt_ids: ids("prompt_ids"),
        logits,
        greedy_ids: ids("greedy_ids"),
    }
}

fn prefill(model: &dyn CausalLm, ids: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache(ids.len());
    model.forward(ids, &mut cache, Logits::All).unwrap()
}

fn check(arch: &str) {
    let dir = fixture(arch);
    let r = reference(arch);
    let model = model::load(&dir).unwrap_or_else(|e| panic!("{arch}: {e}"));
    let v = model.info().vocab_size;
    assert!(r.prompt_ids.len() >= 32, "{arch}: prompt too short");

    // 1. Batched prefill against transformers.
    let got = prefill(model.as_ref(), &r.prompt_ids);
    assert_eq!(got.len(), r.prompt_ids.len() * v);
    let mut worst = (0.0f32, 0, 0);
    for (t, want) in r.logits.iter().enumerate() {
        assert_eq!(
            want.len(),
            v,
            "{arch}: reference row {t} has the wrong vocab"
        );
        for (i, (&a, &b)) in got[t * v..(t + 1) * v].iter().zip(want).enumerate() {
            let d = (a - b).abs();
            if d > worst.0 || d.is_nan() {
                worst = (d, t, i);
            }
        }
    }
    assert!(
        worst.0 <= TOLERANCE,
        "{arch}: max |Δlogit| = {} at position {} token {} (tolerance {TOLERANCE})",
        worst.0,
        worst.1,
        worst.2
    );
    eprintln!("{arch}: max |Δlogit| = {:.3e}", worst.0);

    // 2. Token-by-token decode through the cache reproduces the batch exactly.
    let mut cache = model.new_cache(r.prompt_ids.len());
    for (t, &id) in r.prompt_ids.iter().enumerate() {
        let row = model.forward(&[id], &mut cache, Logits::Last).unwrap();
        assert_eq!(
            bits(&row),
            bits(&got[t * v..(t + 1) * v]),
            "{arch}: cached decode differs at position {t}"
        );
    }

    // 3. Greedy continuation.
    let params = GenerateParams {
        max_tokens: r.greedy_ids.len(),
        eos_token_ids: vec![],
        stop_strings: vec![],
        sampling: SamplingParams::greedy(),
    };
    let out = generate(model.as_ref(), None, &r.prompt_ids, &params, |_| {}, |_| {}).unwrap();
    assert_eq!(
        out.tokens, r.greedy_ids,
        "{arch}: greedy continuation differs"
    );

    // 4. Thread count never changes bits.
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let two = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let a = one.install(|| prefill(model.as_ref(), &r.prompt_ids));
    let b = two.install(|| prefill(model.as_ref(), &r.prompt_ids));
    assert_eq!(bits(&a), bits(&b), "{arch}: 1 and 2 threads differ");
    assert_eq!(
        bits(&a),
        bits(&got),
        "{arch}: global pool and 1 thread differ"
    );
}

#[test]
fn llama_matches_transformers() {
    check("llama");
}

#[test]
fn mixtral_matches_transformers() {
    check("mixtral");
}

#[test]
fn olmoe_matches_transformers() {
    check("olmoe");
}

#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3_moe");
}

#[test]
fn glm4_moe_matches_transformers() {
    check("glm4_moe");
}

#[test]
fn deepseek_v3_matches_transformers() {
    check("deepseek_v3");
}

#[test]
fn kimi_k25_matches_transformers() {
    check("kimi_k25");
}

#[test]
fn glm_moe_dsa_matches_transformers() {
    check("glm_moe_dsa");
}

#[test]
fn deepseek_v4_matches_transformers() {
    check("deepseek_v4");
}
