//! Compute devices (GPUs): more places to compute `y = x·Wᵀ`, with the CPU's arithmetic.
//!
//! A [`Backend`] ([`vulkan`] through `ash`, [`cuda`] through `cudarc`) holds weight matrices in
//! its memory and computes products with them in the canonical order the CPU kernels define
//! (`tensor::kernels` for f32/bf16/f16/MXFP4 rows: 32 lanes by fused multiply-add, a
//! zero-padded tail, the fixed fold tree; `tensor::qmatmul` for Q8_0/Q4_0/Q4_1/Q4_K/Q6_K:
//! exact integer block sums against the activation codes the CPU quantized, then the same
//! scaled-sum order). So a product on a device gives the very bits the CPU gives, and which
//! matrices sit on the device can never change a token.
//!
//! What a device computes: matrix products with weights placed on it ([`DeviceMatrix`]); the
//! activations are quantized on the CPU by the CPU's own code and uploaded with each product.
//! FP8 with block scales, which the CPU computes from exactly dequantized f32 rows, is
//! dequantized when placed and computed as f32 rows there too. The block formats the CPU
//! computes by integer kernels that no device has yet (Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q5_K,
//! IQ4_XS) are never placed ([`placeable`]): as f32 rows on a device they would give other
//! bits than the CPU's integer dots, so those matrices — and routed experts with one of them —
//! stay on the CPU even with a GPU. Norms, RoPE, attention, activations and routing run on the
//! CPU.
//!
//! [`verify`] runs every kernel of a freshly opened backend against the CPU on test values
//! and refuses the device if any bit differs (a driver that does not fuse `fma`, say).

pub mod cuda;
pub mod vulkan;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::qmatmul::{act_format, QuantizedActs};
use super::quant::{quantize_row, QuantType};
use super::{WeightData, WeightView};
use crate::{Error, Result};

/// Which device a command computes on (`--device`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum DeviceChoice {
    /// The CPU only (the engine's default; `coli`'s is `auto`).
    #[default]
    Cpu,
    /// A CUDA GPU if the driver finds one, else a Vulkan GPU (not a software rasterizer such
    /// as lavapipe), else the CPU.
    Auto,
    /// The best Vulkan device (discrete, then integrated, then virtual, then CPU devices such
    /// as Mesa's lavapipe); an error if there is none.
    Vulkan,
    /// The first CUDA GPU; an error if there is no CUDA driver or GPU.
    Cuda,
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Auto => "auto",
            DeviceChoice::Vulkan => "vulkan",
            DeviceChoice::Cuda => "cuda",
        })
    }
}

/// The API a backend drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceApi {
    Vulkan,
    Cuda,
}

impl std::fmt::Display for DeviceApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceApi::Vulkan => "vulkan",
            DeviceApi::Cuda => "cuda",
        })
    }
}

/// How a matrix placed on a device is stored and computed there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceFormat {
    F32,
    BF16,
    F16,
    Mxfp4,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4K,
    Q6K,
}

impl DeviceFormat {
    /// Every format, in the shader numbering (`shaders/matmul.comp`'s `FORMAT`).
    pub const ALL: [DeviceFormat; 9] = [
        DeviceFormat::F32,
        DeviceFormat::BF16,
        DeviceFormat::F16,
        DeviceFormat::Mxfp4,
        DeviceFormat::Q8_0,
        DeviceFormat::Q4_0,
        DeviceFormat::Q4_1,
        DeviceFormat::Q4K,
        DeviceFormat::Q6K,
    ];

    /// The kernel number in the shader sources.
    pub fn index(self) -> usize {
        DeviceFormat::ALL
            .iter()
            .position(|&f| f == self)
            .expect("in ALL")
    }

    /// The ggml block type of an integer-kernel format.
    pub fn quant_type(self) -> Option<QuantType> {
        Some(match self {
            DeviceFormat::Q8_0 => QuantType::Q8_0,
            DeviceFormat::Q4_0 => QuantType::Q4_0,
            DeviceFormat::Q4_1 => QuantType::Q4_1,
            DeviceFormat::Q4K => QuantType::Q4_K,
            DeviceFormat::Q6K => QuantType::Q6_K,
            DeviceFormat::Mxfp4 => QuantType::MXFP4,
            _ => return None,
        })
    }

