//! Placement changes speed, never results: the same logits bits and the same greedy tokens
//! whether every expert is resident, or read from disk through a cache that holds no expert,
//! one expert, half of them or all of them, on 1 or 2 threads.

mod common;
use common::{copy_text_files, fixture, load_error, prompt, MOE_FIXTURES};

use std::path::Path;

use colibri::format::safetensors::Checkpoint;
use colibri::model::{self, CausalLm, Logits};
use colibri::runtime::generate::{generate, GenerateParams};
use colibri::runtime::sampling::SamplingParams;
use colibri::store::StoreOptions;

/// A compute pool of `threads` threads.
fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// `dir` loaded with the store placed as `opts` says.
fn load_placed(dir: &Path, opts: StoreOptions) -> Box<dyn CausalLm> {
    model::load_with(dir, &colibri::model::LoadOptions::from(opts)).unwrap()
}

/// `dir` loaded with a budget of `budget` bytes (the expert cache is what the resident set
/// leaves of it), two I/O threads, and prefetch on or off.
fn tiered(dir: &Path, budget: u64, prefetch: bool) -> Box<dyn CausalLm> {
    load_placed(
        dir,
        StoreOptions {
            ram_budget: Some(budget),
            io_threads: 2,
            prefetch,
            ..StoreOptions::default()
        },
    )
}

/// Logits of the prompt as a batch, then 8 greedy tokens decoded through the cache.
fn outputs(m: &dyn CausalLm, ids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut cache = m.new_cache(ids.len());
    let logits = m.forward(ids, &mut cache, Logits::All).unwrap();
    let params = GenerateParams {
        max_tokens: 8,
        eos_token_ids: vec![],
        stop_strings: vec![],
        sampling: SamplingParams::greedy(),
    };
    let g = generate(m, None, ids, &params, |_| {}, |_| {}).unwrap();
    (logits.iter().map(|x| x.to_bits()).collect(), g.tokens)
}

#[test]
fn every_budget_and_thread_count_gives_identical_bits() {
    for arch in MOE_FIXTURES {
        let dir = fixture(arch);
        let ids = prompt(arch);
        let reference = outputs(model::load(&dir).unwrap().as_ref(), &ids);
        let resident = model::load(&dir).unwrap();
        let info = resident.info().clone();
        let dense = info.dense_bytes as u64;
        let experts = info.routed_expert_bytes as u64;
        let one_expert = experts / (info.moe_layers * info.routed_experts) as u64;
        // Every byte of the checkpoint is resident, an expert, or left out on purpose (a vision
        // tower is not loaded at all).
        let total = Checkpoint::open(&dir).unwrap().total_bytes() as u64;
        assert_eq!(dense + experts + info.unused_bytes as u64, total, "{arch}");
        assert_eq!(
            info.unused_bytes > 0,
            matches!(arch, "kimi_k25" | "glm5_next"),
            "{arch}: only the vision-language checkpoints leave tensors out"
        );
        for (what, budget) in [
            ("no expert", dense),
            ("one expert", dense + one_expert),
            ("half", dense + experts / 2),
            ("all", dense + experts),
        ] {
            for (threads, prefetch) in [(1, false), (2, false), (1, true), (2, true)] {
                let opts = StoreOptions {
                    ram_budget: Some(budget),
                    io_threads: 2,
                    prefetch,
                    ..StoreOptions::default()
                };
                let got = pool(threads).install(|| outputs(load_placed(&dir, opts).as_ref(), &ids));
                assert!(
                    got.0 == reference.0,
                    "{arch}: logits differ: budget `{what}`, {threads} threads, prefetch {prefetch}"
                );
                assert_eq!(
                    got.1, reference.1,
                    "{arch}: tokens differ: budget `{what}`, {threads} threads, prefetch {prefetch}"
                );
            }
        }
    }
}

#[test]
fn a_budget_below_the_resident_set_is_refused_with_numbers() {
    let dir = fixture("olmoe");
    let opts = StoreOptions {
        ram_budget: Some(1000),
        ..StoreOptions::default()
    };
    let e = load_error(&dir, &colibri::model::LoadOptions::from(opts));
    assert!(
        e.contains("resident") && e.contains("budget") && e.contains("--ram"),
        "{e}"
    );
}

#[test]
fn the_tiered_store_really_reads_from_disk_and_prefetch_guesses() {
    let dir = fixture("olmoe");
    let ids = prompt("olmoe");
    let resident = model::load(&dir).unwrap().info().dense_bytes as u64;
    // Budget for no expert: every expert of every step is read.
    let m = tiered(&dir, resident, true);
    let _ = outputs(m.as_ref(), &ids);
    let s = m.store_stats().expect("tiered store keeps stats");
    assert_eq!(s.hits, 0, "nothing fits, so nothing can hit");
    assert!(s.misses > 0 && s.bytes_read >= s.miss_bytes, "{s:?}");
    assert!(
        s.prefetch_needed > 0,
        "hints were given before layer 1: {s:?}"
    );
    // Budget for everything: after the first step, steps hit.
    let all = resident + m.info().routed_expert_bytes as u64;
    let m = tiered(&dir, all, false);
    let _ = outputs(m.as_ref(), &ids);
    let s = m.store_stats().unwrap();
    assert!(
        s.hits > 0 && s.bytes_read <= m.info().routed_expert_bytes as u64,
        "{s:?}"
    );
}

