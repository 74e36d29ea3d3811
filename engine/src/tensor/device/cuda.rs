//! The CUDA backend (`cudarc`, the driver library opened at run time, so the same binary runs
//! where there is none).

use std::sync::Arc;

use super::Backend;
use crate::{Error, Result};

/// A CUDA device.
pub struct CudaBackend;

impl CudaBackend {
    /// Open the first CUDA GPU.
    pub fn open() -> Result<Arc<dyn Backend>> {
        // SAFETY: only tries to open the driver library by its names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "no CUDA driver found (libcuda.so); on a GPU node run the container with \
                 --gpus all, or use --device vulkan / cpu"
                    .into(),
            ));
        }
        Err(Error::Unsupported(
            "the CUDA kernels are not built yet".into(),
        ))
    }
}