    /// Whether the kernel takes f32 activation rows (else codes quantized on the CPU).
    pub fn takes_f32(self) -> bool {
        matches!(
            self,
            DeviceFormat::F32 | DeviceFormat::BF16 | DeviceFormat::F16 | DeviceFormat::Mxfp4
        )
    }
}

/// Bytes of memory on a device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device-local heap.
    pub total: u64,
    /// What the driver says is free now (the heap size where it cannot say).
    pub free: u64,
}

/// What a backend has done so far (cumulative).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceStats {
    /// Bytes uploaded into matrices.
    pub upload_bytes: u64,
    /// Seconds spent uploading them.
    pub upload_seconds: f64,
    /// Matrix products computed.
    pub products: u64,
    /// Seconds of products, seen from the host (uploads of activations, the kernel, the
    /// read-back).
    pub product_seconds: f64,
    /// Seconds the kernels ran on the device, by its timestamps (0 where it has none).
    pub kernel_seconds: f64,
    /// Bytes of matrices held now.
    pub resident_bytes: u64,
}

/// Cumulative counters a backend updates (shared by both backends).
#[derive(Debug, Default)]
pub struct StatCounters {
    upload_bytes: AtomicU64,
    upload_ns: AtomicU64,
    products: AtomicU64,
    product_ns: AtomicU64,
    kernel_ns: AtomicU64,
    resident_bytes: AtomicU64,
}

impl StatCounters {
    /// Count an upload of `bytes` that started at `since`.
    pub fn uploaded(&self, bytes: u64, since: Instant) {
        self.upload_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.upload_ns
            .fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.resident_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Count a matrix of `bytes` freed.
    pub fn freed(&self, bytes: u64) {
        self.resident_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Count a product that started at `since` and ran `kernel_ns` on the device.
    pub fn computed(&self, since: Instant, kernel_ns: u64) {
        self.products.fetch_add(1, Ordering::Relaxed);
        self.product_ns
            .fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.kernel_ns.fetch_add(kernel_ns, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> DeviceStats {
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e9;
        DeviceStats {
            upload_bytes: self.upload_bytes.load(Ordering::Relaxed),
            upload_seconds: s(&self.upload_ns),
            products: self.products.load(Ordering::Relaxed),
            product_seconds: s(&self.product_ns),
            kernel_seconds: s(&self.kernel_ns),
            resident_bytes: self.resident_bytes.load(Ordering::Relaxed),
        }
    }
}

/// The activations of one product as a device takes them.
#[derive(Clone, Copy)]
pub enum Acts<'a> {
    /// f32 rows (`m × k`).
    F32(&'a [f32]),
    /// Rows quantized by the CPU's [`QuantizedActs::quantize`].
    Quant(&'a QuantizedActs),
}

/// A handle to a buffer a backend allocated.
pub type BufferId = u64;

/// A GPU backend: memory for matrices and the product kernels.
pub trait Backend: Send + Sync {
    /// The API it drives.
    fn api(&self) -> DeviceApi;
    /// The device's name as its driver gives it.
    fn name(&self) -> &str;
    /// Device memory now.
    fn memory(&self) -> DeviceMemory;
    /// The largest matrix (bytes) one kernel can address; bigger ones stay on the CPU.
    fn max_matrix_bytes(&self) -> u64;
    /// Copy `bytes` into a new device buffer.
    fn upload(&self, bytes: &[u8]) -> Result<BufferId>;
    /// Free a buffer from [`Backend::upload`].
    fn free(&self, id: BufferId);
    /// `out[i·n + j] = Σ_k x[i, k] · W[j, k]` for the `n × k` matrix in `w` stored as
    /// `format` (`row_bytes` per row), computed in the CPU's canonical order.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        w: BufferId,
        format: DeviceFormat,
        n: usize,
        k: usize,
        row_bytes: usize,
        acts: Acts<'_>,
        m: usize,
        out: &mut [f32],
    ) -> Result<()>;
    /// What it has done so far.
    fn stats(&self) -> DeviceStats;
}

/// A matrix placed on a device. Freed there when dropped.
pub struct DeviceMatrix {
    backend: Arc<dyn Backend>,
    buffer: BufferId,
    /// Output features (rows of `W`).
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// How it is stored and computed there.
    pub format: DeviceFormat,
    /// Bytes of one row there.
    pub row_bytes: usize,
    /// Bytes it takes on the device.
    pub bytes: u64,
}

impl std::fmt::Debug for DeviceMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceMatrix({}×{} {:?} on {})",
            self.rows,
            self.cols,
            self.format,
            self.backend.name()
        )
    }
}

impl Drop for DeviceMatrix {
    fn drop(&mut self) {
        self.backend.free(self.buffer);
    }
}

/// The device kernel of a ggml block type, if a device has one.
fn native_format(q: QuantType) -> Option<DeviceFormat> {
    Some(match q {
        QuantType::Q8_0 => DeviceFormat::Q8_0,
        QuantType::Q4_0 => DeviceFormat::Q4_0,
        QuantType::Q4_1 => DeviceFormat::Q4_1,
        QuantType::Q4_K => DeviceFormat::Q4K,
        QuantType::Q6_K => DeviceFormat::Q6K,
        QuantType::MXFP4 => DeviceFormat::Mxfp4,
        _ => return None,
    })
}

/// Whether a device can compute products with `w` with the CPU's bits. Not for the block
/// formats the CPU computes by an integer kernel that no device has (Q5_0, Q5_1, IQ4_NL,
/// Q2_K, Q3_K, Q5_K, IQ4_XS): as f32 rows on a device they would give other bits than the
/// CPU's integer dots, so they stay on the CPU.
pub fn placeable(w: &WeightView<'_>) -> bool {
    match w.data {
        WeightData::Quant(q, _) => native_format(q).is_some() || act_format(q).is_none(),
        _ => true,
    }
}

/// The bytes and format a weight matrix takes on a device: float and integer-kernel formats
/// as they are; FP8 with block scales (and any block format the CPU computes by
/// dequantizing) dequantized exactly to f32, the values the CPU computes it from. `None` for
/// a matrix that is not [`placeable`].
pub fn device_form<'a>(w: &WeightView<'a>) -> Option<(DeviceFormat, std::borrow::Cow<'a, [u8]>)> {
    use std::borrow::Cow;
    if !placeable(w) {
        return None;
    }
    Some(match w.data {
        WeightData::F32(d) => (DeviceFormat::F32, Cow::Borrowed(bytemuck::cast_slice(d))),
        WeightData::BF16(d) => (DeviceFormat::BF16, Cow::Borrowed(bytemuck::cast_slice(d))),
        WeightData::F16(d) => (DeviceFormat::F16, Cow::Borrowed(bytemuck::cast_slice(d))),
        WeightData::Quant(q, b) => match native_format(q) {
            Some(f) => (f, Cow::Owned(b.to_vec())),
            None => (DeviceFormat::F32, Cow::Owned(dequantized(w))),
        },
        WeightData::F8Block { .. } => (DeviceFormat::F32, Cow::Owned(dequantized(w))),
    })
}

