//! Absurd but well-formed model files get one clear error naming the file and the field —
//! never a panic, an abort on a huge allocation or a hang. Each case is a committed fixture
//! of a family the registry loads (or its GGUF conversion), copied to a temporary directory
//! with one count or size made absurd, and loaded by `coli info` in a child process under
//! `ulimit -v` of 4 GiB and a 10 s deadline: it must exit with an error code (not a signal)
//! and say which file and which field.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod support;
use support::fixture;

use colibri::convert::{convert, ConvertType};
use colibri::format::gguf::{GgufFile, GgufTensorSpec, GgufValue, GgufWriter};

/// How long one load may take.
const DEADLINE: Duration = Duration::from_secs(10);
/// The address-space limit of the child, in KiB (`ulimit -v`): 4 GiB.
const ADDRESS_SPACE_KIB: u64 = 4 << 20;

/// Counts the mutation tests found panicking, aborting or hanging.
const ABSURD_COUNTS: [u64; 4] = [1 << 62, (1 << 63) - 1, 1 << 32, 1 << 31];

/// Every family the registry loads (engine/src/model/mod.rs; `kimi_k25` stands for the
/// DeepSeek-V3 stack under Kimi's names), the config field holding its routed-expert count,
/// and the size fields its loader reads.
struct Family {
    fixture: &'static str,
    experts: Option<&'static str>,
    sizes: &'static [&'static str],
}

const STANDARD: &[&str] = &[
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
];
/// Families whose config sets `head_dim` and a dense `intermediate_size` beside the experts'.
const HEAD_DIM: &[&str] = &[
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "head_dim",
    "moe_intermediate_size",
    "intermediate_size",
];
const MLA: &[&str] = &[
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "moe_intermediate_size",
    "intermediate_size",
];

/// Sizes of the Inkling family (full and sliding layers' heads, the relative bias, the
/// short convolutions).
const INKLING: &[&str] = &[
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "head_dim",
    "swa_num_attention_heads",
    "swa_num_key_value_heads",
    "swa_head_dim",
    "sliding_window_size",
    "rel_extent",
    "d_rel",
    "conv_kernel_size",
    "moe_intermediate_size",
];
/// Sizes of the Gated DeltaNet hybrids (gated attention beside linear attention).
const DELTA_NET: &[&str] = &[
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "head_dim",
    "moe_intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
];

const FAMILIES: &[Family] = &[
    Family {
        fixture: "llama",
        experts: None,
        sizes: STANDARD,
    },
    Family {
        fixture: "mixtral",
        experts: Some("num_local_experts"),
        sizes: STANDARD,
    },
    Family {
        fixture: "olmoe",
        experts: Some("num_experts"),
        sizes: STANDARD,
    },
    Family {
        // Its config spells the count `num_local_experts`, the alias of `num_experts`.
        fixture: "qwen3_moe",
        experts: Some("num_local_experts"),
        sizes: HEAD_DIM,
    },
    Family {
        fixture: "glm4_moe",
        experts: Some("n_routed_experts"),
        sizes: HEAD_DIM,
    },
    Family {
        fixture: "deepseek_v3",
        experts: Some("n_routed_experts"),
        sizes: MLA,
    },
    Family {
        fixture: "kimi_k25",
        experts: Some("n_routed_experts"),
        sizes: MLA,
    },
    Family {
        fixture: "glm_moe_dsa",
        experts: Some("n_routed_experts"),
        sizes: &[
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "moe_intermediate_size",
            "index_n_heads",
            "index_head_dim",
        ],
    },
    Family {
        fixture: "qwen3_next",
        experts: Some("num_experts"),
        sizes: DELTA_NET,
    },
    Family {
        fixture: "qwen3_5_moe",
        experts: Some("num_experts"),
        sizes: DELTA_NET,
    },
    Family {
        fixture: "kimi_linear",
        experts: Some("num_experts"),
        sizes: &[
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "moe_intermediate_size",
            "linear_num_heads",
            "linear_head_dim",
            "linear_conv_kernel_dim",
        ],
    },
    Family {
        fixture: "minimax_m2",
        experts: Some("num_local_experts"),
        sizes: &[
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "head_dim",
            "intermediate_size",
        ],
    },
    Family {
        // Its experts are fused tensors, split per expert when the checkpoint opens.
        fixture: "gpt_oss",
        experts: Some("num_local_experts"),
        sizes: &[
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "head_dim",
            "intermediate_size",
            "sliding_window",
        ],
    },
    Family {
        fixture: "inkling",
        experts: Some("n_routed_experts"),
        sizes: INKLING,
    },
    Family {
        fixture: "inkling2",
        experts: Some("n_routed_experts"),
        sizes: INKLING,
    },
    Family {
        fixture: "deepseek_v4",
        experts: Some("n_routed_experts"),
        sizes: &[
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "moe_intermediate_size",
            "o_groups",
            "o_lora_rank",
            "hc_mult",
        ],
    },
];

