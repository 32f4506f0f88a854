//! Run-time compilation of `kernels/*.cu` with NVRTC: one function and one
//! set of options for every kernel, used by the runtime and by
//! `tests/kernels.rs`, which compiles every file in `kernels/` in CI with
//! the real NVRTC (no GPU needed) so a kernel that does not compile fails
//! there, not on a user's GPU.

use cudarc::nvrtc::{CompileOptions, Ptx};

use super::no_device;
use crate::error::{Error, ErrorKind, Result};

/// `include/strata_device.cuh`, substituted for its `#include` line (the
/// runtime has no include directory to point NVRTC at).
const DEVICE_HEADER: &str = include_str!("../../include/strata_device.cuh");

/// The NVRTC options every kernel is compiled with (see [`options`]).
pub const OPTIONS: &[&str] = &[
    "--ftz=false",
    "--prec-sqrt=true",
    "--prec-div=true",
    "--fmad=false",
];

/// The options every kernel is compiled with ([`OPTIONS`]). fp32 arithmetic as on the
/// CPU: no contraction of a multiply and an add into an FMA (`--fmad=false`;
/// kernels that want an FMA write `fmaf`), IEEE round-to-nearest division
/// and square root, denormals kept. The offloaded Adam's kernel relies on
/// this to match the CPU update bit for bit. No `--gpu-architecture`: the
/// PTX targets NVRTC's default virtual architecture, which the driver
/// JIT-compiles for whatever GPU loads it.
pub fn options(name: &str) -> CompileOptions {
    CompileOptions {
        options: OPTIONS.iter().map(|o| o.to_string()).collect(),
        name: Some(name.to_string()),
        ..Default::default()
    }
}

/// Whether the NVRTC library can be loaded (cudarc panics on the first call
/// into a library it cannot load).
pub fn available() -> bool {
    // SAFETY: only tries to load the NVRTC library; calls nothing in it.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's (major, minor) version, where the library loads.
pub fn version() -> Option<(i32, i32)> {
    if !available() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded (checked above); both pointers are to
    // live c_ints this call may write.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// `source` with `#include "strata_device.cuh"` (or `<…>`) replaced by the
/// header's text.
pub fn expand_includes(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    for line in source.lines() {
        let t = line.trim();
        if t == "#include \"strata_device.cuh\"" || t == "#include <strata_device.cuh>" {
            out.push_str(DEVICE_HEADER);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// Compiles the kernel source `source` (named `name` in NVRTC's messages)
/// to PTX with [`options`]. `NoDevice` when NVRTC is absent; `Io` with
/// NVRTC's log when the source does not compile.
pub fn compile(name: &str, source: &str) -> Result<Ptx> {
    if !available() {
        return Err(no_device("the NVRTC library (libnvrtc.so) is not present"));
    }
    cudarc::nvrtc::compile_ptx_with_opts(expand_includes(source), options(name)).map_err(|e| {
        let detail = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        Error::new(ErrorKind::Io, format!("compiling {name}: {detail}"))
    })
}
