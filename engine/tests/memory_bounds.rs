//! Memory bounds: a hostile file can never make a loader allocate more than the file's own size
//! plus a small fixed headroom.
//!
//! Each case writes an absurd file (a GGUF header announcing 2^50 tensors, a safetensors header
//! length of 2^45 bytes, a KV file whose cache claims 2^50 tokens, a `config.json` whose every
//! size is the largest one accepted, ...) and re-runs this test binary as a child that lowers
//! its own address-space limit (`RLIMIT_AS`, what `ulimit -v` sets) to what it has mapped now
//! plus the file's size plus [`HEADROOM`], and then calls the real loader. A loader that trusts
//! a size from the file dies there (Rust aborts on a failed allocation); one that checks it
//! returns an error, which must name the file. A control case allocates past the limit on
//! purpose and must die, so the harness can fail.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use colibri::format::gguf::GgufFile;
use colibri::format::safetensors::{Access, Checkpoint};
use colibri::runtime::kv_file::{self, xxh64, FORMAT_VERSION, MAGIC};

/// Environment variables that turn the test binary into a loader child.
const CHILD_CASE: &str = "COLI_MEMBOUND_CASE";
const CHILD_PATH: &str = "COLI_MEMBOUND_PATH";
/// Address space the child may map beyond what it holds before the load and the file itself:
/// room for the loader's own bookkeeping, never for a size a file claims.
const HEADROOM: u64 = 256 << 20;
const FINGERPRINT: &str = "membound";

// ---------------------------------------------------------------------------------------------
// Absurd files.

/// GGUF bytes: the header with these counts, then `rest` as written.
fn gguf(tensors: u64, kvs: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&tensors.to_le_bytes());
    b.extend_from_slice(&kvs.to_le_bytes());
    b.extend_from_slice(rest);
    b.resize(b.len() + 4096, 0); // some bytes to read, far fewer than claimed
    b
}

fn gguf_str(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

/// A GGUF key/value pair: key, type, value bytes.
fn gguf_kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let mut b = gguf_str(key);
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(value);
    b
}

fn u64s(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A safetensors file: the 8-byte header length, the header, the data.
fn safetensors(header_len: u64, header: &str, data: usize) -> Vec<u8> {
    let mut b = header_len.to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.resize(b.len() + data, 0);
    b
}

/// A KV file framed as `kv_file::save` frames one (magic, version, reserved, body length,
/// body, checksum), with `body_len` as claimed.
fn kv(body: &[u8], body_len: u64) -> Vec<u8> {
    let mut f = MAGIC.to_vec();
    f.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&body_len.to_le_bytes());
    f.extend_from_slice(body);
    let sum = xxh64(&f);
    f.extend_from_slice(&sum.to_le_bytes());
    f
}

/// A KV body: fingerprint, layers, tokens, cached tokens, capacity, then `rest`.
fn kv_body(layers: u32, n_tokens: u64, cache_len: u64, max_len: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = (FINGERPRINT.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(FINGERPRINT.as_bytes());
    b.extend_from_slice(&layers.to_le_bytes());
    b.extend_from_slice(&u64s(&[n_tokens, cache_len, max_len]));
    b.extend_from_slice(rest);
    b
}

/// A copy of the llama fixture whose `config.json` is edited by `f`.
fn fixture_with_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    for entry in std::fs::read_dir(common::fixture("llama")).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
        }
    }
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
    dir.to_path_buf()
}

/// What a case loads: the GGUF container, the GGUF → model mapping, a safetensors checkpoint,
/// a whole model directory, a KV file.
#[derive(Clone, Copy, Debug)]
enum Loader {
    Gguf,
    GgufModel,
    Safetensors,
    Model,
    KvFile,
}

