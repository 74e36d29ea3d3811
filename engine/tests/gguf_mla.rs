//! GGUF files of the DeepSeek-V3 family (`deepseek2`: MLA) and of GLM-4.5 (`glm4moe`), as
//! llama.cpp names and lays them out: the fixtures converted by `colibri::convert` (the code
//! behind `coli convert`) load through the GGUF path into the same families and give the
//! safetensors logits — bit for bit where the GGUF path computes the same way, and within the
//! oracle tolerance of transformers. Both MLA layouts (`attn_kv_b`, and the split
//! `attn_k_b` / `attn_v_b` of current converters, also built here independently) load to the
//! same model; MTP (`nextn`) blocks are skipped; unsupported or missing keys are named.

mod common;
use common::{argmax, bits, fixture, ids, max_abs_diff, mean_abs_diff, reference_json};

use std::path::Path;

use colibri::convert::{convert, convert_with, ConvertOptions, ConvertType};
use colibri::format::config::ModelConfig;
use colibri::format::gguf::{GgmlType, GgufFile, GgufTensorSpec, GgufValue, GgufWriter};
use colibri::format::safetensors::{Access, Checkpoint};
use colibri::format::write::{SafetensorsWriter, TensorSpec};
use colibri::model::{self, CausalLm, Logits};
use colibri::store::StoreOptions;
use colibri::tensor::DType;

/// GGUF metadata pairs, in file order.
type Metadata = Vec<(String, GgufValue)>;

/// The logits of every prompt position.
fn prompt_logits(m: &dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(prompt.len() + 16);
    m.forward(prompt, &mut cache, Logits::All).unwrap()
}

/// Greedy tokens after the prompt, through the cache.
fn greedy(m: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache(prompt.len() + n + 1);
    let l = m.forward(prompt, &mut cache, Logits::Last).unwrap();
    let mut next = argmax(&l);
    let mut out = vec![];
    for _ in 0..n {
        out.push(next);
        let l = m.forward(&[next], &mut cache, Logits::Last).unwrap();
        next = argmax(&l);
    }
    out
}

