//! DLPack export of pinned ranges: a `DLManagedTensor` (the DLPack
//! exchange struct that PyTorch's `at::fromDLPack` and
//! `torch.utils.dlpack.from_dlpack` take) whose memory is a pinned range of
//! a buffer, kept pinned until the consumer calls the tensor's deleter.
//!
//! The structs follow the DLPack specification header (`dlpack/dlpack.h`,
//! v1.1; the legacy unversioned `DLManagedTensor` is what is exported). The
//! header emits them only where `dlpack.h` was not included first.
#![allow(non_camel_case_types)]

use std::collections::BTreeSet;
use std::ffi::{c_int, c_void};

use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;
use strata::device::BackendKind;
use strata::runtime::OwnedPin;
use strata::{Buffer, Error, ErrorKind, Result, Runtime, Tier};

use crate::cast;
use crate::enums::{strata_tier, tier};
use crate::handle::Quarantine;
use crate::objects::{self, strata_buffer};
use crate::status::{boundary, boundary_void, Fail, R, STRATA_ERR_INVALID_HANDLE, STRATA_OK};

/// DLPack: the kind of device a tensor's memory is on.
#[cfg(not(dlpack_h_included))]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DLDeviceType {
    /// CPU memory.
    kDLCPU = 1,
    /// CUDA device memory.
    kDLCUDA = 2,
    /// Pinned CUDA host memory (cudaMallocHost).
    kDLCUDAHost = 3,
    /// OpenCL.
    kDLOpenCL = 4,
    /// Vulkan.
    kDLVulkan = 7,
    /// Metal.
    kDLMetal = 8,
    /// Verilog simulator.
    kDLVPI = 9,
    /// ROCm GPUs.
    kDLROCM = 10,
    /// Pinned ROCm host memory.
    kDLROCMHost = 11,
    /// Reserved extension device.
    kDLExtDev = 12,
    /// CUDA managed memory.
    kDLCUDAManaged = 13,
    /// oneAPI unified shared memory.
    kDLOneAPI = 14,
    /// WebGPU.
    kDLWebGPU = 15,
    /// Qualcomm Hexagon DSP.
    kDLHexagon = 16,
    /// Microsoft MAIA.
    kDLMAIA = 17,
    /// AWS Trainium.
    kDLTrn = 18,
}

/// DLPack: a device (kind and index).
#[cfg(not(dlpack_h_included))]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLDevice {
    /// The kind of device.
    pub device_type: DLDeviceType,
    /// The device index (0 for CPU memory).
    pub device_id: i32,
}

/// DLPack: type codes of `DLDataType.code`.
#[cfg(not(dlpack_h_included))]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub enum DLDataTypeCode {
    /// Signed integer.
    kDLInt = 0,
    /// Unsigned integer.
    kDLUInt = 1,
    /// IEEE floating point.
    kDLFloat = 2,
    /// Opaque handle (testing).
    kDLOpaqueHandle = 3,
    /// bfloat16.
    kDLBfloat = 4,
    /// Complex number.
    kDLComplex = 5,
    /// Boolean.
    kDLBool = 6,
    /// FP8 e3m4.
    kDLFloat8_e3m4 = 7,
    /// FP8 e4m3.
    kDLFloat8_e4m3 = 8,
    /// FP8 e4m3b11fnuz.
    kDLFloat8_e4m3b11fnuz = 9,
    /// FP8 e4m3fn.
    kDLFloat8_e4m3fn = 10,
    /// FP8 e4m3fnuz.
    kDLFloat8_e4m3fnuz = 11,
    /// FP8 e5m2.
    kDLFloat8_e5m2 = 12,
    /// FP8 e5m2fnuz.
    kDLFloat8_e5m2fnuz = 13,
    /// FP8 e8m0fnu.
    kDLFloat8_e8m0fnu = 14,
    /// FP6 e2m3fn.
    kDLFloat6_e2m3fn = 15,
    /// FP6 e3m2fn.
    kDLFloat6_e3m2fn = 16,
    /// FP4 e2m1fn.
    kDLFloat4_e2m1fn = 17,
}

/// DLPack: an element type (`code` is a `DLDataTypeCode`).
#[cfg(not(dlpack_h_included))]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLDataType {
    /// Type code (`DLDataTypeCode`).
    pub code: u8,
    /// Bits per lane (8, 16, 32, 64 …).
    pub bits: u8,
    /// Lanes (1 for scalars).
    pub lanes: u16,
}

/// DLPack: a tensor view (no ownership).
#[cfg(not(dlpack_h_included))]
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// The first element (strata sets `byte_offset` to 0).
    pub data: *mut c_void,
    /// Where `data` lives.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides in elements.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// DLPack: a tensor with its owner's context and deleter (the legacy,
/// unversioned exchange struct).
#[cfg(not(dlpack_h_included))]
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Frees the tensor (and `self`); the consumer calls it exactly once.
    pub deleter: Option<unsafe extern "C" fn(self_: *mut DLManagedTensor)>,
}

