//! The CUDA kernels' PTX (`src/tensor/device/cuda/matmul.cu` → `$OUT_DIR/matmul.ptx`, which
//! `tensor::device::cuda` embeds).
//!
//! With nvcc (`$NVCC`, else `nvcc` on `PATH`, else `/usr/local/cuda/bin/nvcc`, else the PyPI
//! packages' `nvidia/cuda_nvcc/bin/nvcc` or `nvidia/cu13/bin/nvcc` under python3's
//! site-packages) the source is compiled here (a failure of `$NVCC` fails the build; one of an
//! nvcc found by looking is a warning, and the committed PTX is used). Without, the committed
//! `matmul.ptx` next to it is used. Only `$NVCC` and the sources trigger a rerun: an nvcc
//! installed later is seen after `cargo clean -p colibri-engine`. Either way the committed PTX must carry the sha256 of the `.cu` on its first line
//! (`// source-sha256: …`, written by `scripts/build-ptx.sh`): the build fails when it does
//! not, so the committed PTX can never fall silently behind its source.

use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE: &str = "src/tensor/device/cuda/matmul.cu";
const COMMITTED: &str = "src/tensor/device/cuda/matmul.ptx";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed={COMMITTED}");
    println!("cargo:rerun-if-env-changed=NVCC");

    let source = std::fs::read(SOURCE).unwrap_or_else(|e| panic!("reading {SOURCE}: {e}"));
    let committed =
        std::fs::read_to_string(COMMITTED).unwrap_or_else(|e| panic!("reading {COMMITTED}: {e}"));
    let want = hex(&sha256(&source));
    let recorded = committed
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("// source-sha256: "))
        .map(str::trim);
    if recorded != Some(want.as_str()) {
        panic!(
            "{COMMITTED} was not made from the current {SOURCE} (its first line records source \
             sha256 {}, the source's is {want}); run scripts/build-ptx.sh and commit the PTX",
            recorded.unwrap_or("<none>")
        );
    }

    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target = out.join("matmul.ptx");
    if let Some((nvcc, explicit)) = find_nvcc() {
        match compile(&nvcc, &target) {
            Ok(()) => return,
            // `$NVCC` was asked for: its failure is the build's.
            Err(e) if explicit => panic!("{e}; unset NVCC to build with the committed PTX"),
            // An nvcc found by looking (one whose host compiler it refuses, say): the committed
            // PTX is the same source.
            Err(e) => println!("cargo:warning={e}; using the committed {COMMITTED}"),
        }
    }
    std::fs::write(&target, &committed).expect("writing the PTX to OUT_DIR");
}

/// Compile the kernels with `nvcc` into `target`: PTX for the oldest architecture that nvcc
/// still takes (compute_70 up to CUDA 12, compute_75 from CUDA 13), no contraction into fused
/// multiply-adds, denormals kept (never --use_fast_math or -ftz=true).
fn compile(nvcc: &Path, target: &Path) -> Result<(), String> {
    let release = nvcc_release(nvcc);
    let arch = if release.is_some_and(|r| r >= 13) {
        "compute_75"
    } else {
        "compute_70"
    };
    let status = Command::new(nvcc)
        .args([
            "--ptx",
            "-fmad=false",
            "-ftz=false",
            "-prec-div=true",
            "-prec-sqrt=true",
        ])
        .arg(format!("-arch={arch}"))
        .arg("-O3")
        .arg(SOURCE)
        .arg("-o")
        .arg(target)
        .status()
        .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
    if !status.success() {
        return Err(format!(
            "{} --ptx {SOURCE} failed ({status})",
            nvcc.display()
        ));
    }
    Ok(())
}

/// The major release of `nvcc --version` ("Cuda compilation tools, release 12.8, …").
fn nvcc_release(nvcc: &Path) -> Option<u32> {
    let out = Command::new(nvcc).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rest = text.split("release ").nth(1)?;
    rest.split('.').next()?.trim().parse().ok()
}

/// Where nvcc is, if anywhere, and whether `$NVCC` named it.
fn find_nvcc() -> Option<(PathBuf, bool)> {
    if let Some(p) = std::env::var_os("NVCC").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if runs(&p) {
            return Some((p, true));
        }
        panic!("NVCC={} does not run (`--version` failed)", p.display());
    }
    let mut candidates = vec![
        PathBuf::from("nvcc"),
        PathBuf::from("/usr/local/cuda/bin/nvcc"),
    ];
    for dir in site_packages() {
        candidates.push(dir.join("nvidia/cuda_nvcc/bin/nvcc"));
        candidates.push(dir.join("nvidia/cu13/bin/nvcc"));
    }
    candidates.into_iter().find(|p| runs(p)).map(|p| (p, false))
}

fn runs(nvcc: &Path) -> bool {
    Command::new(nvcc)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// python3's site-packages directories (none without python3).
fn site_packages() -> Vec<PathBuf> {
    let Ok(out) = Command::new("python3")
        .args([
            "-c",
            "import site, sys; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))",
        ])
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(PathBuf::from)
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 (FIPS 180-4).
fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (s, v) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *s = s.wrapping_add(v);
        }
    }
    let mut out = [0u8; 32];
    for (o, v) in out.chunks_exact_mut(4).zip(h) {
        o.copy_from_slice(&v.to_be_bytes());
    }
    out
}
