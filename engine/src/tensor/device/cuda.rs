//! The CUDA backend (`cudarc`, the driver library opened at run time, so the same binary runs
//! where there is none): the first GPU's primary context and default stream, weight matrices
//! in device buffers, and the kernels of `cuda/matmul.cu` (one per [`DeviceFormat`], the
//! operations of `shaders/matmul.comp` in the same order), loaded from PTX that `build.rs`
//! compiles with nvcc or takes from the committed `cuda/matmul.ptx` (`scripts/build-ptx.sh`).
//! CUDA events give the kernel time.
//!
//! Products are serialised (a mutex around the activation and output buffers, which grow to
//! the largest product seen): each uploads its activations in the layout the Vulkan kernels
//! read (`vulkan::pack_acts`), runs one launch per row chunk, and copies the output
//! back. [`CudaBackend::open`] refuses a device whose products do not have the CPU's bits
//! ([`super::verify`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};

use super::StatCounters;
use super::{Acts, Backend, BufferId, DeviceApi, DeviceFormat, DeviceMemory, DeviceStats};
use crate::{Error, Result};

/// The kernels' PTX (see `build.rs`).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/matmul.ptx"));

/// The kernel names in `cuda/matmul.cu`, in [`DeviceFormat::ALL`] order.
const KERNELS: [&str; 9] = [
    "matmul_f32",
    "matmul_bf16",
    "matmul_f16",
    "matmul_mxfp4",
    "matmul_q8_0",
    "matmul_q4_0",
    "matmul_q4_1",
    "matmul_q4_k",
    "matmul_q6_k",
];

/// Threads per block (one warp: the canonical order's 32 lanes, or four rows of 8).
const BLOCK: u32 = 32;

/// The buffers a product needs exclusively (grown on demand, kept between products).
#[derive(Default)]
struct Io {
    acts: Option<CudaSlice<u8>>,
    out: Option<CudaSlice<f32>>,
}

/// The matrices on the device, each with its size in bytes (a product holds its matrix's
/// `Arc` while it runs, so a matrix freed meanwhile goes when the product ends).
type Matrices = HashMap<BufferId, (Arc<CudaSlice<u8>>, u64)>;

/// A CUDA device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    total_bytes: u64,
    kernels: Vec<CudaFunction>,
    io: Mutex<Io>,
    buffers: Mutex<Matrices>,
    next_id: AtomicU64,
    stats: StatCounters,
}

/// A driver error as the engine's, saying what failed.
fn cu_err(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Unsupported(format!("cuda: {what}: {e}"))
}

impl CudaBackend {
    /// Open the first CUDA GPU; an error if there is no driver or GPU, or if its products do
    /// not have the CPU's bits.
    pub fn open() -> Result<Arc<dyn Backend>> {
        // cudarc panics on its first driver call when the library is missing: look first.
        // SAFETY: only tries to open the driver library by its names.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "no CUDA driver found (libcuda.so); on a GPU node run the container with \
                 --gpus all, or use --device vulkan / cpu"
                    .into(),
            ));
        }
        let backend = Self::open_device()?;
        super::verify(&backend)?;
        tracing::info!(
            "cuda: `{}` ({} MiB) computes with the CPU's bits",
            backend.name,
            backend.total_bytes >> 20
        );
        Ok(Arc::new(backend))
    }

    fn open_device() -> Result<CudaBackend> {
        let count = CudaContext::device_count().map_err(cu_err("counting devices"))?;
        if count < 1 {
            return Err(Error::Unsupported(
                "cuda: the driver finds no CUDA GPU; use --device vulkan / cpu".into(),
            ));
        }
        let ctx = CudaContext::new(0).map_err(cu_err("opening device 0"))?;
        let name = ctx.name().map_err(cu_err("the device name"))?;
        let total_bytes = ctx.total_mem().map_err(cu_err("the device memory"))? as u64;
        let stream = ctx.default_stream();
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(PTX))
            .map_err(cu_err(
                "loading the kernels' PTX (a driver older than the PTX?)",
            ))?;
        let kernels = KERNELS
            .iter()
            .map(|k| module.load_function(k).map_err(cu_err(k)))
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaBackend {
            ctx,
            stream,
            name,
            total_bytes,
            kernels,
            io: Mutex::new(Io::default()),
            buffers: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stats: StatCounters::default(),
        })
    }

    /// Run `format`'s kernel over activation rows `r0..r1` into `io`'s output buffer and copy
    /// them into `dst`; the kernel's nanoseconds.
    #[allow(clippy::too_many_arguments)]
    fn run_chunk(
        &self,
        io: &mut Io,
        weights: &CudaSlice<u8>,
        format: DeviceFormat,
        n: usize,
        k: usize,
        row_bytes: usize,
        acts: Acts<'_>,
        rows: std::ops::Range<usize>,
        dst: &mut [f32],
    ) -> Result<u64> {
        let m = rows.len();
        let (packed, offs) = super::vulkan::pack_acts(acts, rows, k);
        let acts_buf = grow(&self.stream, &mut io.acts, packed.len().max(4))?;
        self.stream
            .memcpy_htod(&packed, &mut acts_buf.slice_mut(0..packed.len()))
            .map_err(cu_err("uploading activations"))?;
        let acts_buf = io.acts.as_ref().expect("just grown");
        let out_len = m * n;
        let out_buf = grow(&self.stream, &mut io.out, out_len)?;
        let params: [u32; 8] = [
            m as u32,
            n as u32,
            k as u32,
            row_bytes as u32,
            offs[0],
            offs[1],
            offs[2],
            offs[3],
        ];
        let groups = if format.takes_f32() { n } else { n.div_ceil(4) };
        let cfg = LaunchConfig {
            grid_dim: (groups as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let func = &self.kernels[format.index()];
        let mut launch = self.stream.launch_builder(func);
        launch.arg(weights).arg(acts_buf).arg(&mut *out_buf);
        for p in &params {
            launch.arg(p);
        }
        launch.record_kernel_launch(sys::CUevent_flags::CU_EVENT_DEFAULT);
        // SAFETY: the arguments are the kernel's (`cuda/matmul.cu`: weights, activation words,
        // output, eight u32): the weight buffer holds `n` rows of `row_bytes`, the activation
        // buffer the packed words with the offsets passed, the output buffer at least `m × n`
        // floats, and the grid is the one the kernel indexes (one block per row, or per four
        // rows for the integer formats), so every access stays inside them.
        let events = unsafe { launch.launch(cfg) }.map_err(cu_err("launching a kernel"))?;
        let out_view = out_buf.slice(0..out_len);
        self.stream
            .memcpy_dtoh(&out_view, dst)
            .map_err(cu_err("reading the output"))?;
        self.stream
            .synchronize()
            .map_err(cu_err("waiting for the device"))?;
        let kernel_ns = match events {
            Some((start, end)) => start
                .elapsed_ms(&end)
                .map(|ms| (ms as f64 * 1e6) as u64)
                .unwrap_or(0),
            None => 0,
        };
        Ok(kernel_ns)
    }
}

/// `slot`'s buffer, reallocated to at least `len` elements (rounded up to a power of two).
fn grow<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &'a mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<&'a mut CudaSlice<T>> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        *slot = None;
        let buf = stream
            .alloc_zeros::<T>(len.next_power_of_two())
            .map_err(cu_err("allocating an I/O buffer"))?;
        *slot = Some(buf);
    }
    Ok(slot.as_mut().expect("just filled"))
}

