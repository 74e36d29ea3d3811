//! The Vulkan backend (`ash`, the loader opened at run time): device selection, device-local
//! weight buffers filled directly or through a staging buffer, one compute pipeline per weight
//! format (`shaders/matmul.comp`, compiled to the committed `shaders/*.spv` by
//! `scripts/build-shaders.sh`), timestamps for the kernel time.
//!
//! Products are serialised on one queue (a mutex around the command buffer, the descriptor set
//! and the host-visible activation and output buffers): each uploads its activations, runs
//! one dispatch per row chunk, and reads the output back.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ash::vk;

use super::{Acts, Backend, BufferId, DeviceApi, DeviceFormat, DeviceMemory, DeviceStats};
use super::{QuantizedActs, StatCounters};
use crate::{Error, Result};

/// The compiled kernels, in [`DeviceFormat::ALL`] order.
const SHADERS: [&[u8]; 9] = [
    include_bytes!("shaders/matmul_f32.spv"),
    include_bytes!("shaders/matmul_bf16.spv"),
    include_bytes!("shaders/matmul_f16.spv"),
    include_bytes!("shaders/matmul_mxfp4.spv"),
    include_bytes!("shaders/matmul_q8_0.spv"),
    include_bytes!("shaders/matmul_q4_0.spv"),
    include_bytes!("shaders/matmul_q4_1.spv"),
    include_bytes!("shaders/matmul_q4_k.spv"),
    include_bytes!("shaders/matmul_q6_k.spv"),
];

/// The float kernels (the first four formats) with fused multiply-adds computed exactly in
/// f64, for drivers whose `fma` is not fused (lavapipe's).
const SHADERS_FMA64: [&[u8]; 4] = [
    include_bytes!("shaders/matmul_f32_fma64.spv"),
    include_bytes!("shaders/matmul_bf16_fma64.spv"),
    include_bytes!("shaders/matmul_f16_fma64.spv"),
    include_bytes!("shaders/matmul_mxfp4_fma64.spv"),
];

/// Bytes of the push constants (`Params` in the shader: nine u32).
const PARAMS_BYTES: u32 = 36;

/// Staging chunk for uploads to memory the host cannot map.
const STAGING_BYTES: u64 = 64 << 20;

/// A buffer and the memory bound to it.
struct Allocation {
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    size: u64,
    /// Host pointer when the memory is mapped (persistently, for the I/O buffers).
    mapped: *mut c_void,
}

// SAFETY: the raw mapped pointer is only dereferenced while the owning mutex is held (I/O
// buffers) or during the upload that created it; Vulkan handles are plain identifiers.
unsafe impl Send for Allocation {}

/// What a product needs exclusively: the command buffer and the buffers it reads and writes.
struct Exec {
    cmd: vk::CommandBuffer,
    fence: vk::Fence,
    set: vk::DescriptorSet,
    acts: Option<Allocation>,
    out: Option<Allocation>,
    staging: Option<Allocation>,
}

/// A Vulkan compute device.
pub struct VulkanBackend {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    queue: vk::Queue,
    memory_props: vk::PhysicalDeviceMemoryProperties,
    name: String,
    heap_bytes: u64,
    max_range: u64,
    max_groups_x: u32,
    timestamp_period_ns: Option<f64>,
    set_layout: vk::DescriptorSetLayout,
    pipeline_layout: vk::PipelineLayout,
    pipelines: Vec<vk::Pipeline>,
    desc_pool: vk::DescriptorPool,
    cmd_pool: vk::CommandPool,
    query_pool: vk::QueryPool,
    exec: Mutex<Exec>,
    buffers: Mutex<HashMap<BufferId, Allocation>>,
    next_id: AtomicU64,
    allocated: AtomicU64,
    max_allocations: u64,
    /// Whether the device computes f64 (needed by the exact-fma kernels).
    float64: bool,
    stats: StatCounters,
}