/// A DLPack tensor and what keeps its memory valid, in one allocation (the
/// tensor first, so that the two share an address).
#[repr(C)]
struct Managed {
    tensor: DLManagedTensor,
    shape: [i64; 1],
    strides: [i64; 1],
    /// Taken (the range unpinned) when the tensor is deleted.
    pin: Option<OwnedPin>,
}

/// Tensors handed out and not yet deleted, by address: a deleter called
/// twice, or with a stranger's pointer, is refused instead of freeing.
static TENSORS: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

/// Deleted tensors' boxes (their pins already ended), by address, held
/// back so that a second delete is refused rather than deleting a newer
/// tensor at the same address.
static DELETED: Mutex<Quarantine<usize>> = Mutex::new(Quarantine::new());

fn delete(t: *mut DLManagedTensor) -> R<()> {
    if t.is_null() {
        return Ok(());
    }
    let known = TENSORS.lock().remove(&t.addr());
    if !known {
        return Err(Fail::new(
            STRATA_ERR_INVALID_HANDLE,
            format!("{t:p} is not a DLPack tensor strata exported, or it was deleted already"),
        ));
    }
    let m = t.cast::<Managed>();
    // SAFETY: registered by `strata_dlpack_export` as a `Box<Managed>` whose
    // first field is this tensor, and removed from the registry just now: no
    // one else takes it, and C's pointer to it is the consumer's last.
    drop(unsafe { (*m).pin.take() });
    let gone = DELETED
        .lock()
        .hold(m.expose_provenance(), std::mem::size_of::<Managed>());
    for addr in gone {
        // SAFETY: each a `Box<Managed>` from `strata_dlpack_export`, removed
        // from the registry when deleted and held only by the quarantine,
        // which let it go just now: taken back exactly once.
        drop(unsafe { cast::box_from_raw(std::ptr::with_exposed_provenance_mut::<Managed>(addr)) });
    }
    Ok(())
}

/// The deleter stored in exported tensors.
unsafe extern "C" fn deleter(t: *mut DLManagedTensor) {
    boundary_void("DLManagedTensor.deleter", || delete(t));
}

/// The bytes of one element of `dtype` (all lanes), or why strata cannot
/// export it.
fn element_bytes(dtype: DLDataType) -> Result<u64> {
    if dtype.code > DLDataTypeCode::kDLFloat4_e2m1fn as u8 {
        return Err(Error::invalid(format!(
            "unknown DLPack type code {}",
            dtype.code
        )));
    }
    if dtype.bits == 0 || dtype.lanes == 0 {
        return Err(Error::invalid(format!(
            "DLPack type of {} bits × {} lanes: no element has none",
            dtype.bits, dtype.lanes
        )));
    }
    if dtype.bits % 8 != 0 {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "DLPack type of {} bits × {} lanes: only whole bytes",
                dtype.bits, dtype.lanes
            ),
        ));
    }
    Ok(u64::from(dtype.bits / 8) * u64::from(dtype.lanes))
}

/// Checks that `offset..offset + len` can be exported as elements of
/// `dtype` (a whole, non-zero number of them, starting at a multiple of the
/// scalar size) and returns how many elements that is.
pub fn dlpack_elements(offset: u64, len: u64, dtype: DLDataType) -> Result<i64> {
    let elem = element_bytes(dtype)?;
    if len == 0 || len % elem != 0 {
        return Err(Error::invalid(format!(
            "length {len} is not a whole, non-zero number of {elem}-byte elements"
        )));
    }
    let scalar = u64::from(dtype.bits / 8);
    if offset % scalar != 0 {
        return Err(Error::invalid(format!(
            "offset {offset} is not aligned to the element's {scalar} bytes"
        )));
    }
    i64::try_from(len / elem).map_err(|_| Error::invalid("too many elements"))
}

/// The DLPack device of memory pinned in `tier` of `rt`: `kDLCUDA` (device
/// 0) for the device tier on CUDA, `kDLCPU` for host and CXL memory — and
/// for the simulated device, whose memory is host memory.
pub fn dlpack_device(rt: &Runtime, tier: Tier) -> DLDevice {
    match (tier, rt.device_backend()) {
        (Tier::Device, Some(BackendKind::Cuda)) => DLDevice {
            device_type: DLDeviceType::kDLCUDA,
            device_id: 0,
        },
        _ => DLDevice {
            device_type: DLDeviceType::kDLCPU,
            device_id: 0,
        },
    }
}

