//! Grammar and JSON-schema compilation (`GrammarVocab::constraint`): the first byte picks the
//! kind (JSON schema strict or not, Lark, regex, any JSON object), the rest is its text, over
//! the vocabulary of the llama fixture's tokenizer. Too large, too deep, invalid or
//! unsatisfiable must be an error; a constraint that compiles must allow some token at the
//! start, and walking it for a few tokens (always the first allowed one) must give errors,
//! not panics; a mask that is `Ok` allows at least one token.
#![no_main]

use std::sync::OnceLock;

use colibri::format::tokenizer::Tokenizer;
use colibri::runtime::grammar::{Grammar, GrammarVocab};
use libfuzzer_sys::fuzz_target;

fn vocab() -> &'static GrammarVocab {
    static VOCAB: OnceLock<GrammarVocab> = OnceLock::new();
    VOCAB.get_or_init(|| {
        let tok = Tokenizer::from_file(&colibri_fuzz::fixtures().join("llama/tokenizer.json"))
            .expect("the llama fixture's tokenizer");
        let eos = tok.vocab_size() as u32 - 1;
        GrammarVocab::new(tok.inner(), &[eos]).expect("a byte-level vocabulary")
    })
}

fuzz_target!(|data: &[u8]| {
    // llguidance compiles on a thread of its own; a panic there is caught and reported as an
    // invalid constraint.
    colibri_fuzz::catching_panics();
    let Some((&kind, text)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let grammar = match kind % 5 {
        0 | 1 => match serde_json::from_str(text) {
            Ok(schema) => Grammar::JsonSchema {
                schema,
                strict: kind % 5 == 0,
            },
            Err(_) => return,
        },
        2 => Grammar::Lark(text.to_string()),
        3 => Grammar::Regex(text.to_string()),
        _ => Grammar::JsonObject,
    };
    let vocab = vocab();
    let Ok(mut c) = vocab.constraint(&grammar) else {
        return;
    };
    let mut logits = vec![0.0f32; vocab.vocab_size()];
    for step in 0..8 {
        logits.fill(0.0);
        if c.is_finished() {
            break;
        }
        // The first mask was computed when it compiled: it must allow something. Later a
        // grammar may reach a dead end (the engine ends that request alone): an error.
        if let Err(e) = c.mask_logits(&mut logits) {
            assert!(
                step > 0,
                "a compiled constraint allows nothing at the start: {e}"
            );
            break;
        }
        let Some(token) = logits.iter().position(|l| l.is_finite()) else {
            panic!("step {step}: mask_logits said Ok but allowed nothing");
        };
        if c.consume(token as u32).is_err() {
            break;
        }
    }
});