/// The matrix as f32 bytes, row by row through the CPU's own dequantization.
fn dequantized(w: &WeightView<'_>) -> Vec<u8> {
    let mut out = vec![0f32; w.rows * w.cols];
    for (r, row) in out.chunks_mut(w.cols.max(1)).enumerate() {
        w.row_to_f32(r, row);
    }
    bytemuck::cast_slice(&out).to_vec()
}

/// The bytes `view` would take on a device.
pub fn device_bytes(view: &WeightView<'_>) -> u64 {
    match view.data {
        WeightData::Quant(q, b) if native_format(q).is_some() => b.len() as u64,
        WeightData::F32(d) => 4 * d.len() as u64,
        WeightData::BF16(d) => 2 * d.len() as u64,
        WeightData::F16(d) => 2 * d.len() as u64,
        _ => 4 * (view.rows * view.cols) as u64,
    }
}

impl DeviceMatrix {
    /// Place `view` on `backend`.
    pub fn upload(backend: &Arc<dyn Backend>, view: &WeightView<'_>) -> Result<DeviceMatrix> {
        let Some((format, bytes)) = device_form(view) else {
            return Err(Error::Unsupported(format!(
                "{} weights stay on the CPU: no {} kernel computes them with the CPU's bits",
                view.dtype(),
                backend.api()
            )));
        };
        if bytes.len() as u64 > backend.max_matrix_bytes() {
            return Err(Error::Unsupported(format!(
                "a {}×{} matrix ({} bytes) is larger than one {} buffer may be ({} bytes)",
                view.rows,
                view.cols,
                bytes.len(),
                backend.name(),
                backend.max_matrix_bytes()
            )));
        }
        let buffer = backend.upload(&bytes)?;
        Ok(DeviceMatrix {
            backend: backend.clone(),
            buffer,
            rows: view.rows,
            cols: view.cols,
            format,
            row_bytes: bytes.len() / view.rows.max(1),
            bytes: bytes.len() as u64,
        })
    }

