//! KV files and the prefix cache's slot files (`runtime::kv_file`: `load`, then `check_model`
//! against the llama fixture, as `restore` does when the server reopens its prefix cache).
//! The input is a file's body: the target frames it with a valid header and checksum (the
//! first byte picks version 2 or 1; 0xFF takes the rest as the whole file, unframed), so the
//! fuzzer reaches the structure behind the checksum. Every problem must be an error naming
//! the file, never a panic or an allocation the file's size does not justify; a file that
//! loads, saved again, loads back to the same tokens and cache and saves to the same bytes.
#![no_main]

use std::sync::OnceLock;

use colibri::model::CausalLm;
use colibri::runtime::kv_file::{self, xxh64, FORMAT_VERSION, MAGIC};
use libfuzzer_sys::fuzz_target;

const FINGERPRINT: &str = "fuzz-model";

fn model() -> &'static dyn CausalLm {
    static MODEL: OnceLock<Box<dyn CausalLm>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            colibri::model::load(&colibri_fuzz::fixtures().join("llama")).expect("llama fixture")
        })
        .as_ref()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let file = if mode == 0xFF {
        body.to_vec()
    } else {
        let version = if mode & 1 == 1 { 1 } else { FORMAT_VERSION };
        let mut f = Vec::with_capacity(body.len() + 32);
        f.extend_from_slice(&MAGIC);
        f.extend_from_slice(&version.to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&(body.len() as u64).to_le_bytes());
        f.extend_from_slice(body);
        let sum = xxh64(&f);
        f.extend_from_slice(&sum.to_le_bytes());
        f
    };
    let dir = colibri_fuzz::scratch("kv_file");
    let path = dir.join("slot.kv");
    std::fs::write(&path, &file).unwrap();
    let conv = match kv_file::load(&path, FINGERPRINT) {
        Ok(conv) => conv,
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("slot.kv"), "the error names the file: {e}");
            return;
        }
    };
    assert!(conv.cache.len <= conv.tokens.len());
    assert!(conv.cache.len <= conv.cache.max_len);
    let _ = kv_file::check_model(&path, &conv, model());

    // Saved again, it loads back the same, and saves to the same bytes.
    let again = dir.join("again.kv");
    kv_file::save(&again, FINGERPRINT, &conv).expect("a loaded conversation saves");
    let first = std::fs::read(&again).unwrap();
    let back = kv_file::load(&again, FINGERPRINT).expect("a saved conversation loads");
    assert_eq!(back.tokens, conv.tokens);
    assert_eq!(back.cache.len, conv.cache.len);
    assert_eq!(back.cache.max_len, conv.cache.max_len);
    kv_file::save(&again, FINGERPRINT, &back).unwrap();
    assert_eq!(
        std::fs::read(&again).unwrap(),
        first,
        "save → load → save changed the bytes"
    );
});