/// A copy of a fixture directory to break.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

/// Rewrite `config.json` of `dir` with `f` applied to the model's own config (a nested
/// `text_config` where there is one, as in Kimi's).
fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    match v.get_mut("text_config") {
        Some(text) => f(text),
        None => f(&mut v),
    }
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

/// How a `coli info` run ended.
struct Run {
    out: Output,
    took: Duration,
}

/// `coli info --model <model>` under the address-space limit, waited for up to the
/// deadline (a run past it is killed and fails the test).
fn coli_info(model: &Path) -> Run {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "ulimit -v {ADDRESS_SPACE_KIB} || exit 99; exec \"$0\" info --model \"$1\""
        ))
        .arg(env!("CARGO_BIN_EXE_coli"))
        .arg(model);
    let child = support::isolated(&mut cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sh runs");
    let pid = child.id();
    let t0 = Instant::now();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(out) => Run {
            out: out.expect("coli info runs"),
            took: t0.elapsed(),
        },
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!(
                "coli info --model {} still running after {DEADLINE:?}",
                model.display()
            );
        }
    }
}

/// The cases run, and the slowest.
#[derive(Default)]
struct Tally {
    cases: usize,
    slowest: Duration,
    slowest_case: String,
}

impl Tally {
    /// Load `model` and require a clean refusal whose message names every one of `names`
    /// (the file and the field).
    fn refused(&mut self, case: &str, model: &Path, names: &[&str]) {
        let run = coli_info(model);
        let stderr = String::from_utf8_lossy(&run.out.stderr);
        let status = run.out.status;
        assert_ne!(
            status.code(),
            Some(99),
            "{case}: ulimit -v failed: {stderr}"
        );
        assert!(
            status.signal().is_none(),
            "{case}: killed by signal {:?} after {:?}: {stderr}",
            status.signal(),
            run.took
        );
        assert!(
            !status.success(),
            "{case}: loaded, but should have been refused"
        );
        assert!(
            !stderr.contains("panicked"),
            "{case}: panicked on the way: {stderr}"
        );
        for name in names {
            assert!(stderr.contains(name), "{case}: no `{name}` in: {stderr}");
        }
        self.cases += 1;
        if run.took > self.slowest {
            self.slowest = run.took;
            self.slowest_case = case.to_string();
        }
    }

    fn report(&self, what: &str) {
        eprintln!(
            "{what}: {} absurd files refused cleanly; slowest {:.0} ms ({})",
            self.cases,
            self.slowest.as_secs_f64() * 1e3,
            self.slowest_case
        );
    }
}

#[test]
fn the_unbroken_fixtures_load_under_the_same_limits() {
    // The control: the limit and the deadline leave room for a real load, so a refusal
    // below is the loader's doing.
    for fam in FAMILIES {
        let run = coli_info(&fixture(fam.fixture));
        assert!(
            run.out.status.success(),
            "{}: {}",
            fam.fixture,
            String::from_utf8_lossy(&run.out.stderr)
        );
    }
}

#[test]
fn absurd_counts_and_sizes_in_config_json_are_refused_naming_the_field() {
    let mut tally = Tally::default();
    for fam in FAMILIES {
        let f = fam.fixture;
        // `field` is named in backquotes; one given as `.field` may be nested (`a.b.field`).
        let mut case = |what: String, field: &str, edit: &dyn Fn(&mut serde_json::Value)| {
            let tmp = copy_fixture(f);
            edit_config(tmp.path(), edit);
            let named = match field.strip_prefix('.') {
                Some(nested) => format!("{nested}`"),
                None => format!("`{field}`"),
            };
            tally.refused(
                &format!("{f}: {what}"),
                tmp.path(),
                &["config.json", &named],
            );
        };
        for n in ABSURD_COUNTS {
            case(
                format!("num_hidden_layers = {n}"),
                "num_hidden_layers",
                &|c| c["num_hidden_layers"] = n.into(),
            );
        }
        if let Some(field) = fam.experts {
            for n in ABSURD_COUNTS.into_iter().chain([8_388_608]) {
                case(format!("{field} = {n}"), field, &|c| c[field] = n.into());
            }
            case(
                "num_experts_per_tok above the expert count".into(),
                "num_experts_per_tok",
                &|c| {
                    let experts = c[field].as_u64().unwrap();
                    c["num_experts_per_tok"] = (experts + 1).into();
                },
            );
            case(
                "num_experts_per_tok = 0".into(),
                "num_experts_per_tok",
                &|c| c["num_experts_per_tok"] = 0.into(),
            );
        }
        for &size in fam.sizes {
            for n in [1u64 << 62, 1 << 25, 0] {
                case(format!("{size} = {n}"), size, &|c| c[size] = n.into());
            }
        }
        case(
            "partial_rotary_factor = 1e30".into(),
            ".partial_rotary_factor",
            &|c| {
                // Wherever the config says it: at the top, in `rope_parameters`, or in
                // DeepSeek-V4's nested `rope_parameters.{main,compress}`.
                c["partial_rotary_factor"] = 1e30.into();
                if let Some(p) = c.get_mut("rope_parameters").and_then(|p| p.as_object_mut()) {
                    p.remove("partial_rotary_factor");
                    for sub in p.values_mut().filter_map(|v| v.as_object_mut()) {
                        if sub.contains_key("partial_rotary_factor") {
                            sub.insert("partial_rotary_factor".into(), 1e30.into());
                        }
                    }
                }
            },
        );
    }
    tally.report("config.json");
}

