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

fn cuda() -> Option<Arc<dyn Backend>> {
    match device::cuda::CudaBackend::open() {
        Ok(b) => Some(b),
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
            let w = WeightView { rows, cols, data };
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
        // Computed as exact f32 rows on the device, as on the CPU.
        QuantType::Q5_0,
        QuantType::Q5_K,
        QuantType::Q3_K,
    ];
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
