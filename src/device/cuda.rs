//! The CUDA side of device discovery, through cudarc's driver API.

use cudarc::driver::{result, sys};

use super::{no_device, GpuInfo};
use crate::error::Result;

pub(super) fn probe_gpus() -> Result<Vec<GpuInfo>> {
    // cudarc panics on the first call into a driver library it cannot load.
    // SAFETY: is_culib_present only tries to dlopen the library and reports
    // whether that worked; it calls no driver function.
    if !unsafe { sys::is_culib_present() } {
        return Err(no_device(
            "the CUDA driver library (libcuda.so) is not present",
        ));
    }
    result::init().map_err(|e| no_device(format!("cuInit failed: {e:?}")))?;
    let count = result::device::get_count()
        .map_err(|e| no_device(format!("cuDeviceGetCount failed: {e:?}")))?;
    if count <= 0 {
        return Err(no_device("the CUDA driver reports no GPU"));
    }
    (0..count)
        .map(|ordinal| {
            let dev = result::device::get(ordinal)
                .map_err(|e| no_device(format!("cuDeviceGet({ordinal}) failed: {e:?}")))?;
            let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
            // SAFETY: `dev` is a valid device handle returned by cuDeviceGet.
            let memory_bytes = unsafe { result::device::total_mem(dev) }.unwrap_or(0) as u64;
            let attr = |a| {
                // SAFETY: as above; `a` is a valid attribute enum value.
                unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0)
            };
            let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
            let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
            Ok(GpuInfo {
                ordinal: ordinal as u32,
                name,
                memory_bytes,
                compute_capability: format!("{major}.{minor}"),
            })
        })
        .collect()
}
