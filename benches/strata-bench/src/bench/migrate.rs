//! `strata bench migrate`: page migration through the runtime, per link and
//! page size, beside the raw throughput of the same link measured in the
//! same run: memcpy for DRAM↔DRAM-like links (emulated CXL: its cap), the
//! io engine at full queue depth for NVMe, and for the device the backend's
//! own copies (on the simulated device: its link model's bandwidth, in
//! modelled time).

use std::time::Instant;

use serde::Serialize;

use strata::device::DeviceChoice;
use strata::error::{Error, Result};
use strata::io::{AlignedBuf, IoOp};
use strata::runtime::{Placement, Runtime};
use strata::tier::{CxlConfig, CxlMode, NvmeConfig, NvmeStore, PageStore, Slot, Tier};

/// Parameters.
#[derive(Debug, Clone, Serialize)]
pub struct MigrateParams {
    /// Device backend.
    pub device: DeviceChoice,
    /// Page sizes to measure.
    pub page_sizes: Vec<usize>,
    /// Bytes migrated per case.
    pub size: u64,
    /// Directory for the NVMe tier.
    pub path: std::path::PathBuf,
}

/// One case (the JSON keys `link`, `page_size`, `bytes_per_sec`,
/// `raw_bytes_per_sec` are a stable interface).
#[derive(Debug, Clone, Serialize)]
pub struct MigrateCase {
    /// e.g. `host->nvme`.
    pub link: String,
    /// Page size.
    pub page_size: usize,
    /// Migration throughput through the runtime.
    pub bytes_per_sec: f64,
    /// The same link's raw throughput, same run.
    pub raw_bytes_per_sec: f64,
    /// `bytes_per_sec / raw_bytes_per_sec`.
    pub ratio: f64,
    /// "wall", or "modelled" for the simulated device's link.
    pub time: &'static str,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct MigrateReport {
    /// "simulated" or "cuda".
    pub backend: &'static str,
    /// Whether the CXL tier is emulated.
    pub cxl_emulated: bool,
    /// Cases.
    pub cases: Vec<MigrateCase>,
    /// Parameters.
    pub params: MigrateParams,
}

fn rate(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-12)
}