/// Copy the GGUF file `src` to `dst` with its metadata and tensors edited.
fn rewrite(
    src: &Path,
    dst: &Path,
    edit: impl FnOnce(&mut Vec<(String, GgufValue)>, &mut Vec<(GgufTensorSpec, Vec<u8>)>),
) {
    let g = GgufFile::open(src).unwrap();
    let mut md: Vec<(String, GgufValue)> = g
        .metadata_keys()
        .iter()
        .map(|k| (k.clone(), g.metadata()[k].clone()))
        .collect();
    let mut ts: Vec<(GgufTensorSpec, Vec<u8>)> = g
        .tensors()
        .iter()
        .map(|t| {
            (
                GgufTensorSpec {
                    name: t.name.clone(),
                    dims_ggml: t.dims_ggml.clone(),
                    ggml_type: t.ggml_type,
                },
                g.read_tensor(t).unwrap(),
            )
        })
        .collect();
    edit(&mut md, &mut ts);
    let specs = ts.iter().map(|(s, _)| s.clone()).collect();
    let mut w = GgufWriter::create(dst, &md, specs).unwrap();
    for (_, b) in &ts {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

fn set(md: &mut Vec<(String, GgufValue)>, key: &str, v: GgufValue) {
    match md.iter_mut().find(|(k, _)| k == key) {
        Some(kv) => kv.1 = v,
        None => md.push((key.to_string(), v)),
    }
}

fn get_u32(md: &[(String, GgufValue)], key: &str) -> usize {
    md.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.as_u64())
        .unwrap_or_else(|| panic!("{key}")) as usize
}

/// Split every `attn_kv_b` of an f32/f16 legacy-layout deepseek2 file the way llama.cpp's
/// current converter does (`k_b = kv_b.view(H, nope + v, r)[:, :nope].transpose(1, 2)`,
/// `v_b = [:, nope:]`), written independently of the library. `v_f32` stores `attn_v_b` as
/// f32 whatever the source type (a mixed-type file).
fn split_kv_b(src: &Path, dst: &Path, v_f32: bool) {
    rewrite(src, dst, |md, ts| {
        let a = "deepseek2";
        let heads = get_u32(md, &format!("{a}.attention.head_count"));
        let nope_rope = get_u32(md, &format!("{a}.attention.key_length"));
        let v = get_u32(md, &format!("{a}.attention.value_length"));
        let rope = get_u32(md, &format!("{a}.rope.dimension_count"));
        let r = get_u32(md, &format!("{a}.attention.kv_lora_rank"));
        let nope = nope_rope - rope;
        set(
            md,
            &format!("{a}.attention.head_count_kv"),
            GgufValue::U32(1),
        );
        set(
            md,
            &format!("{a}.attention.key_length"),
            GgufValue::U32((r + rope) as u32),
        );
        set(
            md,
            &format!("{a}.attention.value_length"),
            GgufValue::U32(r as u32),
        );
        set(
            md,
            &format!("{a}.attention.key_length_mla"),
            GgufValue::U32(nope_rope as u32),
        );
        set(
            md,
            &format!("{a}.attention.value_length_mla"),
            GgufValue::U32(v as u32),
        );
        let mut out = Vec::new();
        for (spec, bytes) in ts.drain(..) {
            let Some(layer) = spec.name.strip_suffix(".attn_kv_b.weight") else {
                out.push((spec, bytes));
                continue;
            };
            let ty = spec.ggml_type;
            let es = match ty {
                GgmlType::F32 => 4,
                GgmlType::F16 => 2,
                other => panic!("split_kv_b takes f32 or f16, not {other}"),
            };
            assert_eq!(spec.dims_ggml, vec![r as u64, (heads * (nope + v)) as u64]);
            let elem =
                |row: usize, col: usize| &bytes[(row * r + col) * es..(row * r + col + 1) * es];
            let mut k_b = Vec::new();
            for h in 0..heads {
                for c in 0..r {
                    for i in 0..nope {
                        k_b.extend_from_slice(elem(h * (nope + v) + i, c));
                    }
                }
            }
            let mut v_b = Vec::new();
            for h in 0..heads {
                for j in 0..v {
                    for c in 0..r {
                        let e = elem(h * (nope + v) + nope + j, c);
                        if v_f32 && es == 2 {
                            let x = half::f16::from_le_bytes([e[0], e[1]]).to_f32();
                            v_b.extend_from_slice(&x.to_le_bytes());
                        } else {
                            v_b.extend_from_slice(e);
                        }
                    }
                }
            }
            let v_ty = if v_f32 { GgmlType::F32 } else { ty };
            out.push((
                GgufTensorSpec::from_shape(
                    format!("{layer}.attn_k_b.weight"),
                    &[heads, r, nope],
                    ty,
                ),
                k_b,
            ));
            out.push((
                GgufTensorSpec::from_shape(
                    format!("{layer}.attn_v_b.weight"),
                    &[heads, v, r],
                    v_ty,
                ),
                v_b,
            ));
        }
        *ts = out;
    });
}

/// The Hugging Face logits of a fixture (safetensors path) and its reference.
fn safetensors_and_reference(arch: &str) -> (Vec<u32>, Vec<f32>, Vec<f32>, Vec<u32>) {
    let v = reference_json(arch);
    let prompt = ids(&v, "prompt_ids");
    let m = model::load(&fixture(arch)).unwrap();
    let st = prompt_logits(m.as_ref(), &prompt);
    (
        prompt,
        st,
        common::reference_logits(arch),
        ids(&v, "greedy_ids"),
    )
}

#[test]
fn mla_gguf_equals_safetensors_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in ["deepseek_v3", "kimi_k25"] {
        let (prompt, st, reference, want_greedy) = safetensors_and_reference(arch);
        let worst_st = max_abs_diff(&st, &reference);
        assert!(
            worst_st <= 1e-4,
            "{arch}: safetensors vs transformers {worst_st}"
        );
        for (name, legacy) in [("split", false), ("kv_b", true)] {
            let out = tmp.path().join(format!("{arch}-{name}.gguf"));
            let opts = ConvertOptions {
                legacy_kv_b: legacy,
            };
            convert_with(&fixture(arch), &out, ConvertType::F32, opts, |_, _| {}).unwrap();
            let m = model::load(&out).unwrap_or_else(|e| panic!("{arch} {name}: {e}"));
            assert_eq!(m.info().model_type, "deepseek_v3", "{arch}");
            assert_eq!(m.info().layers, 3, "{arch}");
            let got = prompt_logits(m.as_ref(), &prompt);
            // Same weights, same configuration values (the yarn multiplier survives the f32
            // round trip exactly, as in llama.cpp): the same bits.
            assert_eq!(bits(&got), bits(&st), "{arch} {name}: GGUF ≠ safetensors");
            assert!(max_abs_diff(&got, &reference) <= 1e-4, "{arch} {name}");
            assert_eq!(
                greedy(m.as_ref(), &prompt, want_greedy.len()),
                want_greedy,
                "{arch} {name}: greedy tokens"
            );
        }
    }
}

