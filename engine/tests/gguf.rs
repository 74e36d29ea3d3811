//! GGUF reading and writing: a round trip of every metadata value type and several tensor
//! types, and an error (never a panic) for every kind of corrupt file.

use std::path::{Path, PathBuf};

use colibri::format::gguf::{
    GgmlType, GgufArray, GgufFile, GgufTensorSpec, GgufValue, GgufWriter, GGUF_DEFAULT_ALIGNMENT,
};
use colibri::Error;

// ----- helpers -------------------------------------------------------------------------------

fn all_value_metadata() -> Vec<(String, GgufValue)> {
    let nested = GgufArray::Array(vec![
        GgufArray::U32(vec![1, 2, 3]),
        GgufArray::String(vec!["x".into(), "".into()]),
        GgufArray::Array(vec![GgufArray::F64(vec![0.5]), GgufArray::Bool(vec![])]),
        GgufArray::I8(vec![]),
    ]);
    vec![
        (
            "general.architecture".into(),
            GgufValue::String("llama".into()),
        ),
        ("t.u8".into(), GgufValue::U8(200)),
        ("t.i8".into(), GgufValue::I8(-100)),
        ("t.u16".into(), GgufValue::U16(60000)),
        ("t.i16".into(), GgufValue::I16(-30000)),
        ("t.u32".into(), GgufValue::U32(4_000_000_000)),
        ("t.i32".into(), GgufValue::I32(-2_000_000_000)),
        ("t.f32".into(), GgufValue::F32(1.5e-3)),
        ("t.bool".into(), GgufValue::Bool(true)),
        ("t.false".into(), GgufValue::Bool(false)),
        ("t.str".into(), GgufValue::String("héllo, 世界 🦜".into())),
        ("t.empty_str".into(), GgufValue::String(String::new())),
        ("t.u64".into(), GgufValue::U64(u64::MAX)),
        ("t.i64".into(), GgufValue::I64(i64::MIN)),
        ("t.f64".into(), GgufValue::F64(-2.25e100)),
        (
            "t.a.u8".into(),
            GgufValue::Array(GgufArray::U8(vec![0, 1, 255])),
        ),
        (
            "t.a.i8".into(),
            GgufValue::Array(GgufArray::I8(vec![-1, 127])),
        ),
        ("t.a.u16".into(), GgufValue::Array(GgufArray::U16(vec![7]))),
        (
            "t.a.i16".into(),
            GgufValue::Array(GgufArray::I16(vec![-7, 9])),
        ),
        (
            "t.a.u32".into(),
            GgufValue::Array(GgufArray::U32(vec![1, 2])),
        ),
        (
            "t.a.i32".into(),
            GgufValue::Array(GgufArray::I32(vec![-1, 40, -3])),
        ),
        (
            "t.a.f32".into(),
            GgufValue::Array(GgufArray::F32(vec![0.25, -1e9])),
        ),
        (
            "t.a.bool".into(),
            GgufValue::Array(GgufArray::Bool(vec![true, false, true])),
        ),
        (
            "t.a.str".into(),
            GgufValue::Array(GgufArray::String(vec![
                "<s>".into(),
                "Ġthe".into(),
                "ñ€".into(),
                String::new(),
            ])),
        ),
        (
            "t.a.u64".into(),
            GgufValue::Array(GgufArray::U64(vec![u64::MAX, 0])),
        ),
        (
            "t.a.i64".into(),
            GgufValue::Array(GgufArray::I64(vec![i64::MIN, 5])),
        ),
        (
            "t.a.f64".into(),
            GgufValue::Array(GgufArray::F64(vec![1.0 / 3.0])),
        ),
        ("t.a.empty".into(), GgufValue::Array(GgufArray::F32(vec![]))),
        ("t.a.nested".into(), GgufValue::Array(nested)),
    ]
}