impl Backend for CudaBackend {
    fn api(&self) -> DeviceApi {
        DeviceApi::Cuda
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn memory(&self) -> DeviceMemory {
        match self.ctx.mem_get_info() {
            Ok((free, total)) => DeviceMemory {
                total: total as u64,
                free: free as u64,
            },
            Err(_) => DeviceMemory {
                total: self.total_bytes,
                free: self
                    .total_bytes
                    .saturating_sub(self.stats.snapshot().resident_bytes),
            },
        }
    }

    fn max_matrix_bytes(&self) -> u64 {
        // The kernels index weights in 64 bits; one buffer may take the whole memory.
        self.total_bytes
    }

    fn upload(&self, bytes: &[u8]) -> Result<BufferId> {
        let since = Instant::now();
        let buf = if bytes.is_empty() {
            self.stream.alloc_zeros::<u8>(4)
        } else {
            self.stream.clone_htod(bytes)
        }
        .map_err(cu_err("uploading a matrix"))?;
        self.stream
            .synchronize()
            .map_err(cu_err("waiting for an upload"))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.stats.uploaded(bytes.len() as u64, since);
        self.buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (Arc::new(buf), bytes.len() as u64));
        Ok(id)
    }

    fn free(&self, id: BufferId) {
        let removed = self
            .buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        if let Some((_buf, bytes)) = removed {
            // The memory goes when the last product holding it ends.
            self.stats.freed(bytes);
        }
    }

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
    ) -> Result<()> {
        let since = Instant::now();
        if m == 0 || n == 0 {
            // Nothing to compute (and CUDA refuses an empty grid).
            self.stats.computed(since, 0);
            return Ok(());
        }
        let weights = {
            let table = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
            table
                .get(&w)
                .map(|(b, _)| b.clone())
                .ok_or_else(|| Error::Invalid(format!("cuda: no matrix {w} on `{}`", self.name)))?
        };
        if out.len() < m * n {
            return Err(Error::Invalid(format!(
                "cuda: an output of {} floats for a {m}×{n} product",
                out.len()
            )));
        }
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        // Rows per launch: every activation index the kernels form stays far below 2^32.
        let chunk = (((1usize << 28) / k.max(n).max(1)).max(1)).min(m.max(1));
        let mut kernel_ns = 0u64;
        let mut r0 = 0;
        while r0 < m {
            let r1 = (r0 + chunk).min(m);
            kernel_ns += self.run_chunk(
                &mut io,
                &weights,
                format,
                n,
                k,
                row_bytes,
                acts,
                r0..r1,
                &mut out[r0 * n..r1 * n],
            )?;
            r0 = r1;
        }
        drop(io);
        self.stats.computed(since, kernel_ns);
        Ok(())
    }

    fn stats(&self) -> DeviceStats {
        self.stats.snapshot()
    }
}
