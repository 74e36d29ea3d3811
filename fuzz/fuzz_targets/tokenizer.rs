//! `tokenizer.json` loading (`Tokenizer::from_file`: JSON first, the tokenizers crate under
//! `catch_unwind`) and what a loaded tokenizer is used for: encoding, decoding, streaming text
//! (`TextStream`) and the constraint vocabulary (`GrammarVocab::new`). Every failure must be
//! an error, never a panic that escapes, a huge allocation or a long loop.
#![no_main]

use colibri::format::tokenizer::{TextStream, Tokenizer};
use colibri::runtime::grammar::GrammarVocab;
use libfuzzer_sys::fuzz_target;

const SAMPLE: &str = "Hello, world! <|im_start|>user 123 ünïcödé 日本語 \u{1F600}\n\t  end";

fuzz_target!(|data: &[u8]| {
    colibri_fuzz::catching_panics();
    let dir = colibri_fuzz::scratch("tokenizer");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, data).unwrap();
    let Ok(tok) = Tokenizer::from_file(&path) else {
        return;
    };
    let vocab = tok.vocab_size();
    for special in [false, true] {
        let Ok(ids) = tok.encode(SAMPLE, special) else {
            continue;
        };
        let _ = tok.decode(&ids, false);
        let mut stream = TextStream::new();
        for &id in ids.iter().take(64) {
            if stream.push(&tok, id).is_err() {
                break;
            }
        }
        let _ = stream.finish(&tok);
    }
    for id in [0, 1, vocab as u32 / 2, vocab as u32, u32::MAX] {
        let _ = tok.id_to_token(id);
        let _ = tok.decode(&[id], true);
    }
    if vocab > 0 && vocab < 1 << 16 {
        let _ = GrammarVocab::new(tok.inner(), &[0]);
    }
});