fn specs() -> Vec<GgufTensorSpec> {
    vec![
        GgufTensorSpec::from_shape("token_embd.weight", &[3, 5], GgmlType::F32),
        GgufTensorSpec::from_shape("blk.0.attn_q.weight", &[2, 64], GgmlType::Q4_0),
        GgufTensorSpec::from_shape("blk.0.ffn_up.weight", &[2, 256], GgmlType::Q4_K),
        GgufTensorSpec::from_shape("blk.0.ffn_down.weight", &[1, 2, 512], GgmlType::Q6_K),
        GgufTensorSpec::from_shape("blk.0.exp", &[2, 3, 4, 32], GgmlType::MXFP4),
        GgufTensorSpec::from_shape("norm", &[7], GgmlType::BF16),
        GgufTensorSpec::from_shape("empty", &[0, 32], GgmlType::Q8_0),
        GgufTensorSpec::from_shape("scalar", &[], GgmlType::I32),
        GgufTensorSpec::from_shape("half", &[3], GgmlType::F16),
    ]
}

/// Deterministic bytes for tensor `i`.
fn data(i: usize, n: usize) -> Vec<u8> {
    (0..n).map(|j| (j * 31 + i * 7 + 1) as u8).collect()
}

/// Write a file, each tensor in up to three pieces.
fn write_file(path: &Path, meta: &[(String, GgufValue)], specs: &[GgufTensorSpec]) {
    let mut w = GgufWriter::create(path, meta, specs.to_vec()).unwrap();
    for (i, s) in specs.iter().enumerate() {
        let bytes = data(i, s.nbytes().unwrap());
        let third = bytes.len() / 3;
        w.write(&bytes[..third]).unwrap();
        w.write(&bytes[third..2 * third]).unwrap();
        w.write(&bytes[2 * third..]).unwrap();
    }
    w.finish().unwrap();
}

fn small_file(dir: &Path) -> PathBuf {
    let path = dir.join("small.gguf");
    let meta = vec![
        (
            "general.architecture".to_string(),
            GgufValue::String("qwen3moe".into()),
        ),
        (
            "a".to_string(),
            GgufValue::Array(GgufArray::String(vec!["ab".into(), "c".into()])),
        ),
        ("n".to_string(), GgufValue::U32(3)),
    ];
    let specs = vec![
        GgufTensorSpec::from_shape("w", &[2, 32], GgmlType::Q8_0),
        GgufTensorSpec::from_shape("v", &[4], GgmlType::F32),
    ];
    write_file(&path, &meta, &specs);
    path
}

fn message(e: Error) -> String {
    e.to_string()
}

fn open_err(path: &Path) -> String {
    match GgufFile::open(path) {
        Ok(_) => panic!("{} opened, expected an error", path.display()),
        Err(e) => message(e),
    }
}

/// A raw GGUF builder for files the writer refuses to make.
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, tensors: u64, kvs: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(tensors).u64(kvs);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad(&mut self, to: usize) -> &mut Self {
        while !self.0.len().is_multiple_of(to) {
            self.0.push(0);
        }
        self
    }
    fn save(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, &self.0).unwrap();
        p
    }
}

// ----- round trip ----------------------------------------------------------------------------