/// A compute pipeline from SPIR-V bytes.
fn make_pipeline(
    device: &ash::Device,
    layout: vk::PipelineLayout,
    spv: &[u8],
) -> Result<vk::Pipeline> {
    let words = ash::util::read_spv(&mut std::io::Cursor::new(spv))
        .map_err(|e| Error::Unsupported(format!("vulkan: a shader: {e}")))?;
    // SAFETY: valid create infos for `device`; the module is destroyed once the pipeline
    // holds what it needs.
    unsafe {
        let module = device
            .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None)
            .map_err(vk_err("shader module"))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(c"main");
        let info = vk::ComputePipelineCreateInfo::default()
            .stage(stage)
            .layout(layout);
        let made = device.create_compute_pipelines(
            vk::PipelineCache::null(),
            std::slice::from_ref(&info),
            None,
        );
        device.destroy_shader_module(module, None);
        let made = made.map_err(|(_, e)| vk_err("compute pipeline")(e))?;
        Ok(made[0])
    }
}

fn vk_err(what: &str) -> impl Fn(vk::Result) -> Error + '_ {
    move |e| Error::Unsupported(format!("vulkan: {what}: {e}"))
}

/// Rank of a device type: discrete first, CPU implementations last.
fn type_rank(t: vk::PhysicalDeviceType) -> u32 {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => 0,
        vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
        vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
        vk::PhysicalDeviceType::CPU => 4,
        _ => 3,
    }
}

impl VulkanBackend {
    /// Open the best Vulkan device; with `gpu_only`, devices that are CPU implementations
    /// (Mesa's lavapipe) do not count.
    pub fn open(gpu_only: bool) -> Result<Arc<dyn Backend>> {
        // SAFETY: loading the system Vulkan loader runs its initialisation; it is the
        // documented way to use a loader that may be missing.
        let entry = unsafe { ash::Entry::load() }.map_err(|e| {
            Error::Unsupported(format!(
                "no Vulkan loader found ({e}); install the loader and a driver (Debian: \
                 libvulkan1 mesa-vulkan-drivers) or use --device cpu"
            ))
        })?;
        let app = vk::ApplicationInfo::default()
            .application_name(c"colibri")
            .api_version(vk::API_VERSION_1_1);
        // SAFETY: a valid create info with no layers or extensions.
        let instance = unsafe {
            entry.create_instance(
                &vk::InstanceCreateInfo::default().application_info(&app),
                None,
            )
        }
        .map_err(vk_err("creating an instance"))?;
        // The loader must outlive the instance: the failure path below still calls into it.
        match Self::open_device(entry.clone(), instance.clone(), gpu_only) {
            Ok(mut b) => {
                if let Err(native) = super::verify(&b) {
                    if !b.float64 {
                        return Err(native);
                    }
                    // The driver's fma is not fused: compute it exactly in f64 instead.
                    b.use_fma64()?;
                    super::verify(&b)?;
                    tracing::info!(
                        "vulkan: `{}` does not fuse fma; its float kernels compute fused \
                         multiply-adds exactly in f64",
                        b.name
                    );
                }
                Ok(Arc::new(b))
            }
            Err(e) => {
                // SAFETY: nothing created from the instance survives the failed open.
                unsafe { instance.destroy_instance(None) };
                Err(e)
            }
        }
    }

