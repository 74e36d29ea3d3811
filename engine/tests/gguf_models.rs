//! GGUF models: each family's transformers fixture converted to GGUF (`colibri::convert`, the
//! code behind `coli convert`) loads through the GGUF path (llama.cpp names, fused experts,
//! permuted Q/K with interleaved RoPE) and still matches transformers: f32 within the oracle
//! tolerance and greedy-identical; quantized mixes load, run and stay close.

mod common;
use common::{argmax, fixture, ids, reference_json};

use colibri::convert::{convert, ConvertType};
use colibri::model::{self, Logits};

fn reference_logits(arch: &str) -> (Vec<u32>, Vec<f32>, Vec<u32>) {
    let v = reference_json(arch);
    let logits = common::reference_logits(arch);
    (ids(&v, "prompt_ids"), logits, ids(&v, "greedy_ids"))
}

// The llama fixture uses llama3 RoPE scaling, which GGUF stores as a `rope_freqs` tensor of
// per-pair divisors; mixtral covers Mixtral written as llama.
const ARCHS: [&str; 4] = ["llama", "mixtral", "olmoe", "qwen3_moe"];

#[test]
fn f32_gguf_of_each_fixture_matches_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in ARCHS {
        let out = tmp.path().join(format!("{arch}.gguf"));
        convert(&fixture(arch), &out, ConvertType::F32, |_, _| {}).unwrap();
        let m = model::load(&out).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let (prompt, want, greedy) = reference_logits(arch);
        let mut cache = m.new_cache(prompt.len() + greedy.len());
        let got = m.forward(&prompt, &mut cache, Logits::All).unwrap();
        assert_eq!(got.len(), want.len(), "{arch}");
        let v = m.info().vocab_size;
        // GGUF's llama architecture has no sliding window (llama.cpp ignores Mixtral's, and
        // so do we on a GGUF file): compare only positions the window does not reach.
        let window = if arch == "mixtral" { 24 } else { prompt.len() };
        let n = window.min(prompt.len()) * v;
        let worst = got[..n]
            .iter()
            .zip(&want[..n])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        // GGUF files run with llama.cpp's f16 KV precision (see model::gguf), hence 5e-3, not
        // the oracle's 1e-4; a wrong tensor mapping is off by ~1.
        assert!(worst <= 5e-3, "{arch}: max |Δlogit| {worst} from GGUF");
        if window < prompt.len() {
            continue;
        }
        // Greedy continuation.
        let mut next = argmax(&got[got.len() - v..]);
        let mut out = vec![];
        for _ in 0..greedy.len() {
            out.push(next);
            let l = m.forward(&[next], &mut cache, Logits::Last).unwrap();
            next = argmax(&l);
        }
        assert_eq!(out, greedy, "{arch}: greedy tokens from GGUF");
    }
}

#[test]
fn quantized_mixes_load_and_stay_close() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in ["mixtral", "qwen3_moe"] {
        let (prompt, want, _) = reference_logits(arch);
        for (mix, bound) in [(ConvertType::Q8_0, 0.05f32), (ConvertType::BF16, 0.05)] {
            let out = tmp.path().join(format!("{arch}-{mix:?}.gguf"));
            convert(&fixture(arch), &out, mix, |_, _| {}).unwrap();
            let m = model::load(&out).unwrap();
            let mut cache = m.new_cache(prompt.len());
            let got = m.forward(&prompt, &mut cache, Logits::All).unwrap();
            let n = 24 * m.info().vocab_size; // inside mixtral's window (see above)
                                              // Mean, not max: in these tiny random models a rounding can flip a near-tied
                                              // routing choice at some position, which moves that row a lot.
            let mean = got[..n]
                .iter()
                .zip(&want[..n])
                .map(|(a, b)| (a - b).abs())
                .sum::<f32>()
                / n as f32;
            let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            assert!(mean > 0.0, "{arch} {mix:?}: quantization changed nothing?");
            assert!(
                mean <= bound * scale.max(1.0),
                "{arch} {mix:?}: mean |Δ| {mean} (logit scale {scale})"
            );
        }
    }
}

#[test]
fn bad_convert_requests_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let e = ConvertType::parse("q3_xyz").unwrap_err().to_string();
    assert!(e.contains("q3_xyz") && e.contains("q4_k_m"), "{e}");
    let out = tmp.path().join("x.gguf");
    let e = convert(&fixture("gpt_oss"), &out, ConvertType::Q8_0, |_, _| {})
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not supported"), "{e}");
    assert!(!out.exists(), "a failed conversion must not leave a file");
}