    /// The backend it lives on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// `y = x·Wᵀ` for `x.len() / cols` rows: the bits `tensor::matmul::matmul` gives.
    pub fn matmul(&self, x: &[f32], out: &mut [f32]) -> Result<()> {
        let acts = self.activations(x);
        self.matmul_prepared(x, acts.as_ref(), out)
    }

    /// The quantized activations this matrix's kernel takes (`None`: f32 rows).
    pub fn activations(&self, x: &[f32]) -> Option<QuantizedActs> {
        let ty = self.format.quant_type()?;
        act_format(ty).map(|f| QuantizedActs::quantize(f, x, self.cols))
    }

    /// [`DeviceMatrix::matmul`] with activations already quantized for this format (an
    /// expert's gate and up share them).
    pub fn matmul_prepared(
        &self,
        x: &[f32],
        acts: Option<&QuantizedActs>,
        out: &mut [f32],
    ) -> Result<()> {
        assert!(
            self.cols > 0 && x.len().is_multiple_of(self.cols),
            "device matmul: x is not a whole number of rows"
        );
        let m = x.len() / self.cols;
        assert_eq!(out.len(), m * self.rows, "device matmul: output size");
        if m == 0 || self.rows == 0 {
            return Ok(());
        }
        let acts = match acts {
            Some(a) => Acts::Quant(a),
            None => Acts::F32(x),
        };
        self.backend.matmul(
            self.buffer,
            self.format,
            self.rows,
            self.cols,
            self.row_bytes,
            acts,
            m,
            out,
        )
    }
}

/// Open the device `choice` names: `Ok(None)` for the CPU (and for `auto` where no GPU is
/// found, saying why in the log); an error naming the problem when an explicit choice
/// cannot be opened or fails [`verify`] (every backend's `open` verifies its kernels).
pub fn open(choice: DeviceChoice) -> Result<Option<Arc<dyn Backend>>> {
    // One backend per choice per process: later loads share it (and its verified kernels).
    type Opened = Vec<(DeviceChoice, Option<Arc<dyn Backend>>)>;
    static OPENED: std::sync::Mutex<Opened> = std::sync::Mutex::new(Vec::new());
    if choice == DeviceChoice::Cpu {
        return Ok(None);
    }
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, b)) = opened.iter().find(|(c, _)| *c == choice) {
        return Ok(b.clone());
    }
    let b = open_uncached(choice)?;
    opened.push((choice, b.clone()));
    Ok(b)
}

/// The default VRAM budget: the device's free memory less a tenth of it (at least 512 MiB)
/// for the driver, activations and other processes.
pub fn default_vram_budget(backend: &dyn Backend) -> u64 {
    let free = backend.memory().free;
    free.saturating_sub((free / 10).max(512 << 20))
}

fn open_uncached(choice: DeviceChoice) -> Result<Option<Arc<dyn Backend>>> {
    // Each backend's `open` runs [`verify`] before it returns.
    match choice {
        DeviceChoice::Cpu => Ok(None),
        DeviceChoice::Vulkan => Ok(Some(vulkan::VulkanBackend::open(false)?)),
        DeviceChoice::Cuda => Ok(Some(cuda::CudaBackend::open()?)),
        DeviceChoice::Auto => {
            match cuda::CudaBackend::open() {
                Ok(b) => return Ok(Some(b)),
                Err(e) => tracing::info!("device auto: no CUDA ({e})"),
            }
            match vulkan::VulkanBackend::open(true) {
                Ok(b) => return Ok(Some(b)),
                Err(e) => tracing::info!("device auto: no Vulkan GPU ({e})"),
            }
            tracing::info!("device auto: computing on the CPU");
            Ok(None)
        }
    }
}