#[test]
fn round_trip_every_value_type_and_several_tensor_types() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let meta = all_value_metadata();
    let specs = specs();
    write_file(&path, &meta, &specs);
    assert!(!colibri::format::write::tmp_path(&path).exists());

    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), GGUF_DEFAULT_ALIGNMENT);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.metadata().len(), meta.len());
    for (k, v) in &meta {
        assert_eq!(f.metadata().get(k), Some(v), "{k}");
    }
    let order: Vec<&str> = meta.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(f.metadata_keys(), order.as_slice());
    assert!(f.data_offset().is_multiple_of(f.alignment()));

    assert_eq!(f.tensors().len(), specs.len());
    for (i, (t, s)) in f.tensors().iter().zip(&specs).enumerate() {
        assert_eq!(t.name, s.name);
        assert_eq!(t.dims_ggml, s.dims_ggml);
        let rev: Vec<usize> = s.dims_ggml.iter().rev().map(|&d| d as usize).collect();
        assert_eq!(t.shape, rev);
        assert_eq!(t.ggml_type, s.ggml_type);
        assert_eq!(t.len, s.nbytes().unwrap());
        assert_eq!(t.offset as u64 % f.alignment(), 0, "{}", t.name);
        assert_eq!(f.read_tensor(t).unwrap(), data(i, t.len), "{}", t.name);
        assert_eq!(f.tensor(&t.name).unwrap(), t);
    }
    // The data is where the reader says, checked against the raw file too.
    let raw = std::fs::read(&path).unwrap();
    for (i, t) in f.tensors().iter().enumerate() {
        assert_eq!(&raw[t.offset..t.offset + t.len], data(i, t.len).as_slice());
    }
    // Sizes: rows × blocks per row × block bytes.
    let q4k = f.tensor("blk.0.ffn_up.weight").unwrap();
    assert_eq!(q4k.shape, vec![2, 256]);
    assert_eq!(q4k.dims_ggml, vec![256, 2]);
    assert_eq!(q4k.len, 2 * 144);
    assert_eq!(f.tensor("blk.0.exp").unwrap().len, 2 * 3 * 4 * 17);
    assert_eq!(f.tensor("blk.0.ffn_down.weight").unwrap().len, 2 * 2 * 210);
    assert_eq!(f.tensor("scalar").unwrap().len, 4);
    assert_eq!(f.tensor("empty").unwrap().len, 0);
    assert!(f.get_tensor("nope").is_none());
    assert!(message(f.tensor("nope").unwrap_err()).contains("`nope`"));
}

#[test]
fn custom_alignment_and_version_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.gguf");
    let meta = vec![
        ("general.alignment".to_string(), GgufValue::U32(256)),
        (
            "general.architecture".to_string(),
            GgufValue::String("x".into()),
        ),
    ];
    let specs = vec![
        GgufTensorSpec::from_shape("a", &[3], GgmlType::F32),
        GgufTensorSpec::from_shape("b", &[5], GgmlType::I8),
    ];
    write_file(&path, &meta, &specs);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.alignment(), 256);
    assert_eq!(f.data_offset() % 256, 0);
    assert_eq!(f.tensors()[1].offset - f.tensors()[0].offset, 256);

    // The same bytes labelled version 2 read the same (v2 and v3 differ only in endianness
    // support).
    let mut raw = std::fs::read(&path).unwrap();
    raw[4] = 2;
    let v2 = dir.path().join("v2.gguf");
    std::fs::write(&v2, &raw).unwrap();
    let g = GgufFile::open(&v2).unwrap();
    assert_eq!(g.version(), 2);
    assert_eq!(g.tensors(), f.tensors());
    assert_eq!(g.metadata(), f.metadata());
}

