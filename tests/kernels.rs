//! Every `kernels/*.cu` compiled with the real NVRTC and the runtime's own
//! options (`strata::device::nvrtc`), no GPU needed: a kernel added later
//! is checked without touching this file. Each `__global__` function must be
//! `extern "C"` (the runtime loads kernels by name) and appear as an entry
//! point in the PTX. `include/strata_device.cuh` is compiled through
//! `tests/cuda/device_header.cu`, which calls every function in it.
//!
//! Skipped with a printed note where libnvrtc cannot be loaded;
//! `STRATA_REQUIRE_NVRTC=1` turns the skip into a failure (CI installs
//! NVRTC from PyPI and sets it: see `.ci/run`).
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};

use strata::device::nvrtc;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Whether NVRTC is here; panics when it is required but absent.
fn nvrtc_here() -> bool {
    if nvrtc::available() {
        return true;
    }
    assert!(
        std::env::var_os("STRATA_REQUIRE_NVRTC").is_none(),
        "STRATA_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
    );
    eprintln!("skipping: libnvrtc cannot be loaded (set LD_LIBRARY_PATH to its directory)");
    false
}

/// The names of the `__global__` functions in `source`, each checked to be
/// declared `extern "C"`.
fn entry_points(file: &str, source: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in source.match_indices("__global__") {
        let before = source[..at].trim_end();
        assert!(
            before.ends_with("extern \"C\""),
            "{file}: a __global__ function not declared extern \"C\" (its name would be mangled)"
        );
        let after = source[at + "__global__".len()..].trim_start();
        let after = after
            .strip_prefix("void")
            .unwrap_or_else(|| panic!("{file}: a __global__ function not returning void"))
            .trim_start();
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        assert!(
            !name.is_empty(),
            "{file}: a __global__ function without a name"
        );
        names.push(name);
    }
    names
}

fn compile_and_check(path: &Path, runtime_loads: &[&str]) -> Vec<String> {
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    let source = std::fs::read_to_string(path).unwrap();
    let names = entry_points(&file, &source);
    assert!(
        !names.is_empty(),
        "{file}: no extern \"C\" __global__ kernel"
    );
    // The PTX and NVRTC's log (warnings count too).
    let compiled = nvrtc::compile_with_log(&file, &source).unwrap_or_else(|e| panic!("{e}"));
    let ptx = compiled.ptx.to_src();
    for name in names
        .iter()
        .map(String::as_str)
        .chain(runtime_loads.iter().copied())
    {
        assert!(
            ptx.contains(&format!(".entry {name}(")),
            "{file}: no entry point {name} in the PTX"
        );
    }
    let log = compiled.log;
    assert!(log.is_empty(), "{file}: NVRTC says:\n{log}");
    eprintln!("{file}: {} ({} bytes of PTX)", names.join(", "), ptx.len());
    names
}

/// The kernels the runtime loads by name, per file.
fn runtime_loads(file: &str) -> &'static [&'static str] {
    match file {
        "hotness.cu" => strata::lowlevel::cuda_hotness::ENTRY_POINTS,
        "adam.cu" => strata::lowlevel::cuda_adam::ENTRY_POINTS,
        _ => &[],
    }
}

#[test]
fn every_kernel_compiles_with_the_runtime_options() {
    if !nvrtc_here() {
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("kernels"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    // The runtime's own kernels are among them (the glob found the folder).
    for must in ["hotness.cu", "adam.cu"] {
        assert!(names.iter().any(|n| n == must), "kernels/{must} not found");
    }
    for path in &files {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        compile_and_check(path, runtime_loads(&file));
    }
}

#[test]
fn the_device_header_compiles_and_every_function_is_used() {
    if !nvrtc_here() {
        return;
    }
    let header = std::fs::read_to_string(root().join("include/strata_device.cuh")).unwrap();
    let check_path = root().join("tests/cuda/device_header.cu");
    let check = std::fs::read_to_string(&check_path).unwrap();
    // Every function the header defines is called by the check kernel.
    for line in header.lines() {
        let Some(rest) = line.split("__device__ __forceinline__").nth(1) else {
            continue;
        };
        let name = rest
            .split('(')
            .next()
            .unwrap()
            .split_whitespace()
            .last()
            .unwrap();
        assert!(
            check.contains(&format!("{name}(")) || check.contains(&format!("{name}<")),
            "tests/cuda/device_header.cu does not call {name}"
        );
    }
    compile_and_check(&check_path, &["strata_check_device_header"]);
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_the_log() {
    if !nvrtc_here() {
        return;
    }
    let e = nvrtc::compile(
        "broken.cu",
        "extern \"C\" __global__ void k() { undeclared(); }",
    )
    .unwrap_err();
    assert_eq!(e.kind(), strata::ErrorKind::Io);
    assert!(e.to_string().contains("undeclared"), "{e}");
}

/// What the bitwise match with the CPU update rests on, visible in the PTX:
/// no fused multiply-add on floats (integer `mad.lo` indexing is fine), division and square root rounded to nearest
/// (not the approximate forms), no flush to zero.
#[test]
fn the_adam_kernel_rounds_every_operation_as_the_cpu_does() {
    if !nvrtc_here() {
        return;
    }
    let source = std::fs::read_to_string(root().join("kernels/adam.cu")).unwrap();
    let ptx = nvrtc::compile("adam.cu", &source).unwrap().to_src();
    for bad in [
        "fma.",
        "mad.f32",
        "mad.rn.f32",
        ".approx",
        ".full.f32",
        ".ftz",
    ] {
        assert!(!ptx.contains(bad), "adam.cu's PTX has {bad}");
    }
    assert!(ptx.contains("div.rn.f32") && ptx.contains("sqrt.rn.f32"));
}

/// A source NVRTC cannot take (a NUL byte) is refused as bad input, not a
/// panic; the log of a clean source is empty.
#[test]
fn a_source_with_a_nul_byte_is_refused_and_a_clean_one_logs_nothing() {
    if !nvrtc_here() {
        return;
    }
    let e = nvrtc::compile("nul.cu", "extern \"C\" __global__ void k() {}\0").unwrap_err();
    assert_eq!(e.kind(), strata::ErrorKind::InvalidArgument, "{e}");
    let clean = nvrtc::compile_with_log("k.cu", "extern \"C\" __global__ void k() {}").unwrap();
    assert!(clean.log.is_empty(), "{}", clean.log);
    assert!(clean.ptx.as_str().contains(".entry k("));
}