impl Loader {
    fn name(self) -> &'static str {
        match self {
            Loader::Gguf => "gguf",
            Loader::GgufModel => "gguf-model",
            Loader::Safetensors => "safetensors",
            Loader::Model => "model",
            Loader::KvFile => "kv",
        }
    }

    fn from_name(name: &str) -> Loader {
        [
            Loader::Gguf,
            Loader::GgufModel,
            Loader::Safetensors,
            Loader::Model,
            Loader::KvFile,
        ]
        .into_iter()
        .find(|l| l.name() == name)
        .expect("a loader name")
    }

    /// Runs the loader; the error text, or None when it loaded.
    fn run(self, path: &Path) -> Option<String> {
        let err = |e: colibri::Error| Some(e.to_string());
        match self {
            Loader::Gguf => GgufFile::open(path).err().map(|e| e.to_string()),
            Loader::GgufModel => colibri::model::gguf::open(path, Access::Read)
                .err()
                .map(|e| e.to_string()),
            Loader::Safetensors => Checkpoint::open(path).err().map(|e| e.to_string()),
            Loader::Model => match colibri::model::load(path) {
                Ok(m) => {
                    // Loaded: a cache can be made for it within the bound too.
                    drop(m.new_cache(4));
                    None
                }
                Err(e) => err(e),
            },
            Loader::KvFile => kv_file::load(path, FINGERPRINT)
                .err()
                .map(|e| e.to_string()),
        }
    }
}

/// One absurd input: its name, the loader, the path the loader opens (file or directory), the
/// name its error must mention, and whether it must be refused (some inputs are legal for one
/// loader, a GGUF container without tensors, and only the bound applies).
struct Case {
    name: &'static str,
    loader: Loader,
    path: PathBuf,
    names: &'static str,
    refuse: bool,
}

