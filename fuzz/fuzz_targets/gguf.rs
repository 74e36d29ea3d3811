//! GGUF files: the container (`GgufFile::open`), the tokenizer from `tokenizer.ggml.*`
//! (`gguf_vocab`) and the mapping onto a `config.json` and Hugging Face tensor names
//! (`model::gguf`). Opening must give an error or a file whose every tensor lies aligned
//! inside the file, apart from the others; such a file written again by `GgufWriter` must
//! read back with the same metadata, tensors and bytes (parse → print → parse).
#![no_main]

use colibri::format::gguf::{GgufFile, GgufTensorSpec, GgufWriter};
use colibri::format::gguf_vocab;
use colibri::format::safetensors::Access;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Building a tokenizer goes through the tokenizers crate, whose panics the engine catches.
    colibri_fuzz::catching_panics();
    let dir = colibri_fuzz::scratch("gguf");
    let path = dir.join("model.gguf");
    std::fs::write(&path, data).unwrap();
    let Ok(g) = GgufFile::open(&path) else {
        return;
    };
    let file_len = data.len() as u64;
    assert_eq!(g.file_len(), file_len);
    let mut spans = Vec::new();
    for t in g.tensors() {
        let end = t.offset as u64 + t.len as u64;
        assert!(
            end <= file_len,
            "{}: ends at {end}, past {file_len}",
            t.name
        );
        assert_eq!(
            (t.offset as u64 - g.data_offset()) % g.alignment(),
            0,
            "{}",
            t.name
        );
        assert_eq!(
            t.ggml_type.nbytes(&t.dims_ggml).unwrap(),
            t.len,
            "{}",
            t.name
        );
        let dims: Vec<usize> = t.dims_ggml.iter().rev().map(|&d| d as usize).collect();
        assert_eq!(dims, t.shape, "{}", t.name);
        // An empty tensor (a zero dimension) holds no bytes: it may sit anywhere.
        if t.len > 0 {
            spans.push((t.offset, t.offset + t.len));
        }
    }
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "overlapping tensors {w:?}");
    }
    assert_eq!(g.metadata_keys().len(), g.metadata().len());

    // Written again, it reads back the same.
    let copy = dir.join("copy.gguf");
    let metadata: Vec<_> = g
        .metadata_keys()
        .iter()
        .map(|k| (k.clone(), g.metadata()[k].clone()))
        .collect();
    let specs = g
        .tensors()
        .iter()
        .map(|t| GgufTensorSpec {
            name: t.name.clone(),
            dims_ggml: t.dims_ggml.clone(),
            ggml_type: t.ggml_type,
        })
        .collect();
    let mut w = GgufWriter::create(&copy, &metadata, specs)
        .unwrap_or_else(|e| panic!("a file the reader accepts is refused by the writer: {e}"));
    for t in g.tensors() {
        w.write(&g.read_tensor(t).unwrap()).unwrap();
    }
    w.finish().unwrap();
    let again = GgufFile::open(&copy).expect("the rewritten file opens");
    assert_eq!(
        format!("{:?}", again.metadata()),
        format!("{:?}", g.metadata()),
        "metadata after a round trip"
    );
    assert_eq!(again.metadata_keys(), g.metadata_keys());
    assert_eq!(again.tensors().len(), g.tensors().len());
    for (a, b) in again.tensors().iter().zip(g.tensors()) {
        assert_eq!(
            (&a.name, &a.dims_ggml, a.ggml_type),
            (&b.name, &b.dims_ggml, b.ggml_type)
        );
        assert_eq!(again.read_tensor(a).unwrap(), g.read_tensor(b).unwrap());
    }

    // The tokenizer and the model mapping: errors, not panics.
    let _ = gguf_vocab::special_tokens(&g);
    if let Ok(tok) = gguf_vocab::tokenizer_from_gguf(&g) {
        if let Ok(ids) = tok.encode("Hello, world! 123 <s> ünï", false) {
            let _ = tok.decode(&ids, false);
        }
    }
    let _ = colibri::model::gguf::config_from_gguf(&g);
    let _ = colibri::model::gguf::open(&path, Access::Read);
});
