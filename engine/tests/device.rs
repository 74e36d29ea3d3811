//! GPU backends against the CPU: every device kernel must give the CPU's bits, for every
//! weight format, batch size and ragged width. Runs on whatever Vulkan device the machine has
//! (Mesa's lavapipe in CI) and on a CUDA GPU when there is one; says "skipped" and why when
//! there is none.

use std::sync::Arc;

use colibri::tensor::device::{self, Backend, DeviceMatrix};
use colibri::tensor::matmul::matmul;
use colibri::tensor::quant::{quantize_row, QuantType};
use colibri::tensor::{WeightData, WeightView};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            // Magnitudes over several octaves, and exact zeros now and then.
            if i % 97 == 13 {
                0.0
            } else {
                u * (1 << (s >> 61)) as f32
            }
        })
        .collect()
}

fn vulkan() -> Option<Arc<dyn Backend>> {
    match device::vulkan::VulkanBackend::open(false) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped: no Vulkan device ({e})");
            None
        }
    }
}

/// The CUDA device; with `COLI_REQUIRE_CUDA=1` (scripts/gpu-check.sh on a GPU machine) a
/// device that does not open is a failure rather than a skip.
fn cuda() -> Option<Arc<dyn Backend>> {
    match device::cuda::CudaBackend::open() {
        Ok(b) => Some(b),
        Err(e) if std::env::var_os("COLI_REQUIRE_CUDA").is_some_and(|v| v == "1") => {
            panic!("COLI_REQUIRE_CUDA=1 but the CUDA device does not open: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Every format's products on `backend` against `tensor::matmul`, bit for bit.
fn products_match_the_cpu(backend: &Arc<dyn Backend>) {
    let floats: [(usize, usize); 4] = [(1, 1), (5, 31), (9, 64), (33, 100)];
    let blocks: [(usize, usize); 3] = [(1, 256), (7, 512), (18, 768)];
    let ms = [1usize, 2, 3, 4, 5, 8, 13];
    let mut checked = 0;
    for (seed, &(rows, cols)) in floats.iter().enumerate() {
        let v = values(rows * cols, seed as u64);
        let bf: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let hf: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
        for data in [
            WeightData::F32(&v),
            WeightData::BF16(&bf),
            WeightData::F16(&hf),
        ] {
            let w = WeightView {
                rows,
                cols,
                data,
                interleaved: None,
            };
            checked += compare(backend, &w, &ms, seed as u64);
        }
    }
    let types = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q4_K,
        QuantType::Q6_K,
        QuantType::MXFP4,
    ];
    // Computed by integer kernels on the CPU and by none on a device: never placed.
    for ty in [
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q2_K,
        QuantType::Q3_K,
        QuantType::Q5_K,
    ] {
        let mut bytes = Vec::new();
        quantize_row(ty, &values(256, 99), &mut bytes).unwrap();
        let w = WeightView {
            rows: 1,
            cols: 256,
            data: WeightData::Quant(ty, &bytes),
            interleaved: None,
        };
        assert!(
            !device::placeable(&w) && device::device_form(&w).is_none(),
            "{ty}"
        );
        let err = DeviceMatrix::upload(backend, &w).unwrap_err().to_string();
        assert!(err.contains("stay on the CPU"), "{ty}: {err}");
    }
    for ty in types {
        for (seed, &(rows, cols)) in blocks.iter().enumerate() {
            let v = values(rows * cols, 100 + seed as u64);
            let mut bytes = Vec::new();
            for r in v.chunks(cols) {
                quantize_row(ty, r, &mut bytes).unwrap();
            }
            let w = WeightView {
                rows,
                cols,
                data: WeightData::Quant(ty, &bytes),
                interleaved: None,
            };
            checked += compare(backend, &w, &ms, 7 + seed as u64);
        }
    }
    assert!(checked > 1000, "only {checked} outputs compared");
}

fn compare(backend: &Arc<dyn Backend>, w: &WeightView<'_>, ms: &[usize], seed: u64) -> usize {
    let on_device = DeviceMatrix::upload(backend, w).unwrap();
    let mut n = 0;
    for &m in ms {
        let x = values(m * w.cols, seed * 31 + m as u64);
        let mut want = vec![0f32; m * w.rows];
        matmul(&x, w, &mut want);
        let mut got = vec![0f32; m * w.rows];
        on_device.matmul(&x, &mut got).unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{:?} {}×{} weights, {m} rows: output {i} is {a:e} on {}, {b:e} on the CPU",
                w.dtype(),
                w.rows,
                w.cols,
                backend.name()
            );
        }
        n += want.len();
    }
    n
}

#[test]
fn vulkan_products_have_the_cpu_bits() {
    let Some(b) = vulkan() else { return };
    eprintln!("vulkan device: {}", b.name());
    device::verify(&*b).unwrap();
    products_match_the_cpu(&b);
    let s = b.stats();
    assert!(s.products > 0 && s.upload_bytes > 0, "{s:?}");
}

#[test]
fn cuda_products_have_the_cpu_bits() {
    let Some(b) = cuda() else { return };
    eprintln!("cuda device: {}", b.name());
    device::verify(&*b).unwrap();
    products_match_the_cpu(&b);
}

#[test]
fn committed_spirv_is_what_the_shader_source_compiles_to() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if std::process::Command::new("glslangValidator")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: glslangValidator is not installed (Debian: glslang-tools)");
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("bash")
        .arg(root.join("scripts/build-shaders.sh"))
        .arg(out.path())
        .status()
        .unwrap();
    assert!(status.success(), "scripts/build-shaders.sh failed");
    let committed = root.join("engine/src/tensor/device/shaders");
    let mut n = 0;
    for entry in std::fs::read_dir(out.path()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        let fresh = std::fs::read(&path).unwrap();
        let kept = std::fs::read(committed.join(name)).unwrap();
        assert!(
            fresh == kept,
            "{name:?} is stale: run scripts/build-shaders.sh and commit the result"
        );
        n += 1;
    }
    assert_eq!(n, 13, "nine formats and four exact-fma float kernels");
}