    fn open_device(entry: ash::Entry, instance: ash::Instance, gpu_only: bool) -> Result<Self> {
        // SAFETY: the instance is valid.
        let devices =
            unsafe { instance.enumerate_physical_devices() }.map_err(vk_err("listing devices"))?;
        let mut best: Option<(u32, vk::PhysicalDevice, vk::PhysicalDeviceProperties, u32)> = None;
        for pd in devices {
            // SAFETY: `pd` came from this instance.
            let props = unsafe { instance.get_physical_device_properties(pd) };
            if gpu_only && props.device_type == vk::PhysicalDeviceType::CPU {
                continue;
            }
            // SAFETY: as above.
            let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
            let Some(family) = families
                .iter()
                .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE))
            else {
                continue;
            };
            let rank = type_rank(props.device_type);
            if best.as_ref().is_none_or(|b| rank < b.0) {
                best = Some((rank, pd, props, family as u32));
            }
        }
        let Some((_, pd, props, family)) = best else {
            return Err(Error::Unsupported(format!(
                "no Vulkan {}device with a compute queue found",
                if gpu_only { "GPU " } else { "" }
            )));
        };
        let name = props
            .device_name_as_c_str()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unnamed device".into());
        if props.device_type == vk::PhysicalDeviceType::CPU {
            tracing::warn!(
                "vulkan: `{name}` is a CPU implementation of Vulkan (for testing): its products \
                 are exact but far slower than --device cpu (docs/benchmarks.md §10)"
            );
        }
        // SAFETY: `pd` came from this instance.
        let memory_props = unsafe { instance.get_physical_device_memory_properties(pd) };
        let heap_bytes = (0..memory_props.memory_heap_count as usize)
            .map(|i| memory_props.memory_heaps[i])
            .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|h| h.size)
            .max()
            .unwrap_or(0);
        // SAFETY: `pd` came from this instance.
        let features = unsafe { instance.get_physical_device_features(pd) };
        let float64 = features.shader_float64 == vk::TRUE;
        let enabled = vk::PhysicalDeviceFeatures::default().shader_float64(float64);
        let priorities = [1.0f32];
        let queue_info = vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&priorities);
        // SAFETY: a valid create info for a family this device has.
        let device = unsafe {
            instance.create_device(
                pd,
                &vk::DeviceCreateInfo::default()
                    .queue_create_infos(std::slice::from_ref(&queue_info))
                    .enabled_features(&enabled),
                None,
            )
        }
        .map_err(vk_err("creating the device"))?;
        // SAFETY: queue 0 of the family the device was created with.
        let queue = unsafe { device.get_device_queue(family, 0) };
        // SAFETY: as above.
        let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
        let timestamp_period_ns = (families[family as usize].timestamp_valid_bits > 0)
            .then_some(props.limits.timestamp_period as f64);

        // SAFETY: every create info below is complete and valid for `device`; the objects are
        // destroyed in `Drop`.
        unsafe {
            let bindings: Vec<_> = (0..3)
                .map(|b| {
                    vk::DescriptorSetLayoutBinding::default()
                        .binding(b)
                        .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                        .descriptor_count(1)
                        .stage_flags(vk::ShaderStageFlags::COMPUTE)
                })
                .collect();
            let set_layout = device
                .create_descriptor_set_layout(
                    &vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings),
                    None,
                )
                .map_err(vk_err("descriptor set layout"))?;
            let push = [vk::PushConstantRange::default()
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
                .offset(0)
                .size(PARAMS_BYTES)];
            let layouts = [set_layout];
            let pipeline_layout = device
                .create_pipeline_layout(
                    &vk::PipelineLayoutCreateInfo::default()
                        .set_layouts(&layouts)
                        .push_constant_ranges(&push),
                    None,
                )
                .map_err(vk_err("pipeline layout"))?;
            let mut pipelines = Vec::with_capacity(SHADERS.len());
            for spv in SHADERS {
                pipelines.push(make_pipeline(&device, pipeline_layout, spv)?);
            }
            let sizes = [vk::DescriptorPoolSize {
                ty: vk::DescriptorType::STORAGE_BUFFER,
                descriptor_count: 3,
            }];
            let desc_pool = device
                .create_descriptor_pool(
                    &vk::DescriptorPoolCreateInfo::default()
                        .max_sets(1)
                        .pool_sizes(&sizes),
                    None,
                )
                .map_err(vk_err("descriptor pool"))?;
            let set = device
                .allocate_descriptor_sets(
                    &vk::DescriptorSetAllocateInfo::default()
                        .descriptor_pool(desc_pool)
                        .set_layouts(&layouts),
                )
                .map_err(vk_err("descriptor set"))?[0];
            let cmd_pool = device
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default()
                        .queue_family_index(family)
                        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                    None,
                )
                .map_err(vk_err("command pool"))?;
            let cmd = device
                .allocate_command_buffers(
                    &vk::CommandBufferAllocateInfo::default()
                        .command_pool(cmd_pool)
                        .level(vk::CommandBufferLevel::PRIMARY)
                        .command_buffer_count(1),
                )
                .map_err(vk_err("command buffer"))?[0];
            let fence = device
                .create_fence(&vk::FenceCreateInfo::default(), None)
                .map_err(vk_err("fence"))?;
            let query_pool = device
                .create_query_pool(
                    &vk::QueryPoolCreateInfo::default()
                        .query_type(vk::QueryType::TIMESTAMP)
                        .query_count(2),
                    None,
                )
                .map_err(vk_err("query pool"))?;
            Ok(VulkanBackend {
                _entry: entry,
                instance,
                device,
                queue,
                memory_props,
                name,
                heap_bytes,
                max_range: props.limits.max_storage_buffer_range as u64,
                max_groups_x: props.limits.max_compute_work_group_count[0].clamp(1, 65535),
                timestamp_period_ns,
                set_layout,
                pipeline_layout,
                pipelines,
                desc_pool,
                cmd_pool,
                query_pool,
                exec: Mutex::new(Exec {
                    cmd,
                    fence,
                    set,
                    acts: None,
                    out: None,
                    staging: None,
                }),
                buffers: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
                allocated: AtomicU64::new(0),
                max_allocations: props.limits.max_memory_allocation_count as u64,
                float64,
                stats: StatCounters::default(),
            })
        }
    }

    /// Replace the float kernels by their exact-fma (f64) forms.
    fn use_fma64(&mut self) -> Result<()> {
        for (i, spv) in SHADERS_FMA64.iter().enumerate() {
            let p = make_pipeline(&self.device, self.pipeline_layout, spv)?;
            // SAFETY: no product runs (the backend is not shared yet), so the old pipeline
            // is idle.
            unsafe { self.device.destroy_pipeline(self.pipelines[i], None) };
            self.pipelines[i] = p;
        }
        Ok(())
    }

    /// A memory type index allowed by `bits` with `want` (and, if possible, `prefer`) flags.
    fn memory_type(
        &self,
        bits: u32,
        want: vk::MemoryPropertyFlags,
        prefer: vk::MemoryPropertyFlags,
    ) -> Option<u32> {
        let types = &self.memory_props.memory_types[..self.memory_props.memory_type_count as usize];
        let ok = |i: usize, f: vk::MemoryPropertyFlags| {
            bits & (1 << i) != 0 && types[i].property_flags.contains(f)
        };
        (0..types.len())
            .find(|&i| ok(i, want | prefer))
            .or_else(|| (0..types.len()).find(|&i| ok(i, want)))
            .map(|i| i as u32)
    }

    /// A buffer of `size` bytes (rounded up to whole words) in memory with `want` flags,
    /// mapped if host-visible.
    fn allocate(
        &self,
        size: u64,
        want: vk::MemoryPropertyFlags,
        prefer: vk::MemoryPropertyFlags,
    ) -> Result<Allocation> {
        let size = size.max(4).next_multiple_of(4);
        if self.allocated.load(Ordering::Relaxed) + 4 > self.max_allocations {
            return Err(Error::Unsupported(format!(
                "vulkan: `{}` allows {} memory allocations and they are all in use",
                self.name, self.max_allocations
            )));
        }
        // SAFETY: valid create/allocate infos for this device; on failure what was created is
        // destroyed before returning.
        unsafe {
            let buffer = self
                .device
                .create_buffer(
                    &vk::BufferCreateInfo::default()
                        .size(size)
                        .usage(
                            vk::BufferUsageFlags::STORAGE_BUFFER
                                | vk::BufferUsageFlags::TRANSFER_DST
                                | vk::BufferUsageFlags::TRANSFER_SRC,
                        )
                        .sharing_mode(vk::SharingMode::EXCLUSIVE),
                    None,
                )
                .map_err(vk_err("creating a buffer"))?;
            let req = self.device.get_buffer_memory_requirements(buffer);
            let Some(ty) = self.memory_type(req.memory_type_bits, want, prefer) else {
                self.device.destroy_buffer(buffer, None);
                return Err(Error::Unsupported(format!(
                    "vulkan: `{}` has no memory type with flags {:#x}",
                    self.name,
                    want.as_raw()
                )));
            };
            let memory = match self.device.allocate_memory(
                &vk::MemoryAllocateInfo::default()
                    .allocation_size(req.size)
                    .memory_type_index(ty),
                None,
            ) {
                Ok(m) => m,
                Err(e) => {
                    self.device.destroy_buffer(buffer, None);
                    return Err(Error::Unsupported(format!(
                        "vulkan: allocating {size} bytes on `{}`: {e}",
                        self.name
                    )));
                }
            };
            if let Err(e) = self.device.bind_buffer_memory(buffer, memory, 0) {
                self.device.destroy_buffer(buffer, None);
                self.device.free_memory(memory, None);
                return Err(vk_err("binding buffer memory")(e));
            }
            let host = self.memory_props.memory_types[ty as usize]
                .property_flags
                .contains(
                    vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT,
                );
            let mapped = if host {
                match self
                    .device
                    .map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty())
                {
                    Ok(p) => p,
                    Err(e) => {
                        self.device.destroy_buffer(buffer, None);
                        self.device.free_memory(memory, None);
                        return Err(vk_err("mapping memory")(e));
                    }
                }
            } else {
                std::ptr::null_mut()
            };
            self.allocated.fetch_add(1, Ordering::Relaxed);
            Ok(Allocation {
                buffer,
                memory,
                size,
                mapped,
            })
        }
    }

    fn release(&self, a: Allocation) {
        // SAFETY: the allocation is not in use: products wait for their fence before
        // returning, and the caller removed it from every table.
        unsafe {
            if !a.mapped.is_null() {
                self.device.unmap_memory(a.memory);
            }
            self.device.destroy_buffer(a.buffer, None);
            self.device.free_memory(a.memory, None);
        }
        self.allocated.fetch_sub(1, Ordering::Relaxed);
    }

    /// A host-visible buffer of at least `size` bytes in `slot`, grown as needed.
    fn host_buffer<'a>(
        &self,
        slot: &'a mut Option<Allocation>,
        size: u64,
    ) -> Result<&'a Allocation> {
        if slot.as_ref().is_none_or(|a| a.size < size) {
            if let Some(old) = slot.take() {
                self.release(old);
            }
            let grown = size.max(1 << 16).next_power_of_two();
            *slot = Some(self.allocate(
                grown,
                vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT,
                vk::MemoryPropertyFlags::HOST_CACHED,
            )?);
        }
        Ok(slot.as_ref().expect("just filled"))
    }

    /// Record `record` into the command buffer, submit it and wait.
    fn submit(&self, exec: &Exec, record: impl FnOnce(vk::CommandBuffer)) -> Result<()> {
        // SAFETY: the command buffer and fence belong to `exec`, which the caller holds
        // exclusively; the fence is waited on and reset before returning.
        unsafe {
            self.device
                .begin_command_buffer(
                    exec.cmd,
                    &vk::CommandBufferBeginInfo::default()
                        .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
                )
                .map_err(vk_err("begin command buffer"))?;
            record(exec.cmd);
            self.device
                .end_command_buffer(exec.cmd)
                .map_err(vk_err("end command buffer"))?;
            let cmds = [exec.cmd];
            self.device
                .queue_submit(
                    self.queue,
                    &[vk::SubmitInfo::default().command_buffers(&cmds)],
                    exec.fence,
                )
                .map_err(vk_err("submit"))?;
            let waited = self.device.wait_for_fences(&[exec.fence], true, u64::MAX);
            self.device
                .reset_fences(&[exec.fence])
                .map_err(vk_err("reset fence"))?;
            waited.map_err(vk_err("waiting for the device"))?;
        }
        Ok(())
    }
}