#[test]
fn glm4moe_gguf_matches_safetensors() {
    let arch = "glm4_moe";
    let tmp = tempfile::tempdir().unwrap();
    let (prompt, st, reference, want_greedy) = safetensors_and_reference(arch);
    assert!(max_abs_diff(&st, &reference) <= 1e-4);
    let out = tmp.path().join("glm.gguf");
    convert(&fixture(arch), &out, ConvertType::F32, |_, _| {}).unwrap();

    // As a GGUF file runs: llama.cpp's f16 K/V precision (kv_f16), like every other GGUF
    // family: within 5e-3 (the bound gguf_models uses), and the same greedy tokens.
    let m = model::load(&out).unwrap();
    assert_eq!(m.info().model_type, "glm4_moe");
    let got = prompt_logits(m.as_ref(), &prompt);
    let worst = max_abs_diff(&got, &reference);
    assert!(worst > 0.0 && worst <= 5e-3, "glm4moe with f16 KV: {worst}");
    assert_eq!(greedy(m.as_ref(), &prompt, want_greedy.len()), want_greedy);

    // The same file with f32 K/V: the safetensors bits, so the mapping itself is exact.
    let (_, cfg, ckpt) = model::gguf::open(&out, Access::Mapped).unwrap();
    let mut json = cfg.json().clone();
    assert_eq!(json["kv_f16"], serde_json::json!(true));
    assert_eq!(json["partial_rotary_factor"], serde_json::json!(0.5));
    json["kv_f16"] = serde_json::json!(false);
    let cfg = ModelConfig::from_value(out.clone(), json);
    let exact = model::glm4_moe::load(
        &ckpt,
        &cfg,
        &colibri::model::LoadOptions::from(StoreOptions::default()),
    )
    .unwrap();
    let got = prompt_logits(&exact, &prompt);
    assert_eq!(bits(&got), bits(&st), "glm4moe (f32 KV) GGUF ≠ safetensors");
}

