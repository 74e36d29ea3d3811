//! Speed of the quantized matrix product (no assertion: a tool for kernel work, not a test).
//!
//! `cargo run --release -p colibri-engine --example qmatmul_speed -- TYPE ROWS COLS [M] [REPS]
//! [THREADS]` quantizes a random `ROWS × COLS` matrix to TYPE (q8_0, q4_k, q6_k, ...) and
//! multiplies `M` activation rows by it `REPS` times; prints the process CPU time per product
//! and the weight bytes streamed per CPU nanosecond. A matrix of a few hundred KiB stays in
//! cache (the kernel's compute rate); one of hundreds of MiB streams from memory. With
//! `QMATMUL_AB=1` it alternates the tiled prefill kernels and the row kernels product by
//! product and prints the median time of each. With `QMATMUL_AB=interleaved` (Q4_K) it
//! alternates the file's rows and the same rows interleaved in eights
//! (`qmatmul::interleaved`), and checks that both give the same bits; `QMATMUL_HUGE=1` puts
//! both in huge-page maps (`Storage::huge_pages`). Adding `QMATMUL_AHEAD=0,4,8` instead
//! alternates the interleaved kernel's prefetch distances, in records
//! (`prefetch::set_records_ahead`), and prints the median time of each;
//! `QMATMUL_ROWS_AHEAD=2048,3072,6144` (no `QMATMUL_AB`) does the same for the row kernels'
//! distance in bytes (`prefetch::set_row_bytes_ahead`) on the file's rows.

use colibri::tensor::qmatmul::{interleaved, prefetch, qmatmul, qmatmul_multi, QMat};
use colibri::tensor::quant::{quantize_row, QuantType};
use colibri::tensor::Storage;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map(|s| s.to_lowercase()).unwrap_or_default();
    let ty = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::IQ4_NL,
        QuantType::Q2_K,
        QuantType::Q3_K,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
        QuantType::IQ4_XS,
    ]
    .into_iter()
    .find(|t| t.name().to_lowercase() == name)
    .expect("first argument: a block type (q8_0, q4_k, ...)");
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rows, cols, m, reps, threads) = (
        num(1, 256),
        num(2, 2048),
        num(3, 1),
        num(4, 2000),
        num(5, 1),
    );
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();
    let mut state = 7u32;
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
    // QMATMUL_DISTINCT_ROWS=N quantizes only the first N rows and repeats them (a matrix
    // larger than the last-level cache without minutes of quantizing; the same bytes, other
    // addresses).
    let distinct = std::env::var("QMATMUL_DISTINCT_ROWS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(rows, |d| d.clamp(1, rows));
    let mut bytes = Vec::new();
    for _ in 0..distinct {
        quantize_row(ty, &rnd(cols), &mut bytes).expect("a quantizable row length");
    }
    let row_bytes = bytes.len() / distinct;
    while bytes.len() < rows * row_bytes {
        let take = (rows * row_bytes - bytes.len()).min(distinct * row_bytes);
        bytes.extend_from_within(..take);
    }
    let x = rnd(m * cols);
    let mut out = vec![0.0f32; m * rows];
    let cpu = || {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec for the call to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
        t.tv_sec as f64 * 1e9 + t.tv_nsec as f64
    };
    qmatmul(&x, ty, &bytes, rows, cols, &mut out);
    // The median of alternating runs, in µs.
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2] / 1e3
    };
    if let Ok(list) = std::env::var("QMATMUL_ROWS_AHEAD") {
        // The row kernels' prefetch distances in the list, alternating product by product
        // (the same bits at every distance).
        let huge = (std::env::var("QMATMUL_HUGE").as_deref() == Ok("1")).then(|| {
            Storage::huge_pages(&[bytes.len()], |_, out| out.copy_from_slice(&bytes)).remove(0)
        });
        let bytes = huge.as_ref().map_or(&bytes[..], |s| s.bytes());
        let times = sweep_distances(
            "QMATMUL_ROWS_AHEAD",
            &list,
            reps,
            prefetch::set_row_bytes_ahead,
            &cpu,
            m * rows,
            &mut |out| qmatmul(&x, ty, bytes, rows, cols, out),
        );
        let times: Vec<String> = times
            .iter()
            .map(|(a, t)| format!("{a} B ahead {t:.1} µs"))
            .collect();
        println!(
            "{ty} {rows}×{cols}, {m} rows, {threads} threads{}, file's rows (this CPU's choice: {} B ahead): {} (medians of {reps}), same bits: true",
            if huge.is_some() { ", huge pages" } else { "" },
            prefetch::row_bytes_ahead(),
            times.join(", ")
        );
        return;
    }
    if std::env::var("QMATMUL_AB").as_deref() == Ok("interleaved") {
        // With QMATMUL_HUGE=1 both layouts sit in huge-page maps (`Storage::huge_pages`, as
        // loads place the interleaved copies); else in ordinary heap buffers.
        let huge = std::env::var("QMATMUL_HUGE").as_deref() == Ok("1");
        let place = |len: usize, fill: &(dyn Fn(&mut [u8]) + Sync)| {
            if huge {
                Storage::huge_pages(&[len], |_, out| fill(out)).remove(0)
            } else {
                Storage::owned(&{
                    let mut v = vec![0u8; len];
                    fill(&mut v);
                    v
                })
            }
        };
        let file_rows = place(bytes.len(), &|out| out.copy_from_slice(&bytes));
        let packed = place(interleaved::interleaved_bytes(rows, cols), &|out| {
            interleaved::interleave_into(&bytes, rows, cols, out)
        });
        let (bytes, packed) = (file_rows.bytes(), packed.bytes());
        let mut other = vec![0.0f32; m * rows];
        if let Ok(list) = std::env::var("QMATMUL_AHEAD") {
            // The records' prefetch distances in the list, alternating product by product on
            // the interleaved copy (the same bits at every distance).
            let times = sweep_distances(
                "QMATMUL_AHEAD",
                &list,
                reps,
                prefetch::set_records_ahead,
                &cpu,
                m * rows,
                &mut |out| {
                    let mut mats = [QMat {
                        ty,
                        bytes: packed,
                        n: rows,
                        out,
                        interleaved: true,
                    }];
                    qmatmul_multi(&x, cols, &mut mats);
                },
            );
            let times: Vec<String> = times
                .iter()
                .map(|(a, t)| format!("{a} ahead {t:.1} µs"))
                .collect();
            println!(
                "{ty} {rows}×{cols}, {m} rows, {threads} threads{}, interleaved (this CPU's choice: {} ahead): {} (medians of {reps}), same bits: true",
                if huge { ", huge pages" } else { "" },
                prefetch::records_ahead(),
                times.join(", ")
            );
            return;
        }
        let mut ns = [Vec::new(), Vec::new()];
        for r in 0..2 * reps {
            let t0 = cpu();
            if r % 2 == 0 {
                let mut mats = [QMat {
                    ty,
                    bytes: packed,
                    n: rows,
                    out: &mut other,
                    interleaved: true,
                }];
                qmatmul_multi(&x, cols, &mut mats);
            } else {
                qmatmul(&x, ty, bytes, rows, cols, &mut out);
            }
            ns[r % 2].push(cpu() - t0);
        }
        let same = out
            .iter()
            .zip(&other)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let (inter, file) = (med(&mut ns[0]), med(&mut ns[1]));
        println!(
            "{ty} {rows}×{cols}, {m} rows, {threads} threads{}: interleaved {inter:.1} µs, file's rows {file:.1} µs (medians of {reps}), ratio {:.2}, same bits: {same}",
            if huge { ", huge pages" } else { "" },
            file / inter
        );
        assert!(same, "the two layouts gave different bits");
        return;
    }
    if std::env::var_os("QMATMUL_AB").is_some() {
        // The tiled prefill kernels against the row kernels, alternating product by product
        // (the same bits; the time of each, robust to a machine whose speed drifts).
        let mut ns = [Vec::new(), Vec::new()];
        for r in 0..2 * reps {
            colibri::tensor::qmatmul::set_tiled_kernels(r % 2 == 0);
            let t0 = cpu();
            qmatmul(&x, ty, &bytes, rows, cols, &mut out);
            ns[r % 2].push(cpu() - t0);
        }
        colibri::tensor::qmatmul::set_tiled_kernels(true);
        let (tiled, rows_k) = (med(&mut ns[0]), med(&mut ns[1]));
        println!(
            "{ty} {rows}×{cols}, {m} rows, {threads} threads: tiled {tiled:.1} µs, row kernels {rows_k:.1} µs (medians of {reps}), ratio {:.2}",
            rows_k / tiled
        );
        return;
    }
    // QMATMUL_HUGE=1: the rows in a huge-page map (as a file mapped with huge folios is).
    let huge = (std::env::var("QMATMUL_HUGE").as_deref() == Ok("1")).then(|| {
        Storage::huge_pages(&[bytes.len()], |_, out| out.copy_from_slice(&bytes)).remove(0)
    });
    let bytes = huge.as_ref().map_or(&bytes[..], |s| s.bytes());
    let t0 = cpu();
    for _ in 0..reps {
        qmatmul(&x, ty, bytes, rows, cols, &mut out);
    }
    let ns = (cpu() - t0) / reps as f64;
    println!(
        "{ty} {rows}×{cols} ({:.2} MiB), {m} rows, {threads} threads: {:.1} µs CPU per product, {:.2} weight bytes per CPU ns ({})",
        bytes.len() as f64 / (1 << 20) as f64,
        ns / 1e3,
        bytes.len() as f64 / ns,
        out[0]
    );
}