/// Copy `bytes` to the mapped memory at `dst` (whose allocation holds at least that many).
///
/// # Safety
/// `dst` must point to at least `bytes.len()` writable bytes not in use by the device.
unsafe fn write_mapped(dst: *mut c_void, offset: usize, bytes: &[u8]) {
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), (dst as *mut u8).add(offset), bytes.len())
    };
}

/// The activation words the shader reads (and the CUDA kernels), and the word offsets of the
/// scales and sums.
pub(super) fn pack_acts(
    acts: Acts<'_>,
    rows: std::ops::Range<usize>,
    k: usize,
) -> (Vec<u8>, [u32; 4]) {
    match acts {
        Acts::F32(x) => (
            bytemuck::cast_slice(&x[rows.start * k..rows.end * k]).to_vec(),
            [0; 4],
        ),
        Acts::Quant(q) => pack_quant(q, rows, k),
    }
}

fn pack_quant(q: &QuantizedActs, rows: std::ops::Range<usize>, k: usize) -> (Vec<u8>, [u32; 4]) {
    let bs = if q.format == super::super::qmatmul::ActFormat::Q8K {
        super::super::quant::QK_K
    } else {
        super::super::quant::QK32
    };
    let nb = k / bs;
    let (r0, r1) = (rows.start, rows.end);
    let mut bytes: Vec<u8> = bytemuck::cast_slice(&q.qs[r0 * k..r1 * k]).to_vec();
    bytes.resize(bytes.len().next_multiple_of(4), 0);
    let mut offs = [0u32; 4];
    let mut push = |bytes: &mut Vec<u8>, slot: usize, words: &[u8]| {
        offs[slot] = (bytes.len() / 4) as u32;
        bytes.extend_from_slice(words);
    };
    push(&mut bytes, 0, bytemuck::cast_slice(&q.d[r0 * nb..r1 * nb]));
    if !q.sums.is_empty() {
        push(
            &mut bytes,
            1,
            bytemuck::cast_slice(&q.sums[r0 * nb..r1 * nb]),
        );
    }
    if !q.bsums.is_empty() {
        push(
            &mut bytes,
            2,
            bytemuck::cast_slice(&q.bsums[r0 * nb * 16..r1 * nb * 16]),
        );
    }
    if !q.pairs.is_empty() {
        push(
            &mut bytes,
            3,
            bytemuck::cast_slice(&q.pairs[r0 * nb * 8..r1 * nb * 8]),
        );
    }
    (bytes, offs)
}

