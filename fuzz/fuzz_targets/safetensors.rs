//! Safetensors headers and `model.safetensors.index.json`: an input that starts with `{` is an
//! index (up to the first NUL byte) whose shards all hold the rest of the input; anything else
//! is a single `model.safetensors`. Opening must give an error or a checkpoint whose every
//! tensor lies inside its file, apart from the others, with as many bytes as its shape and
//! dtype need — and reading each tensor must give exactly those bytes.
#![no_main]

use colibri::format::safetensors::{Access, Checkpoint};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = colibri_fuzz::scratch("safetensors");
    let (index, shard) = match data.iter().position(|&b| b == 0) {
        Some(nul) if data.first() == Some(&b'{') => (Some(&data[..nul]), &data[nul + 1..]),
        _ => (None, data),
    };
    match index {
        None => std::fs::write(dir.join("model.safetensors"), shard).unwrap(),
        Some(index) => {
            std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
            // Every plain file name the index maps to (a few) holds the shard.
            let names: Vec<String> = serde_json::from_slice::<serde_json::Value>(index)
                .ok()
                .and_then(|v| v.get("weight_map")?.as_object().cloned())
                .map(|m| {
                    m.values()
                        .filter_map(|f| f.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            for name in names.iter().take(4) {
                if !name.is_empty() && !name.contains(['/', '\0']) && !name.starts_with('.') {
                    let _ = std::fs::write(dir.join(name), shard);
                }
            }
        }
    }
    for access in [Access::Read, Access::Mapped] {
        let Ok(ckpt) = Checkpoint::open_with(&dir, access) else {
            continue;
        };
        let mut spans: Vec<(usize, usize, usize)> = Vec::new();
        for (name, d) in ckpt.tensors() {
            assert_eq!(&d.name, name);
            let file_len = std::fs::metadata(ckpt.file_path(d.file)).unwrap().len() as usize;
            let end = d.offset.checked_add(d.len).expect("offset + len overflows");
            assert!(
                end <= file_len,
                "{name}: [{}, {end}) past {file_len}",
                d.offset
            );
            let elements: usize = d.shape.iter().product();
            assert_eq!(elements * d.dtype.size(), d.len, "{name}: length vs shape");
            spans.push((d.file, d.offset, end));
            let t = ckpt
                .tensor_any_shape(name)
                .expect("a described tensor reads");
            assert_eq!(t.storage.bytes().len(), d.len, "{name}: bytes read");
        }
        spans.sort();
        for w in spans.windows(2) {
            assert!(
                w[0].0 != w[1].0 || w[0].2 <= w[1].1,
                "overlapping tensors {w:?}"
            );
        }
    }
});