fn cases(dir: &Path) -> Vec<Case> {
    let mut out = Vec::new();
    let mut file = |name: &'static str, loader: Loader, file: &str, bytes: Vec<u8>| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(file), bytes).unwrap();
        let path = match loader {
            Loader::Safetensors | Loader::Model => d.clone(),
            _ => d.join(file),
        };
        out.push(Case {
            name,
            loader,
            path,
            names: if file == "model.safetensors" {
                "model.safetensors"
            } else if file.ends_with(".kv") {
                "slot.kv"
            } else {
                "model.gguf"
            },
            // A GGUF container without tensors is valid; a KV file's capacity is allocated
            // as the cache grows (the server refuses one longer than its context), so only
            // the bound applies to these two.
            refuse: !(name == "gguf-metadata-sizes" && matches!(loader, Loader::Gguf))
                && name != "kv-capacity",
        });
    };
    let huge = 1u64 << 50;
    for loader in [Loader::Gguf, Loader::GgufModel] {
        let tag = |s: &'static str| -> &'static str {
            if matches!(loader, Loader::Gguf) {
                s
            } else {
                Box::leak(format!("{s}-model").into_boxed_str())
            }
        };
        file(
            tag("gguf-tensor-count"),
            loader,
            "model.gguf",
            gguf(huge, 0, &[]),
        );
        file(
            tag("gguf-kv-count"),
            loader,
            "model.gguf",
            gguf(0, huge, &[]),
        );
        file(
            tag("gguf-key-length"),
            loader,
            "model.gguf",
            gguf(0, 1, &u64s(&[1 << 45])),
        );
        let long_string = [u64s(&[1 << 45]), vec![b'x'; 16]].concat();
        file(
            tag("gguf-string-value"),
            loader,
            "model.gguf",
            gguf(0, 1, &gguf_kv("general.name", 8, &long_string)),
        );
        let u32_array = [4u32.to_le_bytes().to_vec(), u64s(&[1 << 40])].concat();
        file(
            tag("gguf-u32-array"),
            loader,
            "model.gguf",
            gguf(0, 1, &gguf_kv("tokenizer.ggml.token_type", 9, &u32_array)),
        );
        let str_array = [8u32.to_le_bytes().to_vec(), u64s(&[1 << 40, 1 << 40])].concat();
        file(
            tag("gguf-string-array"),
            loader,
            "model.gguf",
            gguf(0, 1, &gguf_kv("tokenizer.ggml.tokens", 9, &str_array)),
        );
        let nested = [
            9u32.to_le_bytes().to_vec(),
            u64s(&[1 << 30]),
            9u32.to_le_bytes().to_vec(),
            u64s(&[1 << 30]),
        ]
        .concat();
        file(
            tag("gguf-nested-array"),
            loader,
            "model.gguf",
            gguf(0, 1, &gguf_kv("general.tags", 9, &nested)),
        );
        let mut tensor = gguf_str("blk.0.attn_q.weight");
        tensor.extend_from_slice(&4u32.to_le_bytes());
        tensor.extend_from_slice(&u64s(&[1 << 20, 1 << 20, 1 << 20, 1 << 20]));
        tensor.extend_from_slice(&0u32.to_le_bytes()); // F32
        tensor.extend_from_slice(&u64s(&[0]));
        file(
            tag("gguf-tensor-elements"),
            loader,
            "model.gguf",
            gguf(1, 0, &tensor),
        );
        let mut dims = gguf_str("blk.0.attn_q.weight");
        dims.extend_from_slice(&u32::MAX.to_le_bytes());
        file(
            tag("gguf-tensor-dims"),
            loader,
            "model.gguf",
            gguf(1, 0, &dims),
        );
        // Architecture metadata announcing absurd sizes, with no tensors to back them.
        let meta = [
            gguf_kv("general.architecture", 8, &gguf_str("llama")),
            gguf_kv("llama.block_count", 4, &u32::MAX.to_le_bytes()),
            gguf_kv("llama.embedding_length", 4, &u32::MAX.to_le_bytes()),
            gguf_kv("llama.feed_forward_length", 4, &u32::MAX.to_le_bytes()),
            gguf_kv("llama.attention.head_count", 4, &u32::MAX.to_le_bytes()),
            gguf_kv("llama.context_length", 4, &u32::MAX.to_le_bytes()),
        ]
        .concat();
        file(
            tag("gguf-metadata-sizes"),
            loader,
            "model.gguf",
            gguf(0, 6, &meta),
        );
    }
    file(
        "safetensors-header-length",
        Loader::Safetensors,
        "model.safetensors",
        safetensors(1 << 45, "{}", 4096),
    );
    let h =
        r#"{"w":{"dtype":"F32","shape":[2147483648,2147483648,2147483648],"data_offsets":[0,8]}}"#;
    file(
        "safetensors-shape",
        Loader::Safetensors,
        "model.safetensors",
        safetensors(h.len() as u64, h, 8),
    );
    let h = r#"{"w":{"dtype":"F32","shape":[262144,262144],"data_offsets":[0,274877906944]}}"#;
    file(
        "safetensors-offsets",
        Loader::Safetensors,
        "model.safetensors",
        safetensors(h.len() as u64, h, 4096),
    );
    let many: String = (0..20_000)
        .map(|i| {
            format!(
                r#""t{i}":{{"dtype":"F32","shape":[1073741824],"data_offsets":[0,4294967296]}}"#
            )
        })
        .collect::<Vec<_>>()
        .join(",");
    let h = format!("{{{many}}}");
    file(
        "safetensors-many-huge-tensors",
        Loader::Safetensors,
        "model.safetensors",
        safetensors(h.len() as u64, &h, 16),
    );
    file(
        "kv-body-length",
        Loader::KvFile,
        "slot.kv",
        kv(&kv_body(0, 0, 0, 0, &[]), 1 << 45),
    );
    let body = kv_body(0, 0, 0, huge, &[]);
    file(
        "kv-capacity",
        Loader::KvFile,
        "slot.kv",
        kv(&body, body.len() as u64),
    );
    let body = kv_body(0, huge, 0, 16, &[0; 64]);
    file(
        "kv-token-count",
        Loader::KvFile,
        "slot.kv",
        kv(&body, body.len() as u64),
    );
    let body = kv_body(u32::MAX, 4, 4, 16, &[0; 64]);
    file(
        "kv-layer-count",
        Loader::KvFile,
        "slot.kv",
        kv(&body, body.len() as u64),
    );
    let body = kv_body(1, 4, 4, 16, &u64s(&[huge, huge, huge, huge]));
    file(
        "kv-buffer-sizes",
        Loader::KvFile,
        "slot.kv",
        kv(&body, body.len() as u64),
    );

    // config.json with every size at the largest value the reader accepts, over the llama
    // fixture's small weights; and the real config with only its context made absurd.
    use colibri::format::config::MAX_DIM;
    for (name, fields) in [
        (
            "config-every-size",
            &[
                "hidden_size",
                "intermediate_size",
                "vocab_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            ][..],
        ),
        ("config-context", &["max_position_embeddings"][..]),
    ] {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        fixture_with_config(&d, |v| {
            for f in fields {
                v[*f] = serde_json::json!(MAX_DIM);
            }
        });
        out.push(Case {
            name,
            loader: Loader::Model,
            path: d,
            names: "config.json",
            // A context of 2^24 positions is one the reader accepts.
            refuse: name != "config-context",
        });
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The child side.

/// The address space this process has mapped now (`VmSize`), in bytes.
fn mapped_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize in /proc/self/status");
    kb * 1024
}

/// Bytes under `path` (a file, or a directory's files).
fn size_of(path: &Path) -> u64 {
    if path.is_dir() {
        std::fs::read_dir(path)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    } else {
        std::fs::metadata(path).unwrap().len()
    }
}

fn limit_address_space(bytes: u64) {
    let lim = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: setrlimit reads the struct we pass; it changes only this (child) process.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) };
    assert_eq!(rc, 0, "setrlimit(RLIMIT_AS)");
}