impl Backend for VulkanBackend {
    fn api(&self) -> DeviceApi {
        DeviceApi::Vulkan
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn memory(&self) -> DeviceMemory {
        let used = self.stats.snapshot().resident_bytes;
        DeviceMemory {
            total: self.heap_bytes,
            free: self.heap_bytes.saturating_sub(used),
        }
    }

    fn max_matrix_bytes(&self) -> u64 {
        self.max_range
    }

    fn upload(&self, bytes: &[u8]) -> Result<BufferId> {
        let since = Instant::now();
        let alloc = self.allocate(
            bytes.len() as u64,
            vk::MemoryPropertyFlags::DEVICE_LOCAL,
            vk::MemoryPropertyFlags::empty(),
        )?;
        if !alloc.mapped.is_null() {
            // SAFETY: the mapping covers `alloc.size >= bytes.len()` bytes (rounded up to
            // whole words, the rest zeroed) and the device has not seen the buffer yet.
            unsafe {
                write_mapped(alloc.mapped, 0, bytes);
                let pad = alloc.size as usize - bytes.len();
                std::ptr::write_bytes((alloc.mapped as *mut u8).add(bytes.len()), 0, pad);
            }
        } else {
            let mut exec = self.exec.lock().unwrap_or_else(|p| p.into_inner());
            let mut padded = bytes.to_vec();
            padded.resize(alloc.size as usize, 0);
            let mut start = 0usize;
            while start < padded.len() {
                let end = (start + STAGING_BYTES as usize).min(padded.len());
                let chunk = &padded[start..end];
                let staging = {
                    let Exec { staging, .. } = &mut *exec;
                    self.host_buffer(staging, chunk.len() as u64)?.buffer
                };
                let mapped = exec.staging.as_ref().expect("just made").mapped;
                // SAFETY: the staging buffer holds at least `chunk.len()` bytes and the
                // previous copy out of it finished (its fence was waited on).
                unsafe { write_mapped(mapped, 0, chunk) };
                let region = vk::BufferCopy {
                    src_offset: 0,
                    dst_offset: start as u64,
                    size: chunk.len() as u64,
                };
                let dst = alloc.buffer;
                // SAFETY: both buffers are live and large enough for the region.
                self.submit(&exec, |cmd| unsafe {
                    self.device.cmd_copy_buffer(cmd, staging, dst, &[region]);
                })?;
                start = end;
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Counted as allocated (whole words), as `free` uncounts it.
        self.stats.uploaded(alloc.size, since);
        self.buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, alloc);
        Ok(id)
    }

    fn free(&self, id: BufferId) {
        let removed = self
            .buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        if let Some(a) = removed {
            // Not in use: products hold the buffer table's entry only while they run, and a
            // matrix is freed only when no product can use it any more.
            self.stats.freed(a.size);
            self.release(a);
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
        let weights = {
            let table = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
            let a = table.get(&w).ok_or_else(|| {
                Error::Invalid(format!("vulkan: no matrix {w} on `{}`", self.name))
            })?;
            a.buffer
        };
        let mut exec = self.exec.lock().unwrap_or_else(|p| p.into_inner());
        let pipeline = self.pipelines[format.index()];
        // Rows per dispatch: every index the shader forms stays far below 2^32.
        let chunk = (((1usize << 28) / k.max(n).max(1)).max(1)).min(m);
        let groups = if format.takes_f32() { n } else { n.div_ceil(4) } as u32;
        let groups_x = groups.clamp(1, self.max_groups_x);
        let groups_z = groups.div_ceil(groups_x);
        let mut kernel_ns = 0u64;
        let mut r0 = 0;
        while r0 < m {
            let r1 = (r0 + chunk).min(m);
            let (packed, offs) = pack_acts(acts, r0..r1, k);
            let out_bytes = ((r1 - r0) * n * 4) as u64;
            let (acts_buf, acts_ptr) = {
                let Exec { acts, .. } = &mut *exec;
                let a = self.host_buffer(acts, packed.len() as u64)?;
                (a.buffer, a.mapped)
            };
            let (out_buf, out_ptr) = {
                let Exec { out, .. } = &mut *exec;
                let a = self.host_buffer(out, out_bytes)?;
                (a.buffer, a.mapped)
            };
            // SAFETY: the activation buffer holds at least `packed.len()` bytes and the device
            // is idle on it (the previous submit was waited on).
            unsafe { write_mapped(acts_ptr, 0, &packed) };
            let infos = [weights, acts_buf, out_buf].map(|b| {
                [vk::DescriptorBufferInfo {
                    buffer: b,
                    offset: 0,
                    range: vk::WHOLE_SIZE,
                }]
            });
            let writes: Vec<_> = infos
                .iter()
                .enumerate()
                .map(|(i, info)| {
                    vk::WriteDescriptorSet::default()
                        .dst_set(exec.set)
                        .dst_binding(i as u32)
                        .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                        .buffer_info(info)
                })
                .collect();
            // SAFETY: the set is not in use by the device (previous submit waited on).
            unsafe { self.device.update_descriptor_sets(&writes, &[]) };
            let params: [u32; 9] = [
                (r1 - r0) as u32,
                n as u32,
                k as u32,
                row_bytes as u32,
                offs[0],
                offs[1],
                offs[2],
                offs[3],
                groups_x,
            ];
            let timed = self.timestamp_period_ns.is_some();
            let set = exec.set;
            // SAFETY: every handle recorded is live; the barrier makes the shader's writes
            // visible to the host read after the fence.
            self.submit(&exec, |cmd| unsafe {
                if timed {
                    self.device.cmd_reset_query_pool(cmd, self.query_pool, 0, 2);
                    self.device.cmd_write_timestamp(
                        cmd,
                        vk::PipelineStageFlags::TOP_OF_PIPE,
                        self.query_pool,
                        0,
                    );
                }
                self.device
                    .cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, pipeline);
                self.device.cmd_bind_descriptor_sets(
                    cmd,
                    vk::PipelineBindPoint::COMPUTE,
                    self.pipeline_layout,
                    0,
                    &[set],
                    &[],
                );
                self.device.cmd_push_constants(
                    cmd,
                    self.pipeline_layout,
                    vk::ShaderStageFlags::COMPUTE,
                    0,
                    bytemuck::cast_slice(&params),
                );
                self.device.cmd_dispatch(cmd, groups_x, 1, groups_z);
                if timed {
                    self.device.cmd_write_timestamp(
                        cmd,
                        vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                        self.query_pool,
                        1,
                    );
                }
                let barrier = vk::MemoryBarrier::default()
                    .src_access_mask(vk::AccessFlags::SHADER_WRITE)
                    .dst_access_mask(vk::AccessFlags::HOST_READ);
                self.device.cmd_pipeline_barrier(
                    cmd,
                    vk::PipelineStageFlags::COMPUTE_SHADER,
                    vk::PipelineStageFlags::HOST,
                    vk::DependencyFlags::empty(),
                    &[barrier],
                    &[],
                    &[],
                );
            })?;
            if let Some(period) = self.timestamp_period_ns {
                let mut ts = [0u64; 2];
                // SAFETY: both queries were written by the submit just waited on.
                let got = unsafe {
                    self.device.get_query_pool_results(
                        self.query_pool,
                        0,
                        &mut ts,
                        vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
                    )
                };
                if got.is_ok() {
                    kernel_ns += (ts[1].saturating_sub(ts[0]) as f64 * period) as u64;
                }
            }
            let dst = &mut out[r0 * n..r1 * n];
            // SAFETY: the output buffer holds at least `out_bytes` bytes, the device finished
            // writing them (fence waited, barrier to host reads), and `dst` is that size.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    out_ptr as *const u8,
                    dst.as_mut_ptr() as *mut u8,
                    out_bytes as usize,
                )
            };
            r0 = r1;
        }
        drop(exec);
        self.stats.computed(since, kernel_ns);
        Ok(())
    }