#[test]
fn converted_files_use_llama_cpp_names_and_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds.gguf");
    convert(&fixture("deepseek_v3"), &out, ConvertType::F32, |_, _| {}).unwrap();
    let g = GgufFile::open(&out).unwrap();
    let u = |k: &str| g.get_u64(&format!("deepseek2.{k}")).unwrap().unwrap();
    let f = |k: &str| g.get_f64(&format!("deepseek2.{k}")).unwrap().unwrap();
    assert_eq!(g.architecture().unwrap(), "deepseek2");
    assert_eq!(u("block_count"), 3);
    assert_eq!(u("attention.head_count_kv"), 1);
    assert_eq!(u("attention.kv_lora_rank"), 16);
    assert_eq!(u("attention.q_lora_rank"), 32);
    assert_eq!(u("attention.key_length"), 16 + 8);
    assert_eq!(u("attention.value_length"), 16);
    assert_eq!(u("attention.key_length_mla"), 16 + 8);
    assert_eq!(u("attention.value_length_mla"), 16);
    assert_eq!(u("rope.dimension_count"), 8);
    assert_eq!(u("expert_count"), 8);
    assert_eq!(u("expert_used_count"), 2);
    assert_eq!(u("expert_shared_count"), 1);
    assert_eq!(u("expert_group_count"), 4);
    assert_eq!(u("expert_group_used_count"), 2);
    assert_eq!(u("expert_gating_func"), 2);
    assert_eq!(u("leading_dense_block_count"), 1);
    assert_eq!(u("expert_feed_forward_length"), 32);
    assert_eq!(u("feed_forward_length"), 96);
    assert_eq!(f("expert_weights_scale"), 2.5);
    assert_eq!(
        g.get_bool("deepseek2.expert_weights_norm").unwrap(),
        Some(true)
    );
    assert_eq!(
        g.get_str("deepseek2.rope.scaling.type").unwrap(),
        Some("yarn")
    );
    assert_eq!(f("rope.scaling.factor"), 40.0);
    assert_eq!(u("rope.scaling.original_context_length"), 64);
    assert_eq!(f("rope.scaling.yarn_log_multiplier"), 0.1f32 as f64);
    let shape = |n: &str| g.tensor(n).unwrap().shape.clone();
    assert_eq!(shape("blk.0.attn_k_b.weight"), [4, 16, 16]);
    assert_eq!(shape("blk.0.attn_v_b.weight"), [4, 16, 16]);
    assert_eq!(shape("blk.0.attn_q_a.weight"), [32, 64]);
    assert_eq!(shape("blk.0.attn_kv_a_mqa.weight"), [24, 64]);
    assert_eq!(shape("blk.1.ffn_gate_exps.weight"), [8, 32, 64]);
    assert_eq!(shape("blk.1.ffn_down_shexp.weight"), [64, 32]);
    assert_eq!(shape("blk.1.exp_probs_b.bias"), [8]);
    assert!(g.get_tensor("blk.0.attn_kv_b.weight").is_none());
    assert!(g.get_tensor("blk.0.ffn_gate_inp.weight").is_none()); // dense layer

    let out = tmp.path().join("glm.gguf");
    convert(&fixture("glm4_moe"), &out, ConvertType::F32, |_, _| {}).unwrap();
    let g = GgufFile::open(&out).unwrap();
    let u = |k: &str| g.get_u64(&format!("glm4moe.{k}")).unwrap().unwrap();
    assert_eq!(g.architecture().unwrap(), "glm4moe");
    assert_eq!(u("block_count"), 3);
    // The fixture's config asks for an MTP layer its weights do not hold.
    assert_eq!(u("nextn_predict_layers"), 0);
    assert_eq!(u("attention.head_count_kv"), 2);
    assert_eq!(u("attention.key_length"), 16);
    assert_eq!(u("rope.dimension_count"), 8);
    assert_eq!(u("expert_group_count"), 2);
    assert_eq!(u("expert_group_used_count"), 1);
    for name in [
        "blk.1.post_attention_norm.weight",
        "blk.1.attn_q.bias",
        "blk.1.attn_k_norm.weight",
        "blk.1.exp_probs_b.bias",
        "blk.1.ffn_up_shexp.weight",
    ] {
        assert!(g.get_tensor(name).is_some(), "{name}");
    }
    assert!(g.get_tensor("blk.1.ffn_norm.weight").is_none());
}