#[test]
fn typed_getters() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_file(&path, &all_value_metadata(), &[]);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_u64("t.u8").unwrap(), Some(200));
    assert_eq!(f.get_u64("t.u16").unwrap(), Some(60000));
    assert_eq!(f.get_u64("t.u32").unwrap(), Some(4_000_000_000));
    assert_eq!(f.get_u64("t.u64").unwrap(), Some(u64::MAX));
    assert_eq!(f.get_u64("absent").unwrap(), None);
    let e = message(f.get_u64("t.i8").unwrap_err());
    assert!(e.contains("t.i8") && e.contains("m.gguf"), "{e}");
    assert!(f.get_u64("t.str").is_err());
    assert_eq!(f.get_f64("t.f64").unwrap(), Some(-2.25e100));
    assert_eq!(f.get_f64("t.f32").unwrap(), Some(1.5e-3f32 as f64));
    assert_eq!(f.get_f64("t.i32").unwrap(), Some(-2e9));
    assert!(f.get_f64("t.bool").is_err());
    assert_eq!(f.get_str("t.str").unwrap(), Some("héllo, 世界 🦜"));
    assert!(f.get_str("t.u8").is_err());
    assert_eq!(f.get_bool("t.bool").unwrap(), Some(true));
    let a = f.get_array("t.a.str").unwrap().unwrap();
    assert_eq!(a.len(), 4);
    assert_eq!(a.as_strings().unwrap()[1], "Ġthe");
    assert_eq!(
        f.get_array("t.a.i32").unwrap().unwrap().to_f64s(),
        Some(vec![-1.0, 40.0, -3.0])
    );
    assert_eq!(f.get_array("t.a.i32").unwrap().unwrap().to_u64s(), None);
    assert_eq!(
        f.get_array("t.a.u16").unwrap().unwrap().to_u64s(),
        Some(vec![7])
    );
    assert!(f.get_array("t.u8").is_err());
    assert!(f.require("absent").is_err());
}

#[test]
fn missing_architecture_is_an_error_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_file(&path, &[], &[]);
    let f = GgufFile::open(&path).unwrap();
    assert!(f.tensors().is_empty() && f.metadata().is_empty());
    let e = message(f.architecture().unwrap_err());
    assert!(e.contains("general.architecture"), "{e}");
}

// ----- ggml types ----------------------------------------------------------------------------

#[test]
fn ggml_type_table() {
    for t in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(t.id()), Some(t));
        assert_eq!(t.to_string(), t.name());
    }
    for id in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000] {
        assert_eq!(GgmlType::from_id(id), None, "{id}");
    }
    // Against gguf-py 0.19.0's GGML_QUANT_SIZES.
    let expect = [
        (GgmlType::F32, 1, 4),
        (GgmlType::F16, 1, 2),
        (GgmlType::Q4_0, 32, 18),
        (GgmlType::Q4_1, 32, 20),
        (GgmlType::Q5_0, 32, 22),
        (GgmlType::Q5_1, 32, 24),
        (GgmlType::Q8_0, 32, 34),
        (GgmlType::Q8_1, 32, 40),
        (GgmlType::Q2_K, 256, 84),
        (GgmlType::Q3_K, 256, 110),
        (GgmlType::Q4_K, 256, 144),
        (GgmlType::Q5_K, 256, 176),
        (GgmlType::Q6_K, 256, 210),
        (GgmlType::Q8_K, 256, 292),
        (GgmlType::IQ2_XXS, 256, 66),
        (GgmlType::IQ2_XS, 256, 74),
        (GgmlType::IQ3_XXS, 256, 98),
        (GgmlType::IQ1_S, 256, 50),
        (GgmlType::IQ4_NL, 32, 18),
        (GgmlType::IQ3_S, 256, 110),
        (GgmlType::IQ2_S, 256, 82),
        (GgmlType::IQ4_XS, 256, 136),
        (GgmlType::I8, 1, 1),
        (GgmlType::I16, 1, 2),
        (GgmlType::I32, 1, 4),
        (GgmlType::I64, 1, 8),
        (GgmlType::F64, 1, 8),
        (GgmlType::IQ1_M, 256, 56),
        (GgmlType::BF16, 1, 2),
        (GgmlType::TQ1_0, 256, 54),
        (GgmlType::TQ2_0, 256, 66),
        (GgmlType::MXFP4, 32, 17),
    ];
    assert_eq!(expect.len(), GgmlType::ALL.len());
    for (t, bs, bb) in expect {
        assert_eq!(t.block_geometry(), (bs, bb), "{t}");
    }
    assert!(GgmlType::Q4_K.is_computable() && GgmlType::MXFP4.is_computable());
    assert!(!GgmlType::IQ2_XXS.is_computable() && !GgmlType::Q8_K.is_computable());
    assert_eq!(GgmlType::Q4_K.nbytes(&[512, 3]), Ok(3 * 2 * 144));
    assert!(GgmlType::Q4_K.nbytes(&[100, 3]).is_err());
    assert!(GgmlType::F32.nbytes(&[u64::MAX, u64::MAX]).is_err());
}

