//! Q4_K matrices interleaved in eights at load (`tensor::qmatmul::interleaved`) compute the
//! same bits as the file's layout, through a whole model: a synthetic Q4_K_M MoE whose
//! matrices are wide enough to interleave (rows of 256 values and more), loaded with the
//! layout forced off and forced on, prefill and greedy decode at one and two threads.

use clap::Parser;
use colibri::model::{self, Logits};
use colibri::tensor::qmatmul::interleaved;
use colibri_synth::{synthesize, SynthArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: SynthArgs,
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits of every prompt position, then of six greedy decode steps.
fn run(m: &dyn model::CausalLm, prompt: &[u32]) -> Vec<u32> {
    let mut cache = m.new_cache(prompt.len() + 8);
    let all = m.forward(prompt, &mut cache, Logits::All).unwrap();
    let v = m.info().vocab_size;
    let mut out = bits(&all);
    let mut last = all[all.len() - v..].to_vec();
    for _ in 0..6 {
        let next = last
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        last = m.forward(&[next], &mut cache, Logits::Last).unwrap();
        out.extend(bits(&last));
    }
    out
}

#[test]
fn interleaved_q4_k_gives_the_files_bits_through_a_model() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("moe.gguf");
    let cli = Cli::parse_from([
        "synth",
        "--arch",
        "qwen3-moe",
        "--layers",
        "2",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--moe-intermediate",
        "256",
        "--vocab",
        "512",
        "--seed",
        "3",
        "--format",
        "gguf",
        "--type",
        "q4_k_m",
        "--out",
        path.to_str().unwrap(),
    ]);
    synthesize(&cli.args, false).unwrap();
    let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 512).collect();
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };

    interleaved::set_mode(interleaved::Mode::Never);
    let before = interleaved::made();
    let file = pool(1).install(|| run(model::load(&path).unwrap().as_ref(), &prompt));
    assert_eq!(interleaved::made(), before, "`never` interleaved something");

    interleaved::set_mode(interleaved::Mode::Always);
    for threads in [1, 2] {
        let before = interleaved::made();
        let got = pool(threads).install(|| run(model::load(&path).unwrap().as_ref(), &prompt));
        assert!(
            interleaved::made() > before,
            "nothing was interleaved: the test would compare the file's layout with itself"
        );
        assert!(
            got == file,
            "interleaved rows changed the bits at {threads} threads"
        );
    }
}