    fn stats(&self) -> DeviceStats {
        self.stats.snapshot()
    }
}

impl Drop for VulkanBackend {
    fn drop(&mut self) {
        // SAFETY: the backend is being dropped, so no product runs; everything created in
        // `open_device` is destroyed once, after the device is idle.
        unsafe {
            let _ = self.device.device_wait_idle();
            let exec = self.exec.get_mut().unwrap_or_else(|p| p.into_inner());
            let io: Vec<Allocation> = [exec.acts.take(), exec.out.take(), exec.staging.take()]
                .into_iter()
                .flatten()
                .collect();
            let fence = exec.fence;
            for a in io {
                self.release(a);
            }
            let buffers: Vec<Allocation> = self
                .buffers
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .drain()
                .map(|(_, a)| a)
                .collect();
            for a in buffers {
                self.release(a);
            }
            self.device.destroy_fence(fence, None);
            self.device.destroy_query_pool(self.query_pool, None);
            self.device.destroy_command_pool(self.cmd_pool, None);
            self.device.destroy_descriptor_pool(self.desc_pool, None);
            for &p in &self.pipelines {
                self.device.destroy_pipeline(p, None);
            }
            self.device
                .destroy_pipeline_layout(self.pipeline_layout, None);
            self.device
                .destroy_descriptor_set_layout(self.set_layout, None);
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}