/// The child: runs one case under the limit and prints its outcome. Without the environment
/// variables (an ordinary test run) it has nothing to do.
#[test]
fn memory_bound_child() {
    let (Ok(case), Ok(path)) = (std::env::var(CHILD_CASE), std::env::var(CHILD_PATH)) else {
        return;
    };
    let path = PathBuf::from(path);
    let limit = mapped_bytes() + size_of(&path) + HEADROOM;
    limit_address_space(limit);
    if case == "control" {
        // Twice the headroom in one allocation, touched so it is real: must not fit.
        let v = vec![1u8; 2 * HEADROOM as usize + size_of(&path) as usize];
        println!("RESULT ok control allocated {}", v.len());
        return;
    }
    match Loader::from_name(&case).run(&path) {
        Some(e) => println!("RESULT error {}", e.replace('\n', " ")),
        None => println!("RESULT ok"),
    }
}

// ---------------------------------------------------------------------------------------------
// The parent side.

/// Runs `loader` on `path` in a child under the limit: its exit status and printed outcome.
fn run_child(loader: &str, path: &Path) -> (std::process::ExitStatus, String, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "memory_bound_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_CASE, loader)
        .env(CHILD_PATH, path)
        // One malloc arena: each extra arena reserves 64 MiB of address space up front.
        .env("MALLOC_ARENA_MAX", "1")
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let result = stdout
        .lines()
        .find_map(|l| Some(&l[l.find("RESULT ")? + 7..]))
        .unwrap_or("")
        .to_string();
    (
        out.status,
        result,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_harness_kills_an_allocation_past_the_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("small");
    std::fs::write(&f, [0u8; 16]).unwrap();
    let (status, result, _) = run_child("control", &f);
    assert!(
        !status.success() && result.is_empty(),
        "an allocation of twice the headroom succeeded under the limit: {status} {result}"
    );
}

#[test]
fn absurd_files_are_refused_within_their_own_size() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let all = cases(tmp.path());
    for case in &all {
        let (status, result, stderr) = run_child(case.loader.name(), &case.path);
        let tail: String = stderr.lines().rev().take(4).collect::<Vec<_>>().join(" | ");
        if !status.success() {
            failures.push(format!(
                "{}: the loader died under the limit ({status}): {tail}",
                case.name
            ));
        } else if let Some(e) = result.strip_prefix("error ") {
            if !e.contains(case.names) {
                failures.push(format!(
                    "{}: the error does not name {}: {e}",
                    case.name, case.names
                ));
            }
        } else if case.refuse || result != "ok" {
            failures.push(format!(
                "{}: an absurd file was accepted ({result:?})",
                case.name
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
}