#[test]
fn split_and_unsplit_kv_b_load_to_the_same_model() {
    let tmp = tempfile::tempdir().unwrap();
    let (prompt, _, reference, _) = safetensors_and_reference("deepseek_v3");
    for (ty, name) in [(ConvertType::F32, "f32"), (ConvertType::F16, "f16")] {
        let legacy = tmp.path().join(format!("kv_b-{name}.gguf"));
        let opts = ConvertOptions { legacy_kv_b: true };
        convert_with(&fixture("deepseek_v3"), &legacy, ty, opts, |_, _| {}).unwrap();
        let base = prompt_logits(model::load(&legacy).unwrap().as_ref(), &prompt);
        if ty == ConvertType::F16 {
            // f16 weights (and f32 latents): close to transformers, not equal.
            let worst = max_abs_diff(&base, &reference);
            assert!(worst > 0.0 && worst <= 0.05, "f16: {worst}");
        }
        // Split here, independently of the library, and by `convert` itself.
        let by_test = tmp.path().join(format!("split-test-{name}.gguf"));
        split_kv_b(&legacy, &by_test, false);
        let by_convert = tmp.path().join(format!("split-convert-{name}.gguf"));
        convert(&fixture("deepseek_v3"), &by_convert, ty, |_, _| {}).unwrap();
        for file in [&by_test, &by_convert] {
            let g = GgufFile::open(file).unwrap();
            assert!(g.get_tensor("blk.2.attn_kv_b.weight").is_none());
            assert!(g.get_tensor("blk.2.attn_k_b.weight").is_some());
            let m = model::load(file).unwrap();
            let got = prompt_logits(m.as_ref(), &prompt);
            assert_eq!(bits(&got), bits(&base), "{name}: {}", file.display());
            // Streaming (nothing mapped, experts read on demand into a small cache): the
            // rebuilt kv_b is resident, the experts come from the file.
            let info = m.info();
            let opts = StoreOptions {
                ram_budget: Some(info.dense_bytes as u64 + 4 * 32 * 64 * 3 * 4),
                io_threads: 2,
                ..StoreOptions::default()
            };
            let streamed =
                model::load_with(file, &colibri::model::LoadOptions::from(opts.clone())).unwrap();
            let got = prompt_logits(streamed.as_ref(), &prompt);
            assert_eq!(
                bits(&got),
                bits(&base),
                "{name} streamed: {}",
                file.display()
            );
            // kv_b is rebuilt in the file's type.
            let (_, _, ckpt) = model::gguf::open(file, Access::Read).unwrap();
            let d = ckpt
                .desc("model.layers.2.self_attn.kv_b_proj.weight")
                .unwrap();
            assert_eq!(d.shape, [4 * (16 + 16), 16]);
            let want = if ty == ConvertType::F32 {
                DType::F32
            } else {
                DType::F16
            };
            assert_eq!(d.dtype, want);
        }
    }
    // Mixed types (f16 k_b, f32 v_b): rebuilt as f32 with the same values.
    let legacy = tmp.path().join("kv_b-f16.gguf");
    let mixed = tmp.path().join("split-mixed.gguf");
    split_kv_b(&legacy, &mixed, true);
    let (_, _, ckpt) = model::gguf::open(&mixed, Access::Mapped).unwrap();
    let (_, _, base_ckpt) = model::gguf::open(&legacy, Access::Mapped).unwrap();
    let name = "model.layers.1.self_attn.kv_b_proj.weight";
    let rebuilt = ckpt.tensor_any_shape(name).unwrap();
    assert_eq!(rebuilt.dtype, DType::F32);
    assert_eq!(
        bits(&rebuilt.to_f32_vec().unwrap()),
        bits(
            &base_ckpt
                .tensor_any_shape(name)
                .unwrap()
                .to_f32_vec()
                .unwrap()
        )
    );
    let base = prompt_logits(model::load(&legacy).unwrap().as_ref(), &prompt);
    let got = prompt_logits(model::load(&mixed).unwrap().as_ref(), &prompt);
    assert!(
        max_abs_diff(&got, &base) <= 1e-5,
        "{}",
        max_abs_diff(&got, &base)
    );
}