#[test]
fn deepseek_v4_prefetches_the_next_layers_experts_as_deepseek_v3_does() {
    for arch in ["deepseek_v3", "deepseek_v4"] {
        let dir = fixture(arch);
        let ids = prompt(arch);
        let plain = model::load(&dir).unwrap();
        let resident = plain.info().dense_bytes as u64;
        let want = outputs(plain.as_ref(), &ids);
        // A cache for no expert, so each hint starts reads the next layer then finds in flight.
        let m = tiered(&dir, resident, true);
        assert_eq!(
            outputs(m.as_ref(), &ids),
            want,
            "{arch}: prefetch changed a bit"
        );
        let s = m.store_stats().expect("tiered store keeps stats");
        eprintln!(
            "{arch}: {} prefetch reads, {} of {} needed experts guessed",
            s.prefetch_reads, s.prefetch_guessed, s.prefetch_needed
        );
        assert!(
            s.prefetch_reads > 0 && s.prefetch_needed > 0,
            "{arch}: hints were given before the layers that used them: {s:?}"
        );
        if arch == "deepseek_v4" {
            // Layer 1 routes by token id, so the hint after layer 0's attention is exact.
            assert!(s.prefetch_guessed > 0, "{s:?}");
        }
    }
}

/// Copy `arch`'s fixture split into two shards (so a mirror can hold only one of them).
fn sharded_copy(arch: &str, to: &Path) {
    use colibri::format::write::{SafetensorsWriter, TensorSpec};
    copy_text_files(&fixture(arch), to);
    let ck = Checkpoint::open(&fixture(arch)).unwrap();
    let names: Vec<String> = ck.tensors().keys().cloned().collect();
    let half = names.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&names[..half], &names[half..]].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let specs = part
            .iter()
            .map(|n| {
                let d = ck.desc(n).unwrap();
                TensorSpec {
                    name: n.clone(),
                    dtype: d.dtype,
                    shape: d.shape.clone(),
                }
            })
            .collect();
        let mut w = SafetensorsWriter::create(&to.join(&file), specs).unwrap();
        for n in part.iter() {
            w.write(ck.tensor_any_shape(n).unwrap().storage.bytes())
                .unwrap();
            map.insert(n.clone(), file.clone().into());
        }
        w.finish().unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(to.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn readers_direct_io_mirrors_and_learned_pins_never_change_bits() {
    for arch in MOE_FIXTURES {
        variants_never_change_bits(arch);
    }
}

fn variants_never_change_bits(arch: &str) {
    use colibri::store::mirror::Mirror;
    use colibri::store::reader::ReaderKind;
    use colibri::store::CachePolicy;
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let primary = tmp.path().join("primary");
    let full = tmp.path().join("mirror-full");
    let partial = tmp.path().join("mirror-partial");
    let state = tmp.path().join("state");
    for d in [&primary, &full, &partial] {
        std::fs::create_dir_all(d).unwrap();
    }
    sharded_copy(arch, &primary);
    for entry in std::fs::read_dir(&primary).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        std::fs::copy(&p, full.join(&name)).unwrap();
        if name == "model-00002-of-00002.safetensors" {
            std::fs::copy(&p, partial.join(&name)).unwrap();
        }
    }
    let ids = prompt(arch);
    let reference = outputs(model::load(&fixture(arch)).unwrap().as_ref(), &ids);
    let info = model::load(&primary).unwrap().info().clone();
    let one_expert = (info.routed_expert_bytes / (info.moe_layers * info.routed_experts)) as u64;
    let base = StoreOptions {
        ram_budget: Some(info.dense_bytes as u64 + 3 * one_expert),
        io_threads: 2,
        prefetch: true,
        ..StoreOptions::default()
    };
    let variants: Vec<(&str, StoreOptions)> = vec![
        (
            "pread pool",
            StoreOptions {
                reader: ReaderKind::Pool,
                ..base.clone()
            },
        ),
        (
            "io-uring or fallback",
            StoreOptions {
                reader: ReaderKind::Auto,
                ..base.clone()
            },
        ),
        (
            "direct I/O",
            StoreOptions {
                direct_io: true,
                ..base.clone()
            },
        ),
        (
            "direct I/O, no prefetch",
            StoreOptions {
                direct_io: true,
                prefetch: false,
                ..base.clone()
            },
        ),
        (
            "full mirror",
            StoreOptions {
                mirrors: vec![Mirror {
                    dir: full.clone(),
                    weight: 2.0,
                }],
                ..base.clone()
            },
        ),
        (
            "partial mirror",
            StoreOptions {
                mirrors: vec![Mirror {
                    dir: partial.clone(),
                    weight: 1.0,
                }],
                ..base.clone()
            },
        ),
        (
            "LFRU",
            StoreOptions {
                policy: CachePolicy::Lfru,
                ..base.clone()
            },
        ),
        (
            "learning",
            StoreOptions {
                learn: true,
                state_dir: Some(state.clone()),
                ..base.clone()
            },
        ),
    ];
    for (what, opts) in &variants {
        let m = model::load_with(&primary, &colibri::model::LoadOptions::from(opts.clone()))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(outputs(m.as_ref(), &ids), reference, "{what}");
        m.flush().unwrap();
    }
    // The learning run left a history; loading again pins its hottest experts and still
    // gives the same bits.
    let opts = StoreOptions {
        learn: true,
        state_dir: Some(state.clone()),
        ..base.clone()
    };
    let m = load_placed(&primary, opts.clone());
    let s = m.store_stats().unwrap();
    assert!(s.pinned_bytes > 0, "learned pins were loaded: {s:?}");
    assert_eq!(outputs(m.as_ref(), &ids), reference, "with learned pins");
    assert!(std::fs::read_dir(state.join("usage")).unwrap().count() == 1);
    assert!(
        !primary.join("usage").exists(),
        "history is never written into the model directory"
    );
}

