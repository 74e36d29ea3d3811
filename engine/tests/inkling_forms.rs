//! Inkling's experts in each form a checkpoint may hold them give the same bits: transformers'
//! fused `experts.gate_up_proj [E, 2I, D]` (gate rows, then up rows) with `experts.down_proj`
//! and the shared experts' `shared_experts.{gate,up,down}_proj [S, ·, ·]` (the committed
//! fixture); the hub's `experts.w13_weight` / `shared_w13_weight` (gate and up rows
//! interleaved) with `w2_weight` / `shared_w2_weight`; and one matrix per expert — resident
//! and streamed through the expert cache.

mod common;
use common::{bits, copy_text_files, fixture, prompt, write_tensors};

use std::path::Path;

use colibri::format::safetensors::Checkpoint;
use colibri::model::{self, LoadOptions, Logits};
use colibri::store::StoreOptions;
use colibri::tensor::DType;

type Tensors = Vec<(String, DType, Vec<usize>, Vec<u8>)>;

/// What a form writes for one fixture tensor (`None`: the tensor as it is).
type Parts = Option<Vec<(String, Vec<usize>, Vec<f32>)>>;
/// A form: from the fixture's checkpoint, a tensor's name, shape and values, what to write.
type Form = fn(&Checkpoint, &str, &[usize], &[f32]) -> Parts;

/// The fixture's tensors with every fused expert tensor rewritten by `form`.
fn rewritten(form: Form) -> Tensors {
    let ckpt = Checkpoint::open(&fixture("inkling")).unwrap();
    let f32_bytes = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
    let mut out = Vec::new();
    for (name, d) in ckpt.tensors() {
        let values = values(&ckpt, name);
        match form(&ckpt, name, &d.shape, &values) {
            Some(parts) => {
                for (n, shape, v) in parts {
                    out.push((n, DType::F32, shape, f32_bytes(&v)));
                }
            }
            None => out.push((
                name.clone(),
                DType::F32,
                d.shape.clone(),
                f32_bytes(&values),
            )),
        }
    }
    out
}

fn values(ckpt: &Checkpoint, name: &str) -> Vec<f32> {
    ckpt.tensor_any_shape(name).unwrap().to_f32_vec().unwrap()
}

/// `[E, 2I, D]` gate rows then up rows, as gate and up rows interleaved.
fn interleave(i: usize, d: usize, v: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(v.len());
    for e in v.chunks(2 * i * d) {
        for r in 0..i {
            out.extend_from_slice(&e[r * d..(r + 1) * d]);
            out.extend_from_slice(&e[(i + r) * d..(i + r + 1) * d]);
        }
    }
    out
}

/// The hub's names and layout: `w13_weight`, `w2_weight`, `shared_w13_weight`,
/// `shared_w2_weight`.
fn hub(ckpt: &Checkpoint, name: &str, shape: &[usize], v: &[f32]) -> Parts {
    let renamed = |n: String, values: Vec<f32>, shape: Vec<usize>| Some(vec![(n, shape, values)]);
    if let Some(p) = name.strip_suffix(".experts.gate_up_proj") {
        let values = interleave(shape[1] / 2, shape[2], v);
        return renamed(format!("{p}.experts.w13_weight"), values, shape.to_vec());
    }
    if let Some(p) = name.strip_suffix(".experts.down_proj") {
        return renamed(format!("{p}.experts.w2_weight"), v.to_vec(), shape.to_vec());
    }
    if let Some(p) = name.strip_suffix(".shared_experts.gate_proj") {
        let up = values(ckpt, &format!("{p}.shared_experts.up_proj"));
        let (s, i, d) = (shape[0], shape[1], shape[2]);
        let mut halves = Vec::with_capacity(2 * v.len());
        for (g, u) in v.chunks(i * d).zip(up.chunks(i * d)) {
            halves.extend_from_slice(g);
            halves.extend_from_slice(u);
        }
        let values = interleave(i, d, &halves);
        return renamed(format!("{p}.shared_w13_weight"), values, vec![s, 2 * i, d]);
    }
    if name.ends_with(".shared_experts.up_proj") {
        return Some(vec![]);
    }
    if let Some(p) = name.strip_suffix(".shared_experts.down_proj") {
        return renamed(format!("{p}.shared_w2_weight"), v.to_vec(), shape.to_vec());
    }
    None
}

/// One matrix per expert (`{parent}.{e}.{gate,up,down}_proj.weight`).
fn per_expert(_: &Checkpoint, name: &str, shape: &[usize], v: &[f32]) -> Parts {
    if shape.len() != 3 || !name.contains("experts.") {
        return None;
    }
    let split = |parent: &str, matrices: &[(&str, usize)]| {
        let cols = shape[2];
        let rows: usize = matrices.iter().map(|m| m.1).sum();
        let mut out = Vec::new();
        for (e, block) in v.chunks(rows * cols).enumerate() {
            let mut at = 0;
            for (m, r) in matrices {
                let values = block[at * cols..(at + r) * cols].to_vec();
                out.push((format!("{parent}.{e}.{m}.weight"), vec![*r, cols], values));
                at += r;
            }
        }
        Some(out)
    };
    let rows = shape[1];
    if let Some(p) = name.strip_suffix(".gate_up_proj") {
        return split(p, &[("gate_proj", rows / 2), ("up_proj", rows / 2)]);
    }
    let (parent, m) = name.rsplit_once('.')?;
    split(parent, &[(m, rows)])
}

fn logits(dir: &Path, opts: &StoreOptions) -> Vec<u32> {
    let ids = prompt("inkling");
    let m = model::load_with(dir, &LoadOptions::from(opts.clone()))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut cache = m.new_cache(ids.len());
    bits(&m.forward(&ids, &mut cache, Logits::All).unwrap())
}

#[test]
fn inkling_experts_in_every_form_give_the_same_bits_resident_and_streamed() {
    let want = logits(&fixture("inkling"), &StoreOptions::default());
    let tmp = tempfile::tempdir().unwrap();
    let resident = model::load(&fixture("inkling")).unwrap().info().dense_bytes as u64;
    let streamed = StoreOptions {
        ram_budget: Some(resident + 64 * 1024),
        io_threads: 2,
        prefetch: true,
        learn: false,
        ..StoreOptions::default()
    };
    for (what, form) in [("hub w13", hub as Form), ("per expert", per_expert as Form)] {
        let dir = tmp.path().join(what.replace(' ', "_"));
        let tensors = rewritten(form);
        assert!(
            tensors
                .iter()
                .all(|t| !t.0.ends_with("gate_up_proj") && !t.0.ends_with("experts.up_proj")),
            "{what}: nothing fused is left in transformers' form"
        );
        write_tensors(&dir, tensors);
        copy_text_files(&fixture("inkling"), &dir);
        assert!(
            logits(&dir, &StoreOptions::default()) == want,
            "{what}: resident"
        );
        assert!(logits(&dir, &streamed) == want, "{what}: streamed");
    }
}