/// Times `product` (writing `out_len` results) at each prefetch distance of `list` (the
/// comma-separated value of the variable `var`), distance after distance `reps` times over,
/// with `set` putting each in force (and `None`, the CPU's plan, back at the end); asserts that
/// every product gives the first one's bits. Returns each distance with its median time in µs
/// (`cpu`: CPU nanoseconds).
fn sweep_distances(
    var: &str,
    list: &str,
    reps: usize,
    set: fn(Option<usize>),
    cpu: &dyn Fn() -> f64,
    out_len: usize,
    product: &mut dyn FnMut(&mut [f32]),
) -> Vec<(usize, f64)> {
    let aheads: Vec<usize> = list
        .split(',')
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{var}: whole numbers, comma-separated"))
        })
        .collect();
    let mut ns = vec![Vec::new(); aheads.len()];
    let mut first: Option<Vec<u32>> = None;
    let mut out = vec![0.0f32; out_len];
    for r in 0..reps * aheads.len() {
        set(Some(aheads[r % aheads.len()]));
        let t0 = cpu();
        product(&mut out);
        ns[r % aheads.len()].push(cpu() - t0);
        let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            first.get_or_insert_with(|| bits.clone()),
            &bits,
            "the prefetch distance changed the bits"
        );
    }
    set(None);
    aheads
        .into_iter()
        .zip(ns)
        .map(|(a, mut n)| {
            n.sort_by(f64::total_cmp);
            (a, n[n.len() / 2] / 1e3)
        })
        .collect()
}