/// The fixture in `dir` with an MTP layer (`model.layers.{L}`: a copy of the last layer plus
/// `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`) added to its weights.
fn with_mtp_layer(arch: &str, dir: &Path) {
    let src = fixture(arch);
    std::fs::create_dir_all(dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    let ckpt = Checkpoint::open(&src).unwrap();
    let layers = 3;
    let last = format!("model.layers.{}.", layers - 1);
    let mtp = format!("model.layers.{layers}.");
    let mut specs = Vec::new();
    let mut data = Vec::new();
    for (name, d) in ckpt.tensors() {
        let t = ckpt.tensor_any_shape(name).unwrap();
        specs.push(TensorSpec {
            name: name.clone(),
            dtype: d.dtype,
            shape: d.shape.clone(),
        });
        data.push(t.storage.bytes().to_vec());
        if let Some(rest) = name.strip_prefix(&last) {
            specs.push(TensorSpec {
                name: format!("{mtp}{rest}"),
                dtype: d.dtype,
                shape: d.shape.clone(),
            });
            // Different values, so a layer that ran would show.
            data.push(
                t.to_f32_vec()
                    .unwrap()
                    .iter()
                    .flat_map(|x| (x * 0.5 + 0.25).to_le_bytes())
                    .collect(),
            );
        }
    }
    let d = 64;
    for (name, shape) in [
        ("eh_proj.weight", vec![d, 2 * d]),
        ("enorm.weight", vec![d]),
        ("hnorm.weight", vec![d]),
        ("shared_head.norm.weight", vec![d]),
    ] {
        let n: usize = shape.iter().product();
        specs.push(TensorSpec {
            name: format!("{mtp}{name}"),
            dtype: DType::F32,
            shape,
        });
        data.push(
            (0..n)
                .flat_map(|i| (i as f32 * 1e-3).to_le_bytes())
                .collect(),
        );
    }
    let mut w = SafetensorsWriter::create(&dir.join("model.safetensors"), specs).unwrap();
    for b in &data {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn nextn_layers_are_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    // GLM: `coli convert` writes the checkpoint's MTP layer as blk.3 with nextn.* tensors,
    // as llama.cpp's converter does; loading leaves it out.
    let hf = tmp.path().join("glm-mtp");
    with_mtp_layer("glm4_moe", &hf);
    let plain = tmp.path().join("glm.gguf");
    convert(&fixture("glm4_moe"), &plain, ConvertType::F32, |_, _| {}).unwrap();
    let out = tmp.path().join("glm-mtp.gguf");
    convert(&hf, &out, ConvertType::F32, |_, _| {}).unwrap();
    let g = GgufFile::open(&out).unwrap();
    assert_eq!(g.get_u64("glm4moe.block_count").unwrap(), Some(4));
    assert_eq!(g.get_u64("glm4moe.nextn_predict_layers").unwrap(), Some(1));
    for name in [
        "blk.3.nextn.eh_proj.weight",
        "blk.3.nextn.enorm.weight",
        "blk.3.nextn.shared_head_norm.weight",
        "blk.3.attn_q.weight",
        "blk.3.ffn_gate_exps.weight",
    ] {
        assert!(g.get_tensor(name).is_some(), "{name}");
    }
    let prompt = ids(&reference_json("glm4_moe"), "prompt_ids");
    let want = prompt_logits(model::load(&plain).unwrap().as_ref(), &prompt);
    let m = model::load(&out).unwrap();
    assert_eq!(m.info().layers, 3);
    assert_eq!(bits(&prompt_logits(m.as_ref(), &prompt)), bits(&want));
    let (_, cfg, ckpt) = model::gguf::open(&out, Access::Mapped).unwrap();
    assert_eq!(cfg.usize("num_hidden_layers").unwrap(), 3);
    assert_eq!(cfg.usize("num_nextn_predict_layers").unwrap(), 1);
    assert!(
        !ckpt
            .tensors()
            .keys()
            .any(|k| k.contains("layers.3.") || k.contains("blk.3")),
        "the MTP block's tensors are left out"
    );

    // DeepSeek: llama.cpp's converter drops the MTP layer; a deepseek2 file that carries one
    // (block_count counting it, nextn_predict_layers saying so) loads the same.
    let hf = tmp.path().join("ds-mtp");
    with_mtp_layer("deepseek_v3", &hf);
    let dropped = tmp.path().join("ds-dropped.gguf");
    let report = convert(&hf, &dropped, ConvertType::F32, |_, _| {}).unwrap();
    let g = GgufFile::open(&dropped).unwrap();
    assert_eq!(g.get_u64("deepseek2.block_count").unwrap(), Some(3));
    assert!(
        g.get_tensor("blk.3.attn_q_a.weight").is_none(),
        "{report:?}"
    );
    let carried = tmp.path().join("ds-nextn.gguf");
    rewrite(&dropped, &carried, |md, ts| {
        set(md, "deepseek2.block_count", GgufValue::U32(4));
        set(md, "deepseek2.nextn_predict_layers", GgufValue::U32(1));
        let extra: Vec<_> = ts
            .iter()
            .filter_map(|(s, b)| {
                let rest = s.name.strip_prefix("blk.2.")?;
                let mut s = s.clone();
                s.name = format!("blk.3.{rest}");
                Some((s, b.iter().map(|x| x.wrapping_add(1)).collect::<Vec<u8>>()))
            })
            .collect();
        ts.extend(extra);
        ts.push((
            GgufTensorSpec::from_shape("blk.3.nextn.eh_proj.weight", &[64, 128], GgmlType::F32),
            vec![0u8; 64 * 128 * 4],
        ));
    });
    let prompt = ids(&reference_json("deepseek_v3"), "prompt_ids");
    let want = prompt_logits(model::load(&dropped).unwrap().as_ref(), &prompt);
    let m = model::load(&carried).unwrap();
    assert_eq!(m.info().layers, 3);
    assert_eq!(bits(&prompt_logits(m.as_ref(), &prompt)), bits(&want));
}

#[test]
fn missing_or_unsupported_keys_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds.gguf");
    convert(&fixture("deepseek_v3"), &ds, ConvertType::F32, |_, _| {}).unwrap();
    let glm = tmp.path().join("glm.gguf");
    convert(&fixture("glm4_moe"), &glm, ConvertType::F32, |_, _| {}).unwrap();
    let load_err = |src: &Path, name: &str, edit: &dyn Fn(&mut Metadata)| {
        let p = tmp.path().join(name);
        rewrite(src, &p, |md, _| edit(md));
        model::load(&p).map(|_| ()).unwrap_err().to_string()
    };
    let drop_key = |key: &'static str| move |md: &mut Metadata| md.retain(|(k, _)| k != key);

    let e = load_err(
        &ds,
        "no-kv-lora.gguf",
        &drop_key("deepseek2.attention.kv_lora_rank"),
    );
    assert!(
        e.contains("deepseek2.attention.kv_lora_rank") && e.contains("missing"),
        "{e}"
    );
    let e = load_err(
        &ds,
        "no-q-lora.gguf",
        &drop_key("deepseek2.attention.q_lora_rank"),
    );
    assert!(e.contains("deepseek2.attention.q_lora_rank"), "{e}");
    let e = load_err(&ds, "softmax.gguf", &|md| {
        set(md, "deepseek2.expert_gating_func", GgufValue::U32(1))
    });
    assert!(
        e.contains("deepseek2.expert_gating_func") && e.contains("softmax"),
        "{e}"
    );
    // Without the key llama.cpp routes a deepseek2 file like DeepSeek-V2 (softmax).
    let e = load_err(
        &ds,
        "no-gating.gguf",
        &drop_key("deepseek2.expert_gating_func"),
    );
    assert!(
        e.contains("deepseek2.expert_gating_func") && e.contains("missing"),
        "{e}"
    );
    let e = load_err(&ds, "attn-factor.gguf", &|md| {
        set(
            md,
            "deepseek2.rope.scaling.yarn_attn_factor",
            GgufValue::F32(0.7),
        )
    });
    assert!(e.contains("deepseek2.rope.scaling.yarn_attn_factor"), "{e}");
    let e = load_err(&glm, "no-experts.gguf", &drop_key("glm4moe.expert_count"));
    assert!(
        e.contains("glm4moe.expert_count") && e.contains("missing"),
        "{e}"
    );
    let e = load_err(&glm, "bad-nextn.gguf", &|md| {
        set(md, "glm4moe.nextn_predict_layers", GgufValue::U32(3))
    });
    assert!(e.contains("glm4moe.nextn_predict_layers"), "{e}");

    // A split file missing half of a pair names the tensor.
    let p = tmp.path().join("no-v-b.gguf");
    rewrite(&ds, &p, |_, ts| {
        ts.retain(|(s, _)| s.name != "blk.1.attn_v_b.weight")
    });
    let e = model::load(&p).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("blk.1.attn_v_b.weight"), "{e}");
    // A k_b of the wrong shape says what was expected.
    let p = tmp.path().join("bad-k-b.gguf");
    rewrite(&ds, &p, |_, ts| {
        for (s, _) in ts.iter_mut() {
            if s.name == "blk.0.attn_k_b.weight" {
                s.dims_ggml = vec![16, 4, 16];
            }
        }
    });
    let e = model::load(&p).map(|_| ()).unwrap_err().to_string();
    assert!(
        e.contains("blk.0.attn_k_b.weight") && e.contains("expected"),
        "{e}"
    );
}

