//! Run-time compilation of `kernels/*.cu` with NVRTC: one function and one
//! set of options for every kernel, used by the runtime and by
//! `tests/kernels.rs`, which compiles every file in `kernels/` in CI with
//! the real NVRTC (no GPU needed) so a kernel that does not compile fails
//! there, not on a user's GPU.

use std::ffi::{c_char, CString};

use cudarc::nvrtc::{result, sys};

use super::errors::no_device;
use crate::error::{Error, ErrorKind, Result};

/// `include/strata_device.cuh`, substituted for its `#include` line (the
/// runtime has no include directory to point NVRTC at).
const DEVICE_HEADER: &str = include_str!("../../../include/strata_device.cuh");

/// The options every kernel is compiled with: fp32 arithmetic as on the
/// CPU. No contraction of a multiply and an add into an FMA
/// (`--fmad=false`; kernels that want an FMA write `fmaf`), IEEE
/// round-to-nearest division and square root, denormals kept. The
/// offloaded Adam's kernel relies on this to match the CPU update bit for
/// bit. No `--gpu-architecture`: the PTX targets NVRTC's default virtual
/// architecture, which the driver JIT-compiles for whatever GPU loads it.
pub const OPTIONS: &[&str] = &[
    "--ftz=false",
    "--prec-sqrt=true",
    "--prec-div=true",
    "--fmad=false",
];

/// PTX text, as NVRTC writes it and the driver loads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ptx(String);

impl Ptx {
    /// PTX from its text.
    pub fn from_src(src: impl Into<String>) -> Self {
        Self(src.into())
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A copy of the text.
    pub fn to_src(&self) -> String {
        self.0.clone()
    }
}

/// A compiled kernel source: its PTX and NVRTC's log (warnings; empty for
/// a clean source).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Compiled {
    /// The PTX.
    pub ptx: Ptx,
    /// NVRTC's log, trimmed.
    pub log: String,
}

/// Whether the NVRTC library can be loaded (cudarc panics on the first call
/// into a library it cannot load).
pub fn available() -> bool {
    // SAFETY: only tries to load the NVRTC library; calls nothing in it.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's (major, minor) version, where the library loads.
pub fn version() -> Option<(i32, i32)> {
    if !available() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded (checked above); both pointers are to
    // live c_ints this call may write.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    (r == sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
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
/// to PTX with [`OPTIONS`]. `NoDevice` when NVRTC is absent; `Io` with
/// NVRTC's log when the source does not compile.
pub fn compile(name: &str, source: &str) -> Result<Ptx> {
    compile_with_log(name, source).map(|c| c.ptx)
}

/// [`compile`], also returning NVRTC's log where the source compiles
/// (warnings count: CI wants none).
pub fn compile_with_log(name: &str, source: &str) -> Result<Compiled> {
    if !available() {
        return Err(no_device("the NVRTC library (libnvrtc.so) is not present"));
    }
    let failed = |what: &str, e: result::NvrtcError| {
        Error::new(ErrorKind::Io, format!("compiling {name}: {what}: {e:?}"))
    };
    let src = CString::new(expand_includes(source))
        .map_err(|_| Error::invalid(format!("{name}: the source has a NUL byte")))?;
    let cname = CString::new(name)
        .map_err(|_| Error::invalid(format!("a kernel source name with a NUL byte: {name:?}")))?;
    // Declared after `src` and `cname`, so destroyed before them.
    let program = Program(
        result::create_program(&src, Some(&cname)).map_err(|e| failed("nvrtcCreateProgram", e))?,
    );
    // SAFETY: the program is live until `program` drops, after these calls;
    // the source and name it refers to outlive it.
    let compiled = unsafe { result::compile_program(program.0, OPTIONS) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(program.0) }
        .map(|l| text(&l))
        .unwrap_or_default();
    if compiled.is_err() {
        return Err(Error::new(
            ErrorKind::Io,
            format!("compiling {name}: {log}"),
        ));
    }
    // SAFETY: as above; the program compiled.
    let ptx = unsafe { result::get_ptx(program.0) }.map_err(|e| failed("nvrtcGetPTX", e))?;
    Ok(Compiled {
        ptx: Ptx(text(&ptx)),
        log: log.trim().to_string(),
    })
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// NVRTC's NUL-terminated text as a string.
fn text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