/// Runs every case.
pub fn run(params: &MigrateParams, progress: &mut dyn FnMut(&str, f64)) -> Result<MigrateReport> {
    // Per page size: the host, emulated CXL and simulated device tiers
    // each hold --size, beside the source data.
    crate::machine::check_memory(
        format_args!("--size {}", params.size),
        "the host, CXL and device tiers and the data, each --size",
        params.size.saturating_mul(4),
    )?;
    let mut cases = Vec::new();
    let mut backend = "simulated";
    for (i, &page) in params.page_sizes.iter().enumerate() {
        progress("migrate", i as f64 / params.page_sizes.len() as f64);
        strata::size::check_page_size(page)?;
        let pages = (params.size / page as u64).max(1);
        let bytes = pages * page as u64;
        let mut cxl = CxlConfig::new(CxlMode::Emulated, bytes, page);
        cxl.bandwidth = None;
        let rt = Runtime::builder()
            .page_size(page)
            .device(params.device, bytes)
            .host(bytes)
            .cxl(cxl)
            .nvme(NvmeConfig::new(
                &params.path,
                (bytes + 128 * page as u64).next_multiple_of(page as u64),
                page,
            ))
            // Only the measured moves: the reclaimer would move pages too.
            .background_eviction(false)
            .build()?;
        backend = rt.device_backend().map_or("none", |b| b.label());
        let buf = rt.alloc_with(bytes, Placement::Prefer(Tier::Host))?;
        let fill = vec![0x5a; bytes as usize];
        buf.write(0, &fill)?;
        let all = 0..bytes;
        let sim = backend == "simulated";
        // One untimed round trip through every tier first, so the timed
        // passes reuse slots whose memory is already faulted in (a fresh
        // arena's first touch costs more than the copy) and measure the
        // steady state.
        for tier in [Tier::Device, Tier::Cxl, Tier::Nvme] {
            buf.prefetch(all.clone(), tier).wait()?;
            buf.prefetch(all.clone(), Tier::Host).wait()?;
        }

        // host <-> device.
        let links = |rt: &Runtime| rt.stats().device_links.unwrap_or_default();
        let before = links(&rt);
        let t = Instant::now();
        buf.prefetch(all.clone(), Tier::Device).wait()?;
        let wall_up = t.elapsed().as_secs_f64();
        let up_links = links(&rt);
        // Written on the device (untimed), so the way down copies: a page
        // whose host copy is still clean would go back to it for free.
        buf.write(0, &fill)?;
        let mid = links(&rt);
        let t = Instant::now();
        buf.evict(all.clone(), Tier::Host)?;
        let wall_down = t.elapsed().as_secs_f64();
        let after = links(&rt);
        let (up, down) = if sim {
            (
                rate(
                    bytes,
                    up_links.0.modelled_seconds - before.0.modelled_seconds,
                ),
                rate(bytes, after.1.modelled_seconds - mid.1.modelled_seconds),
            )
        } else {
            (rate(bytes, wall_up), rate(bytes, wall_down))
        };
        // The raw link: on the simulated device, the model's bandwidth; on a
        // GPU, the backend's own copies inside these moves, per direction
        // (from the registered host arena, one page per synchronized copy;
        // not yet a separate whole-buffer `cudaMemcpyAsync` peer).
        let (raw_up, raw_down) = if sim {
            let b = strata::lowlevel::PCIE_GEN4_X16.bandwidth;
            (b, b)
        } else {
            (
                rate(
                    up_links.0.bytes - before.0.bytes,
                    up_links.0.wall_seconds - before.0.wall_seconds,
                ),
                rate(
                    after.1.bytes - mid.1.bytes,
                    after.1.wall_seconds - mid.1.wall_seconds,
                ),
            )
        };
        let time = if sim { "modelled" } else { "wall" };
        let mut push = |link: &str, r: f64, raw: f64, time: &'static str| {
            cases.push(MigrateCase {
                link: link.into(),
                page_size: page,
                bytes_per_sec: r,
                raw_bytes_per_sec: raw,
                ratio: r / raw,
                time,
            })
        };
        push("host->device", up, raw_up, time);
        push("device->host", down, raw_down, time);

        // host <-> cxl (emulated: the cap is the link's limit).
        let cap = strata::lowlevel::local_memcpy_bandwidth()
            * strata::tier::CXL_DEFAULT_BANDWIDTH_FRACTION;
        // Down to `tier` and back up to host, each timed; written first
        // (untimed) so the way down copies rather than going back to a
        // clean copy.
        let round_trip = |tier: Tier| -> Result<(f64, f64)> {
            buf.write(0, &fill)?;
            let t = Instant::now();
            buf.evict(all.clone(), tier)?;
            let down = rate(bytes, t.elapsed().as_secs_f64());
            let t = Instant::now();
            buf.prefetch(all.clone(), Tier::Host).wait()?;
            Ok((down, rate(bytes, t.elapsed().as_secs_f64())))
        };
        let (down, up) = round_trip(Tier::Cxl)?;
        push("host->cxl", down, cap, "wall");
        push("cxl->host", up, cap, "wall");

        // host <-> nvme, against the io engine at depth 32 on a store of the
        // same geometry.
        let (down, up) = round_trip(Tier::Nvme)?;
        drop(buf);
        drop(rt);
        let (raw_write, raw_read) = raw_nvme(&params.path, pages as u32, page)?;
        push("host->nvme", down, raw_write, "wall");
        push("nvme->host", up, raw_read, "wall");
    }
    progress("migrate", 1.0);
    Ok(MigrateReport {
        backend,
        cxl_emulated: true,
        cases,
        params: params.clone(),
    })
}

/// Writes (twice, timing the second) then reads `pages` pages through an
/// NVMe session at depth 32.
fn raw_nvme(path: &std::path::Path, pages: u32, page: usize) -> Result<(f64, f64)> {
    let mut cfg = NvmeConfig::new(path, (pages as u64 + 128) * page as u64, page);
    cfg.queue_depth = 32;
    let store = NvmeStore::new(&cfg)?;
    let mut slots: Vec<Option<Slot>> = (0..pages)
        .map(|_| store.alloc().map(Some))
        .collect::<Result<_>>()?;
    let mut bufs: Vec<AlignedBuf> = (0..32).map(|_| store.buffer()).collect::<Result<_>>()?;
    // A write pass untimed first: a fresh file's first writes convert
    // unwritten extents, which the runtime's warmed-up tier does not pay.
    let mut timings = [0f64; 3];
    for (k, op) in [IoOp::Write, IoOp::Write, IoOp::Read]
        .into_iter()
        .enumerate()
    {
        let mut session = store.session()?;
        let t = Instant::now();
        super::sequential_pass(
            &mut session,
            &mut slots,
            &mut bufs,
            op,
            &mut |_| {},
            &mut |_| {},
        )?;
        timings[k] = t.elapsed().as_secs_f64();
    }
    for slot in slots.into_iter().flatten() {
        store.free(slot)?;
    }
    let bytes = pages as u64 * page as u64;
    if timings.iter().any(|&t| t <= 0.0) {
        return Err(Error::invalid("raw nvme run took no time"));
    }
    Ok((rate(bytes, timings[1]), rate(bytes, timings[2])))
}