// ----- errors --------------------------------------------------------------------------------

#[test]
fn every_truncation_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = small_file(dir.path());
    let full = std::fs::read(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let end_of_data = f.tensors().iter().map(|t| t.offset + t.len).max().unwrap();
    let cut_path = dir.path().join("cut.gguf");
    for cut in 0..end_of_data {
        std::fs::write(&cut_path, &full[..cut]).unwrap();
        let e = open_err(&cut_path);
        assert!(e.contains("cut.gguf"), "cut at {cut}: {e}");
        assert!(
            e.contains("truncated") || e.contains("beyond the end of the file"),
            "cut at {cut}: {e}"
        );
    }
    // A cut in the header says what and where.
    std::fs::write(&cut_path, &full[..10]).unwrap();
    let e = open_err(&cut_path);
    assert!(
        e.contains("the version") || e.contains("tensor count"),
        "{e}"
    );
    assert!(e.contains("at byte 8"), "{e}");
    std::fs::write(&cut_path, &full[..30]).unwrap();
    let e = open_err(&cut_path);
    assert!(e.contains("metadata pair #0"), "{e}");
}

#[test]
fn bad_magic_and_versions() {
    let dir = tempfile::tempdir().unwrap();
    let path = small_file(dir.path());
    let full = std::fs::read(&path).unwrap();

    let mut bad = full.clone();
    bad[..4].copy_from_slice(b"GGML");
    let p = dir.path().join("magic.gguf");
    std::fs::write(&p, &bad).unwrap();
    assert!(open_err(&p).contains("not a GGUF file"));

    let p = dir.path().join("safetensors.gguf");
    std::fs::write(&p, b"{}").unwrap();
    assert!(open_err(&p).contains("truncated"));

    for (v, want) in [(1u32, "version 1"), (4, "version 4"), (0, "version 0")] {
        let mut bad = full.clone();
        bad[4..8].copy_from_slice(&v.to_le_bytes());
        let p = dir.path().join(format!("v{v}.gguf"));
        std::fs::write(&p, &bad).unwrap();
        let e = open_err(&p);
        assert!(e.contains(want) && e.contains("not supported"), "{e}");
    }
    let mut bad = full.clone();
    bad[4..8].copy_from_slice(&3u32.to_be_bytes());
    let p = dir.path().join("be.gguf");
    std::fs::write(&p, &bad).unwrap();
    assert!(open_err(&p).contains("big-endian"));
}

#[test]
fn unknown_type_id_names_tensor_and_id() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Raw::header(3, 1, 0);
    r.tensor("blk.3.weird", &[32], 33, 0)
        .pad(32)
        .bytes(&[0; 64]);
    let e = open_err(&r.save(dir.path(), "t.gguf"));
    assert!(e.contains("blk.3.weird") && e.contains("33"), "{e}");
}

#[test]
fn tensor_beyond_eof() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[8], 0, 0)
        .tensor("b", &[8], 0, 32)
        .pad(32)
        .bytes(&[0; 32 + 31]);
    let e = open_err(&r.save(dir.path(), "t.gguf"));
    assert!(e.contains("`b`") && e.contains("beyond the end"), "{e}");
    // An offset near u64::MAX overflows instead of wrapping.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("c", &[8], 0, u64::MAX - 31)
        .pad(32)
        .bytes(&[0; 32]);
    let e = open_err(&r.save(dir.path(), "o.gguf"));
    assert!(e.contains("`c`") && e.contains("beyond the end"), "{e}");
}

