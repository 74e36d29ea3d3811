//! Time of one decode step's attention (no assertion: a tool for kernel work, not a test).
//!
//! `cargo run --release -p colibri-engine --example attention_speed -- HEADS KV_HEADS HEAD_DIM
//! KEYS [f16] [REPS]` prints the process CPU nanoseconds per (query head, key) score for one token attending
//! over `KEYS` cached keys on one thread.

use colibri::model::cache::{KvDType, LayerKv};
use colibri::model::layers::{attend, AttendShape};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (heads, kv_heads, hd, keys) = (num(0, 9), num(1, 3), num(2, 64), num(3, 4096));
    let f16 = args.get(4).map(String::as_str) == Some("f16");
    let reps = num(5, 200);
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()
        .unwrap();
    let kv_dim = kv_heads * hd;
    let mut state = 1u32;
    let mut rnd = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state as f32 / u32::MAX as f32) - 0.5
            })
            .collect()
    };
    let mut kv = LayerKv::with_dtype(if f16 { KvDType::F16 } else { KvDType::F32 });
    kv.k.extend(&rnd(keys * kv_dim));
    kv.v.extend(&rnd(keys * kv_dim));
    let q = rnd(heads * hd);
    let shape = AttendShape {
        heads,
        kv_heads,
        head_dim: hd,
        window: None,
        scale: 1.0 / (hd as f32).sqrt(),
        sinks: None,
        bias: None,
    };
    let mut sink = 0.0f32;
    // The process CPU time (one compute thread), not the wall clock: the machine is shared.
    let cpu = || {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec for the call to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
        t.tv_sec as f64 * 1e9 + t.tv_nsec as f64
    };
    let t0 = cpu();
    for _ in 0..reps {
        sink += attend(&q, &kv, shape, keys - 1, f16)[0];
    }
    let ns = (cpu() - t0) / (reps * heads * keys) as f64;
    println!("{heads}/{kv_heads} heads × {hd}, {keys} keys, f16 {f16}: {ns:.2} CPU ns per score ({sink:.3})");
}