#[test]
fn a_mirror_failing_mid_run_falls_back_and_a_primary_failure_is_a_clear_error() {
    use colibri::store::mirror::Mirror;
    let arch = "olmoe";
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let primary = tmp.path().join("primary");
    let mirror = tmp.path().join("mirror");
    std::fs::create_dir_all(&primary).unwrap();
    std::fs::create_dir_all(&mirror).unwrap();
    sharded_copy(arch, &primary);
    for entry in std::fs::read_dir(&primary).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, mirror.join(p.file_name().unwrap())).unwrap();
    }
    let ids = prompt(arch);
    let reference = outputs(model::load(&fixture(arch)).unwrap().as_ref(), &ids);
    let dense = model::load(&primary).unwrap().info().dense_bytes as u64;
    let opts = StoreOptions {
        ram_budget: Some(dense), // nothing cached: every step reads
        io_threads: 2,
        mirrors: vec![Mirror {
            dir: mirror.clone(),
            weight: 100.0,
        }],
        ..StoreOptions::default()
    };
    let m = load_placed(&primary, opts.clone());
    // The mirror's files lose their data after validation: every mirror read fails.
    common::truncate_safetensors(&mirror);
    assert_eq!(
        outputs(m.as_ref(), &ids),
        reference,
        "fallback to the primary keeps the tokens"
    );

    // Now the primary loses its data mid-run: a clear error naming the file and offset.
    let no_mirror = StoreOptions {
        mirrors: vec![],
        ..opts
    };
    let m = load_placed(&primary, no_mirror.clone());
    common::truncate_safetensors(&primary);
    let mut cache = m.new_cache(ids.len());
    let e = m
        .forward(&ids, &mut cache, Logits::All)
        .expect_err("reads must fail")
        .to_string();
    assert!(e.contains("safetensors") && e.contains("offset"), "{e}");
}

/// The same for GGUF files in block formats: experts are slices of the fused
/// `ffn_*_exps` tensors, streamed through the same cache; budgets, prefetch, direct I/O and
/// threads leave the bits alone.
#[test]
fn gguf_experts_stream_with_identical_bits() {
    use colibri::convert::{convert, ConvertType};
    let tmp = tempfile::tempdir().unwrap();
    for (arch, mix) in [
        ("mixtral", ConvertType::Q8_0),
        ("qwen3_moe", ConvertType::Q4KM),
    ] {
        let path = tmp.path().join(format!("{arch}.gguf"));
        convert(&fixture(arch), &path, mix, |_, _| {}).unwrap();
        let ids = prompt(arch);
        let resident = model::load(&path).unwrap();
        let reference = outputs(resident.as_ref(), &ids);
        let info = resident.info().clone();
        let (dense, experts) = (info.dense_bytes as u64, info.routed_expert_bytes as u64);
        assert!(experts > 0, "{arch}: no routed experts found in the GGUF");
        let one_expert = experts / (info.moe_layers * info.routed_experts) as u64;
        for (what, budget) in [
            ("no expert", dense),
            ("one expert", dense + one_expert),
            ("half", dense + experts / 2),
        ] {
            for (threads, prefetch, direct_io) in [(1, false, false), (2, true, true)] {
                let opts = StoreOptions {
                    ram_budget: Some(budget),
                    io_threads: 2,
                    prefetch,
                    direct_io,
                    learn: false,
                    ..StoreOptions::default()
                };
                let got = pool(threads).install(|| {
                    let m = load_placed(&path, opts);
                    let out = outputs(m.as_ref(), &ids);
                    (out, m.store_stats())
                });
                assert!(
                    got.0 == reference,
                    "{arch} GGUF: outputs differ with budget `{what}`, {threads} threads"
                );
                if what == "no expert" {
                    let s = got.1.expect("a streaming store keeps counters");
                    assert!(s.bytes_read > 0, "{arch}: nothing was read from the GGUF");
                }
            }
        }
    }
}