#[test]
fn misaligned_and_overlapping_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Raw::header(3, 1, 0);
    r.tensor("a", &[8], 0, 4).pad(32).bytes(&[0; 64]);
    let e = open_err(&r.save(dir.path(), "m.gguf"));
    assert!(e.contains("`a`") && e.contains("alignment 32"), "{e}");

    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[16], 0, 0)
        .tensor("b", &[8], 0, 32)
        .pad(32)
        .bytes(&[0; 128]);
    let e = open_err(&r.save(dir.path(), "o.gguf"));
    assert!(e.contains("overlaps"), "{e}");

    // An empty tensor (a zero dimension: no bytes) may sit anywhere, even inside another's
    // bytes; but one between two overlapping tensors does not hide their overlap (found by
    // the `gguf` fuzz target: the check compared only neighbours in offset order).
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[16], 0, 0)
        .tensor("empty", &[0, 4], 0, 32)
        .pad(32)
        .bytes(&[0; 64]);
    let g = GgufFile::open(&r.save(dir.path(), "e.gguf")).unwrap();
    assert_eq!(
        g.tensors().iter().map(|t| t.len).collect::<Vec<_>>(),
        [64, 0]
    );
    let mut r = Raw::header(3, 3, 0);
    r.tensor("a", &[16], 0, 0)
        .tensor("empty", &[0], 0, 32)
        .tensor("b", &[8], 0, 32)
        .pad(32)
        .bytes(&[0; 128]);
    let e = open_err(&r.save(dir.path(), "h.gguf"));
    assert!(
        e.contains("`b`") && e.contains("overlaps tensor `a`"),
        "{e}"
    );
}

#[test]
fn implausible_lengths_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    // A key claiming 2^40 bytes.
    let mut r = Raw::header(3, 0, 1);
    r.u64(1 << 40).bytes(b"general.name");
    let e = open_err(&r.save(dir.path(), "k.gguf"));
    assert!(
        e.contains("claims a length") && e.contains("metadata pair #0"),
        "{e}"
    );
    // A string value claiming u64::MAX bytes.
    let mut r = Raw::header(3, 0, 1);
    r.str("general.name").u32(8).u64(u64::MAX).bytes(b"abc");
    let e = open_err(&r.save(dir.path(), "s.gguf"));
    assert!(
        e.contains("general.name") && e.contains("claims a length"),
        "{e}"
    );
    // An array claiming more elements than the file holds.
    let mut r = Raw::header(3, 0, 1);
    r.str("tokens").u32(9).u32(8).u64(1 << 30).bytes(&[0; 64]);
    let e = open_err(&r.save(dir.path(), "a.gguf"));
    assert!(e.contains("tokens") && e.contains("elements"), "{e}");
    let mut r = Raw::header(3, 0, 1);
    r.str("u8s").u32(9).u32(0).u64(1000).bytes(&[0; 999]);
    let e = open_err(&r.save(dir.path(), "a2.gguf"));
    assert!(e.contains("u8s") && e.contains("elements"), "{e}");
    // Counts.
    let r = Raw::header(3, u64::MAX, 0);
    assert!(open_err(&r.save(dir.path(), "c.gguf")).contains("tensor count"));
    let r = Raw::header(3, 0, 1 << 50);
    assert!(open_err(&r.save(dir.path(), "d.gguf")).contains("metadata count"));
    // Arrays nested absurdly deep.
    let mut r = Raw::header(3, 0, 1);
    r.str("deep").u32(9);
    for _ in 0..100 {
        r.u32(9).u64(1);
    }
    r.u32(0).u64(0);
    assert!(open_err(&r.save(dir.path(), "deep.gguf")).contains("deep"));
}