#[test]
fn a_tokenizer_json_the_tokenizers_crate_panics_on_is_refused_naming_the_file() {
    let mut tally = Tally::default();
    // Both hit an `expect` inside the tokenizers crate's decoder deserializer.
    let broken_decoders = [
        (
            "a syntax error in \"decoder\"",
            r#"{"type": "ByteLevel", "add_prefix_space": false,, "trim_offsets": true}"#
                .to_string(),
            "line",
        ),
        (
            "\"decoder\" nested 200 deep",
            format!(
                r#"{{"type": "Sequence", "decoders": {}{}}}"#,
                "[".repeat(200),
                "]".repeat(200)
            ),
            "recursion limit",
        ),
    ];
    for fam in FAMILIES {
        for (what, decoder, says) in &broken_decoders {
            let tmp = copy_fixture(fam.fixture);
            let p = tmp.path().join("tokenizer.json");
            let mut tok: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            tok["decoder"] = "@DECODER@".into();
            let text = serde_json::to_string(&tok)
                .unwrap()
                .replace("\"@DECODER@\"", decoder);
            std::fs::write(&p, text).unwrap();
            tally.refused(
                &format!("{}: tokenizer.json with {what}", fam.fixture),
                tmp.path(),
                &["tokenizer.json", "invalid JSON", says],
            );
        }
    }
    tally.report("tokenizer.json");
}

/// Copy the GGUF file `src` to `dst` with one metadata value replaced.
fn rewrite_gguf(src: &Path, dst: &Path, key: &str, value: GgufValue) {
    let g = GgufFile::open(src).unwrap();
    let md: Vec<(String, GgufValue)> = g
        .metadata_keys()
        .iter()
        .map(|k| {
            let v = if k == key {
                value.clone()
            } else {
                g.metadata()[k].clone()
            };
            (k.clone(), v)
        })
        .collect();
    assert!(md.iter().any(|(k, _)| k == key), "{src:?} has no {key}");
    let specs = g
        .tensors()
        .iter()
        .map(|t| GgufTensorSpec {
            name: t.name.clone(),
            dims_ggml: t.dims_ggml.clone(),
            ggml_type: t.ggml_type,
        })
        .collect();
    let mut w = GgufWriter::create(dst, &md, specs).unwrap();
    for t in g.tensors() {
        w.write(&g.read_tensor(t).unwrap()).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn absurd_gguf_counts_are_refused_naming_the_key() {
    let mut tally = Tally::default();
    let tmp = tempfile::tempdir().unwrap();
    // Every GGUF architecture the registry maps: llama (dense, and Mixtral written as
    // llama), olmoe, qwen3moe, deepseek2 (DeepSeek-V3, Kimi) and glm4moe.
    for f in [
        "llama",
        "mixtral",
        "olmoe",
        "qwen3_moe",
        "deepseek_v3",
        "kimi_k25",
        "glm4_moe",
    ] {
        let good = tmp.path().join(format!("{f}.gguf"));
        convert(&fixture(f), &good, ConvertType::F32, |_, _| {}).unwrap();
        let g = GgufFile::open(&good).unwrap();
        let arch = g.architecture().unwrap().to_string();
        let experts = g.get_u64(&format!("{arch}.expert_count")).unwrap();
        drop(g);
        let bad = tmp.path().join(format!("{f}-absurd.gguf"));
        let mut case = |key: String, value: u32| {
            rewrite_gguf(&good, &bad, &key, GgufValue::U32(value));
            tally.refused(
                &format!("{f}.gguf: {key} = {value:#x}"),
                &bad,
                &[&format!("{f}-absurd.gguf"), &format!("`{key}`")],
            );
        };
        for n in [0x7fff_ffff, 0xffff_ffff] {
            case(format!("{arch}.block_count"), n);
        }
        if let Some(e) = experts {
            case(format!("{arch}.expert_count"), 0x7fff_ffff);
            case(format!("{arch}.expert_used_count"), e as u32 + 1);
            case(format!("{arch}.expert_used_count"), 0);
        }
    }
    tally.report("GGUF");
}