/// Check every kernel of `backend` against the CPU on test values (ragged widths, several
/// rows): any differing bit refuses the device, naming the format.
pub fn verify(backend: &dyn Backend) -> Result<()> {
    for probe in probe_matrices() {
        let w = probe.view();
        let Some((format, bytes)) = device_form(&w) else {
            continue;
        };
        let (rows, cols) = (w.rows, w.cols);
        for m in [1usize, 3, 5] {
            let x = super::test_values::xorshift(m * cols, 11 + m as u32);
            let mut want = vec![0f32; m * rows];
            super::matmul::matmul(&x, &w, &mut want);
            let acts = format
                .quant_type()
                .and_then(act_format)
                .map(|a| QuantizedActs::quantize(a, &x, cols));
            let id = backend.upload(&bytes)?;
            let mut got = vec![0f32; m * rows];
            let acts_ref = match &acts {
                Some(a) => Acts::Quant(a),
                None => Acts::F32(&x),
            };
            let res = backend.matmul(
                id,
                format,
                rows,
                cols,
                bytes.len() / rows,
                acts_ref,
                m,
                &mut got,
            );
            backend.free(id);
            res?;
            if let Some(i) = (0..want.len()).find(|&i| want[i].to_bits() != got[i].to_bits()) {
                return Err(Error::Unsupported(format!(
                    "{} device `{}` does not compute {format:?} products with the CPU's bits \
                     (output {i} of a {m}×{cols} · {cols}×{rows} product: {:e} on the device, \
                     {:e} on the CPU); --device cpu keeps tokens exact",
                    backend.api(),
                    backend.name(),
                    got[i],
                    want[i]
                )));
            }
        }
    }
    Ok(())
}

/// A test matrix for [`verify`].
enum Probe {
    F32(Vec<f32>, usize),
    BF16(Vec<half::bf16>, usize),
    F16(Vec<half::f16>, usize),
    Quant(QuantType, Vec<u8>, usize, usize),
}

impl Probe {
    fn view(&self) -> WeightView<'_> {
        let (rows, cols, data) = match self {
            Probe::F32(v, c) => (v.len() / c, *c, WeightData::F32(v)),
            Probe::BF16(v, c) => (v.len() / c, *c, WeightData::BF16(v)),
            Probe::F16(v, c) => (v.len() / c, *c, WeightData::F16(v)),
            Probe::Quant(q, b, r, c) => (*r, *c, WeightData::Quant(*q, b)),
        };
        WeightView {
            rows,
            cols,
            data,
            interleaved: None,
        }
    }
}

/// One matrix per device format, ragged widths for the float formats.
fn probe_matrices() -> Vec<Probe> {
    let values = |n: usize, seed: u32| super::test_values::xorshift(n, seed);
    let mut out = vec![
        Probe::F32(values(7 * 77, 1), 77),
        Probe::BF16(
            values(7 * 77, 2)
                .into_iter()
                .map(half::bf16::from_f32)
                .collect(),
            77,
        ),
        Probe::F16(
            values(7 * 77, 3)
                .into_iter()
                .map(half::f16::from_f32)
                .collect(),
            77,
        ),
    ];
    for (seed, (ty, rows, cols)) in [
        (QuantType::MXFP4, 6, 320),
        (QuantType::Q8_0, 6, 320),
        (QuantType::Q4_0, 6, 320),
        (QuantType::Q4_1, 6, 320),
        (QuantType::Q4_K, 5, 512),
        (QuantType::Q6_K, 5, 512),
    ]
    .into_iter()
    .enumerate()
    {
        let mut bytes = Vec::new();
        for row in values(rows * cols, 10 + seed as u32).chunks(cols) {
            quantize_row(ty, row, &mut bytes).expect("whole blocks");
        }
        out.push(Probe::Quant(ty, bytes, rows, cols));
    }
    out
}

/// Where a model's matrices may go on a device while it loads: the backend and the bytes of
/// device memory left to fill (dense matrices first, then routed experts).
#[derive(Clone)]
pub struct DevicePlacement {
    backend: Arc<dyn Backend>,
    left: Arc<AtomicU64>,
    budget: u64,
    after_load: Arc<std::sync::Mutex<Vec<AfterLoad>>>,
}

/// Work to run once a model has loaded (filling a VRAM tier).
pub type AfterLoad = Box<dyn FnOnce() -> Result<()> + Send>;