/// The E4M3 code nearest to `v` (search over the finite codes).
fn encode_e4m3(v: f32) -> u8 {
    let mut best = 0u8;
    for c in 0u8..=0x7e {
        let (d, bd) = (
            (colibri::tensor::f8e4m3_to_f32(c) - v.abs()).abs(),
            (colibri::tensor::f8e4m3_to_f32(best) - v.abs()).abs(),
        );
        if d < bd {
            best = c;
        }
    }
    if v < 0.0 {
        best | 0x80
    } else {
        best
    }
}

#[test]
fn fp8_deepseek_checkpoint_converts_with_its_block_scales() {
    // DeepSeek-V3 ships FP8 projections with `_scale_inv` block scales: the GGUF holds their
    // dequantized values (`f8 · scale`, as the safetensors path computes them).
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("deepseek_v3");
    let dir = tmp.path().join("fp8");
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    let ckpt = Checkpoint::open(&src).unwrap();
    let (mut specs, mut data) = (vec![], vec![]);
    let mut quantized = 0;
    for (name, d) in ckpt.tensors() {
        let values = ckpt.tensor_any_shape(name).unwrap().to_f32_vec().unwrap();
        if !name.contains("self_attn.") || d.shape.len() != 2 {
            specs.push(TensorSpec {
                name: name.clone(),
                dtype: DType::F32,
                shape: d.shape.clone(),
            });
            data.push(values.iter().flat_map(|x| x.to_le_bytes()).collect());
            continue;
        }
        // One 128×128 block covers these small matrices.
        let scale = values.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 448.0;
        specs.push(TensorSpec {
            name: name.clone(),
            dtype: DType::F8E4M3,
            shape: d.shape.clone(),
        });
        data.push(values.iter().map(|x| encode_e4m3(x / scale)).collect());
        specs.push(TensorSpec {
            name: format!("{name}_scale_inv"),
            dtype: DType::F32,
            shape: vec![1, 1],
        });
        data.push(scale.to_le_bytes().to_vec());
        quantized += 1;
    }
    assert_eq!(quantized, 3 * 5);
    let mut w = SafetensorsWriter::create(&dir.join("model.safetensors"), specs).unwrap();
    for b in &data {
        w.write(b).unwrap();
    }
    w.finish().unwrap();

    let out = tmp.path().join("fp8.gguf");
    convert(&dir, &out, ConvertType::F32, |_, _| {}).unwrap();
    let prompt = ids(&reference_json("deepseek_v3"), "prompt_ids");
    let fp8 = prompt_logits(model::load(&dir).unwrap().as_ref(), &prompt);
    let gguf = prompt_logits(model::load(&out).unwrap().as_ref(), &prompt);
    assert_eq!(bits(&gguf), bits(&fp8));
    let worst = max_abs_diff(&gguf, &common::reference_logits("deepseek_v3"));
    // (Coarse: one scale per matrix. What matters is the equality above.)
    assert!(worst > 1e-4, "FP8 changed nothing? {worst}");
}

#[test]
fn quantized_mixes_load_and_stay_close() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in ["deepseek_v3", "glm4_moe"] {
        let prompt = ids(&reference_json(arch), "prompt_ids");
        let want = common::reference_logits(arch);
        for mix in [ConvertType::Q8_0, ConvertType::BF16] {
            let out = tmp.path().join(format!("{arch}-{mix:?}.gguf"));
            convert(&fixture(arch), &out, mix, |_, _| {}).unwrap();
            let got = prompt_logits(model::load(&out).unwrap().as_ref(), &prompt);
            // Mean, not max: a rounding can flip a near-tied routing choice somewhere.
            let mean = mean_abs_diff(&got, &want);
            let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            assert!(
                mean > 0.0 && mean <= 0.05 * scale.max(1.0),
                "{arch} {mix:?}: mean |Δ| {mean} (logit scale {scale})"
            );
        }
    }
}