/// The CUDA kernels' arithmetic against the CPU without a GPU: `cuda/matmul.cu` compiled for
/// the host by `tests/cuda_emu/emu.cpp` (a thread per lane, the intrinsics as the IEEE operations
/// they name), fed the bytes `device_form` places and activations in the layout `cuda.rs`
/// uploads (vulkan.rs `pack_acts`), must give the bits `tensor::matmul` gives. Skipped without a
/// C++17 compiler (`c++`, or `$CXX`).
#[test]
fn cuda_kernels_emulated_on_the_host_have_the_cpu_bits() {
    use colibri::tensor::qmatmul::{act_format, QuantizedActs};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if std::process::Command::new(&cxx)
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: no C++ compiler (`{cxx}`) to run the CUDA kernels on the host");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let emu = dir.path().join("emu");
    let built = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-ffp-contract=off", "-pthread", "-o"])
        .arg(&emu)
        .arg(root.join("tests/cuda_emu/emu.cpp"))
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "compiling tests/cuda_emu/emu.cpp failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let run = |format: usize,
               m: usize,
               n: usize,
               k: usize,
               row_bytes: usize,
               offs: [u32; 4],
               w: &[u8],
               xs: &[u8]| {
        let mut input = Vec::new();
        let header = [
            format as u32,
            m as u32,
            n as u32,
            k as u32,
            row_bytes as u32,
        ];
        for v in header
            .iter()
            .chain(&offs)
            .chain(&[w.len() as u32, xs.len() as u32])
        {
            input.extend_from_slice(&v.to_le_bytes());
        }
        input.extend_from_slice(w);
        input.extend_from_slice(xs);
        let mut child = std::process::Command::new(&emu)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&input).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "the emulated kernel failed");
        assert_eq!(out.stdout.len(), 4 * m * n);
        out.stdout
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect::<Vec<f32>>()
    };
    // The upload layout of `cuda.rs` (vulkan.rs `pack_quant`): codes padded to whole words,
    // then the scales, Q8_1 sums, Q8_K 16-sums and 32-sums, at word offsets.
    let pack = |q: &QuantizedActs| {
        let mut bytes: Vec<u8> = q.qs.iter().map(|&c| c as u8).collect();
        bytes.resize(bytes.len().next_multiple_of(4), 0);
        let mut offs = [0u32; 4];
        let words = [
            q.d.iter().map(|v| v.to_bits()).collect::<Vec<u32>>(),
            q.sums.iter().map(|v| v.to_bits()).collect(),
            q.bsums.iter().map(|&v| v as u32).collect(),
            q.pairs.iter().map(|&v| v as u32).collect(),
        ];
        for (slot, w) in words.iter().enumerate() {
            if slot == 0 || !w.is_empty() {
                offs[slot] = (bytes.len() / 4) as u32;
                for v in w {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        (bytes, offs)
    };
    let mut views: Vec<(Vec<u8>, Option<QuantType>, usize, usize)> = Vec::new();
    for (seed, &(rows, cols)) in [(5usize, 31usize), (9, 64), (6, 100)].iter().enumerate() {
        let v = values(rows * cols, seed as u64);
        views.push((bytemuck_f32(&v), None, rows, cols));
    }
    for (seed, ty) in [
        QuantType::MXFP4,
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q4_K,
        QuantType::Q6_K,
    ]
    .into_iter()
    .enumerate()
    {
        // Ten 32-blocks (lanes with two blocks and with one), two super-blocks.
        let (rows, cols) = match ty {
            QuantType::Q4_K | QuantType::Q6_K => (5, 512),
            _ => (6, 320),
        };
        let mut bytes = Vec::new();
        for r in values(rows * cols, 50 + seed as u64).chunks(cols) {
            quantize_row(ty, r, &mut bytes).unwrap();
        }
        views.push((bytes, Some(ty), rows, cols));
    }
    let mut checked = 0;
    for (bytes, ty, rows, cols) in &views {
        let v: Vec<f32>;
        let bf: Vec<half::bf16>;
        let hf: Vec<half::f16>;
        let datas: Vec<WeightData<'_>> = match ty {
            Some(t) => vec![WeightData::Quant(*t, bytes)],
            None => {
                v = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                bf = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
                hf = v.iter().map(|&x| half::f16::from_f32(x)).collect();
                vec![
                    WeightData::F32(&v),
                    WeightData::BF16(&bf),
                    WeightData::F16(&hf),
                ]
            }
        };
        for data in datas {
            let w = WeightView {
                rows: *rows,
                cols: *cols,
                data,
                interleaved: None,
            };
            let (format, placed) = device::device_form(&w).expect("a device format");
            for m in [1usize, 3, 5, 8] {
                let x = values(m * cols, 7 + m as u64);
                let mut want = vec![0f32; m * rows];
                matmul(&x, &w, &mut want);
                let quant = format
                    .quant_type()
                    .and_then(act_format)
                    .map(|a| QuantizedActs::quantize(a, &x, *cols));
                let (xs, offs) = match &quant {
                    Some(q) => pack(q),
                    None => (bytemuck_f32(&x), [0; 4]),
                };
                let got = run(
                    format.index(),
                    m,
                    *rows,
                    *cols,
                    placed.len() / rows,
                    offs,
                    &placed,
                    &xs,
                );
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{format:?} {rows}×{cols}, {m} rows: output {i} is {a:e} emulated, {b:e} on the CPU"
                    );
                }
                checked += want.len();
            }
        }
    }
    assert!(checked > 300, "only {checked} outputs compared");
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