/// Pins `offset..offset + len` of `buffer` (a buffer of `rt`) in `tier` and
/// returns a DLPack tensor over it, as [`strata_dlpack_export`] describes:
/// the logic of that function for Rust callers (the Python binding wraps
/// the tensor in a `"dltensor"` capsule). The tensor is the caller's: the
/// range stays pinned until its `deleter` is called, exactly once, from any
/// thread (the deleter needs no lock of the caller's, Python's GIL
/// included). With `writable` false the tensor's pin is a read pin
/// ([`Buffer::pin_read`]): the pages' clean copies in slower tiers stay
/// valid, and whoever holds the tensor must not write through it.
pub fn dlpack_export_pinned(
    rt: &Runtime,
    buffer: &Arc<Buffer>,
    offset: u64,
    len: u64,
    tier: Tier,
    dtype: DLDataType,
    writable: bool,
) -> Result<NonNull<DLManagedTensor>> {
    let elements = dlpack_elements(offset, len, dtype)?;
    let end = offset
        .checked_add(len)
        .ok_or_else(|| Error::invalid(format!("offset {offset} + length {len} overflows")))?;
    let page = rt.page_size() as u64;
    let pin = if writable {
        buffer.pin_owned(offset..end, tier)?
    } else {
        buffer.pin_read_owned(offset..end, tier)?
    };
    let addresses = pin.addresses();
    if let Some(i) = addresses.windows(2).position(|w| w[1] != w[0] + page) {
        let first = pin.pages().start;
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "pages {} and {} of the range are not adjacent in the {tier} tier: export page by page",
                first + i,
                first + i + 1
            ),
        ));
    }
    let data = cast::address_ptr(addresses[0] + offset % page);
    let managed = Box::new(Managed {
        tensor: DLManagedTensor {
            dl_tensor: DLTensor {
                data,
                device: dlpack_device(rt, tier),
                ndim: 1,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(deleter),
        },
        shape: [elements],
        strides: [1],
        pin: Some(pin),
    });
    let p = cast::box_into_raw(managed);
    // SAFETY: `p` is the live box just made; nothing else refers to it.
    let m = unsafe { &mut *p };
    m.tensor.dl_tensor.shape = m.shape.as_mut_ptr();
    m.tensor.dl_tensor.strides = m.strides.as_mut_ptr();
    m.tensor.manager_ctx = p.cast();
    let tensor = p.cast::<DLManagedTensor>();
    TENSORS.lock().insert(tensor.addr());
    Ok(NonNull::new(tensor).expect("a box is never NULL"))
}

/// Pins `offset..offset + len` of the buffer in `tier` and stores in `*out`
/// a DLPack tensor over it: one dimension of `len / element size` elements
/// of the type `dtype_code`/`dtype_bits`/`dtype_lanes` (the fields of a
/// `DLDataType`, e.g. `kDLFloat, 32, 1`), contiguous, `byte_offset` 0.
/// (The type comes as three integers because `dlpack.h` declares
/// `DLDataType` as an unnamed struct, which C++ cannot name as
/// `struct DLDataType`.) The device is `kDLCUDA` (device
/// 0) for the device tier on CUDA, `kDLCPU` for host and CXL — and for the
/// simulated device, whose memory is host memory. The range must hold a
/// whole number of elements, start at a multiple of the element size, and
/// lie on pages that are adjacent in the tier: a range within one page
/// always is; one across pages whose slots are not adjacent gives
/// `STRATA_ERR_UNSUPPORTED` (export it page by page), as does an element
/// of bits that are not whole bytes (a type of no bits or no lanes is
/// `STRATA_ERR_INVALID_ARGUMENT`). NVMe has no address.
///
/// Ownership passes to the caller: the range stays pinned (and its buffer,
/// even if freed, and its runtime, even if destroyed, keep the memory)
/// until the tensor's `deleter` is called — exactly once, from any thread,
/// by the consumer (`at::fromDLPack` does it when the tensor dies), or via
/// `strata_dlpack_free`. Writes through strata reach the memory in place.
/// Thread-safe.
///
/// # Safety
/// `out` is NULL or points to a writable `DLManagedTensor *`.
#[no_mangle]
pub unsafe extern "C" fn strata_dlpack_export(
    buf: *const strata_buffer,
    offset: u64,
    len: u64,
    tier_in: strata_tier,
    dtype_code: u8,
    dtype_bits: u8,
    dtype_lanes: u16,
    out: *mut *mut DLManagedTensor,
) -> c_int {
    let dtype = DLDataType {
        code: dtype_code,
        bits: dtype_bits,
        lanes: dtype_lanes,
    };
    boundary("strata_dlpack_export", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(out, "out") }?;
        let t = tier(tier_in)?;
        let b = objects::get(buf)?;
        let tensor = dlpack_export_pinned(&b.rt.rt, &b.buffer, offset, len, t, dtype, true)?;
        out.set(tensor.as_ptr());
        Ok(STRATA_OK)
    })
}

/// Deletes a tensor from `strata_dlpack_export` that was not handed to a
/// consumer (the same as calling its deleter). NULL is a no-op; a pointer
/// strata did not export, or one already deleted, is refused with
/// `STRATA_ERR_INVALID_HANDLE` (never freed) — a deleted one while strata
/// still holds its memory back: until 256 later tensors were deleted, after
/// which its address may be a newer tensor's. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_dlpack_free(tensor: *mut DLManagedTensor) -> c_int {
    boundary("strata_dlpack_free", || {
        delete(tensor)?;
        Ok(STRATA_OK)
    })
}