#[test]
fn malformed_metadata_and_tensor_infos() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Raw, &str)> = vec![
        (
            "vtype",
            {
                let mut r = Raw::header(3, 0, 1);
                r.str("k").u32(13).u32(0);
                r
            },
            "value type",
        ),
        (
            "bool",
            {
                let mut r = Raw::header(3, 0, 1);
                r.str("k").u32(7).bytes(&[2]);
                r
            },
            "bool",
        ),
        (
            "utf8",
            {
                let mut r = Raw::header(3, 0, 1);
                r.str("k").u32(8).u64(2).bytes(&[0xff, 0xfe]);
                r
            },
            "UTF-8",
        ),
        (
            "dup",
            {
                let mut r = Raw::header(3, 0, 2);
                r.str("k").u32(0).bytes(&[1]).str("k").u32(0).bytes(&[2]);
                r
            },
            "twice",
        ),
        (
            "align_type",
            {
                let mut r = Raw::header(3, 0, 1);
                r.str("general.alignment").u32(10).u64(32);
                r
            },
            "general.alignment",
        ),
        (
            "align_pow2",
            {
                let mut r = Raw::header(3, 0, 1);
                r.str("general.alignment").u32(4).u32(48);
                r
            },
            "general.alignment",
        ),
        (
            "ndims",
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t5", &[1, 1, 1, 1, 1], 0, 0)
                    .pad(32)
                    .bytes(&[0; 32]);
                r
            },
            "dimensions",
        ),
        (
            "block",
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("q", &[48, 2], 8, 0).pad(32).bytes(&[0; 256]);
                r
            },
            "block size",
        ),
        (
            "dupname",
            {
                let mut r = Raw::header(3, 2, 0);
                r.tensor("x", &[8], 0, 0)
                    .tensor("x", &[8], 0, 32)
                    .pad(32)
                    .bytes(&[0; 64]);
                r
            },
            "twice",
        ),
        (
            "huge",
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("h", &[1 << 40, 1 << 40, 1 << 40], 0, 0)
                    .pad(32)
                    .bytes(&[0; 32]);
                r
            },
            "overflows",
        ),
    ];
    for (name, raw, want) in cases {
        let e = open_err(&raw.save(dir.path(), &format!("{name}.gguf")));
        assert!(e.contains(want), "{name}: {e}");
        assert!(e.contains(&format!("{name}.gguf")), "{name}: {e}");
    }
}

#[test]
fn writer_misuse_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.gguf");
    let specs = vec![GgufTensorSpec::from_shape("a", &[4], GgmlType::F32)];
    let mut w = GgufWriter::create(&path, &[], specs.clone()).unwrap();
    assert!(w.write(&[0; 17]).is_err());
    w.write(&[0; 8]).unwrap();
    assert!(w.finish().is_err());
    assert!(!path.exists());
    assert!(!colibri::format::write::tmp_path(&path).exists());

    let mut w = GgufWriter::create(&path, &[], specs.clone()).unwrap();
    w.write(&[0; 16]).unwrap();
    assert!(w.write(&[0]).is_err());
    w.finish().unwrap();
    assert!(path.exists());

    let bad = |meta: Vec<(String, GgufValue)>, specs: Vec<GgufTensorSpec>| {
        GgufWriter::create(&dir.path().join("x.gguf"), &meta, specs).is_err()
    };
    assert!(bad(
        vec![],
        vec![GgufTensorSpec::from_shape("q", &[40], GgmlType::Q4_0)]
    ));
    assert!(bad(
        vec![],
        vec![GgufTensorSpec::from_shape(
            "n".repeat(64),
            &[1],
            GgmlType::F32
        )]
    ));
    assert!(bad(
        vec![],
        vec![GgufTensorSpec::from_shape("d", &[1; 5], GgmlType::F32)]
    ));
    assert!(bad(vec![], vec![specs[0].clone(), specs[0].clone()]));
    assert!(bad(
        vec![("general.alignment".into(), GgufValue::U64(32))],
        vec![]
    ));
    assert!(bad(
        vec![("general.alignment".into(), GgufValue::U32(24))],
        vec![]
    ));
    assert!(bad(
        vec![
            ("k".into(), GgufValue::U8(1)),
            ("k".into(), GgufValue::U8(2))
        ],
        vec![]
    ));
}