impl std::fmt::Debug for DevicePlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevicePlacement({} `{}`, {} of {} bytes left)",
            self.backend.api(),
            self.backend.name(),
            self.left(),
            self.budget
        )
    }
}

impl DevicePlacement {
    /// Up to `budget` bytes of `backend`'s memory.
    pub fn new(backend: Arc<dyn Backend>, budget: u64) -> DevicePlacement {
        DevicePlacement {
            backend,
            left: Arc::new(AtomicU64::new(budget)),
            budget,
            after_load: Arc::default(),
        }
    }

    /// Run `f` when the model has loaded ([`DevicePlacement::finish_load`]), after every
    /// dense matrix was placed.
    pub fn after_load(&self, f: AfterLoad) {
        self.after_load
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(f);
    }

    /// The model has loaded: run what waited for it, in order.
    pub fn finish_load(&self) -> Result<()> {
        let work = std::mem::take(&mut *self.after_load.lock().unwrap_or_else(|p| p.into_inner()));
        for f in work {
            f()?;
        }
        Ok(())
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The budget it started with.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of the budget not yet taken.
    pub fn left(&self) -> u64 {
        self.left.load(Ordering::Relaxed)
    }

    /// Take `bytes` of the budget if that many are left.
    fn take(&self, bytes: u64) -> bool {
        self.left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                l.checked_sub(bytes)
            })
            .is_ok()
    }

    /// Give back `bytes` taken by [`DevicePlacement::take`] (an upload that failed).
    fn give_back(&self, bytes: u64) {
        self.left.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Whether [`DevicePlacement::place`] may put `t` on the device, budget aside: a matrix
    /// not there yet whose format the device computes with the CPU's bits ([`placeable`]).
    pub fn can_place(&self, t: &super::Tensor) -> bool {
        t.device.is_none()
            && t.shape.len() == 2
            && t.dtype.is_matrix()
            && t.view().is_ok_and(|v| placeable(&v))
    }

    /// Put a matrix tensor on the device if the budget has room for it and the device can
    /// hold it; `keep_host` keeps its bytes in host memory too (dense weights, which some
    /// layers also read directly), else the returned tensor has only the device copy.
    /// `None` (the tensor stays on the CPU) when it does not fit, is not a matrix, is not
    /// [`placeable`], or the upload fails (logged).
    pub fn place(&self, t: &super::Tensor, keep_host: bool) -> Option<super::Tensor> {
        if !self.can_place(t) {
            return None;
        }
        let view = t.view().ok()?;
        let bytes = device_bytes(&view);
        if bytes > self.backend.max_matrix_bytes() || !self.take(bytes) {
            return None;
        }
        match DeviceMatrix::upload(&self.backend, &view) {
            Ok(m) => {
                let mut placed = t.clone();
                placed.device = Some(Arc::new(m));
                if !keep_host {
                    placed.storage = super::Storage::owned(&[]);
                    placed.block_scales = None;
                }
                Some(placed)
            }
            Err(e) => {
                self.give_back(bytes);
                tracing::warn!("{}: `{}` stays on the CPU: {e}", self.backend.api(), t.name);
                None
            }
        }
    }
}

thread_local! {
    static LOADING: std::cell::RefCell<Option<DevicePlacement>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` (a model's load) with `placement` as where its dense matrices may go
/// ([`place_dense`]); `None` keeps them on the CPU.
pub fn loading_with<T>(placement: Option<DevicePlacement>, f: impl FnOnce() -> T) -> T {
    struct Reset(Option<DevicePlacement>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let prev = self.0.take();
            LOADING.with(|l| *l.borrow_mut() = prev);
        }
    }
    let prev = LOADING.with(|l| l.replace(placement));
    let _reset = Reset(prev);
    f()
}

/// The placement of the model loading on this thread, if it has one.
pub fn current_placement() -> Option<DevicePlacement> {
    LOADING.with(|l| l.borrow().clone())
}

/// A dense matrix as the model loading on this thread places it: on its device when the
/// budget has room (keeping the host bytes), else on the CPU, with its rows interleaved where
/// that pays ([`Tensor::interleaved_for_cpu`](super::Tensor::interleaved_for_cpu)).
pub fn place_dense(t: super::Tensor) -> super::Tensor {
    match current_placement().and_then(|p| p.place(&t, true)) {
        Some(placed) => placed,
        None => t.interleaved_for_cpu(),
    }
}
