//! `strata bench copy`: page copies between the memory tiers beside a plain
//! memcpy of the same bytes between the same arenas, in the same run.
//!
//! Each case copies every page of a source arena into a destination arena
//! through the stores' page-copy path, and separately copies the same number
//! of bytes with one `memcpy` between two other arenas made the same way.
//! Rounds alternate between the two and the median of each is reported, so
//! both see the same machine conditions.

use std::time::Instant;

use serde::Serialize;

use super::median;
use strata::error::Result;
use strata::lowlevel::Arena;
use strata::sys::Topology;
use strata::tier::{
    CxlConfig, CxlMode, CxlStore, HostConfig, HostStore, LinkModel, PageStore, Slot,
};

/// Parameters of the copy benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct CopyParams {
    /// Bytes copied per round (per arena).
    pub size: u64,
    /// Page sizes to measure.
    pub page_sizes: Vec<usize>,
    /// Rounds per case (the median is reported).
    pub rounds: usize,
    /// CXL tier to use: real where present (`Auto`), or emulated.
    pub cxl_mode: CxlMode,
    /// Emulated CXL bandwidth cap (bytes/s); `None` = half of local memcpy.
    pub cxl_bandwidth: Option<f64>,
    /// Emulated CXL added latency, ns.
    pub cxl_latency_ns: u64,
}

/// One measured case.
#[derive(Debug, Clone, Serialize)]
pub struct CopyCase {
    /// `dram->dram`, `dram->cxl` or `cxl->dram`.
    pub link: String,
    /// Page size.
    pub page_size: usize,
    /// Page-copy throughput through the stores.
    pub bytes_per_sec: f64,
    /// One plain memcpy of as many bytes, between two arenas made like the
    /// stores', in the same run.
    pub memcpy_bytes_per_sec: f64,
    /// The most this link can do: memcpy, or the emulated cap if lower.
    pub limit_bytes_per_sec: f64,
    /// `bytes_per_sec / limit_bytes_per_sec`.
    pub ratio: f64,
    /// Whether the CXL side is emulated.
    pub emulated: bool,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct CopyReport {
    /// No device is involved.
    pub backend: &'static str,
    /// The CXL tier used: "numa node N" or "emulated".
    pub cxl: String,
    /// The emulation model, if emulated.
    pub cxl_emulation: Option<LinkModel>,
    /// Cases.
    pub cases: Vec<CopyCase>,
    /// Parameters.
    pub params: CopyParams,
}

/// Runs every case; `progress` is told each case as it starts.
pub fn run(params: &CopyParams, progress: &mut dyn FnMut(&str, f64)) -> Result<CopyReport> {
    let rounds = params.rounds.max(1);
    let mut cases = Vec::new();
    let mut cxl_desc = String::new();
    let mut cxl_emulation = None;
    let total = params.page_sizes.len() * 3;
    // Two host stores, the CXL store and memcpy's two arenas, each --size.
    crate::machine::check_memory(
        format_args!("--size {}", params.size),
        "five buffers of --size: two host, one CXL, memcpy's two",
        params.size.saturating_mul(5),
    )?;
    for (pi, &page_size) in params.page_sizes.iter().enumerate() {
        let host_a = HostStore::new(&HostConfig::new(params.size, page_size))?;
        let host_b = HostStore::new(&HostConfig::new(params.size, page_size))?;
        let mut cxl_cfg = CxlConfig::new(params.cxl_mode, params.size, page_size);
        cxl_cfg.bandwidth = params.cxl_bandwidth;
        cxl_cfg.latency_ns = params.cxl_latency_ns;
        let cxl = CxlStore::new(&cxl_cfg, &Topology::detect())?;
        cxl_emulation = cxl.emulation();
        cxl_desc = match cxl.numa_node() {
            Some(n) if !cxl.emulated() => format!("numa node {n}"),
            _ => "emulated".into(),
        };
        let pages = host_a.capacity_pages();
        let alloc_all =
            |s: &dyn PageStore| (0..pages).map(|_| s.alloc()).collect::<Result<Vec<Slot>>>();
        let mut a = alloc_all(&host_a)?;
        let mut b = alloc_all(&host_b)?;
        let mut c = alloc_all(&cxl)?;
        // Touch every page first so no case pays for page faults.
        for (i, slot) in a.iter_mut().enumerate() {
            host_a.bytes_mut(slot)?.fill(i as u8 | 1);
        }
        for slot in b.iter_mut() {
            host_b.bytes_mut(slot)?.fill(0);
        }
        for slot in c.iter_mut() {
            cxl.as_host().bytes_mut(slot)?.fill(0);
        }
        let bytes = pages as f64 * page_size as f64;
        let limit_cap = cxl.emulation().map(|m| m.bandwidth);

        // The peer: one memcpy of the same bytes between two arenas made
        // like the stores' (2 MiB aligned, THP where allowed), both touched
        // first. (On a real CXL node this is DRAM to DRAM, an upper bound for
        // the CXL links.)
        let mut peer_src = Arena::new(bytes as usize, true, None)?;
        let mut peer_dst = Arena::new(bytes as usize, true, None)?;
        peer_src.as_mut_slice().fill(1);
        peer_dst.as_mut_slice().fill(0);
        let mut memcpy = || {
            let len = bytes as usize;
            let src = &peer_src.as_mut_slice()[..len];
            let t = Instant::now();
            peer_dst.as_mut_slice()[..len].copy_from_slice(std::hint::black_box(src));
            let rate = bytes / t.elapsed().as_secs_f64();
            std::hint::black_box(peer_dst.as_mut_slice());
            rate
        };

        type CaseFn<'a> = Box<dyn FnMut() -> Result<f64> + 'a>;
        let (a_ref, b_ref, c_ref) = (&mut a, &mut b, &mut c);
        let mut run_case = |link: &str, mut paged: CaseFn<'_>, cap: Option<f64>| -> Result<()> {
            progress(link, (pi * 3 + cases.len() % 3) as f64 / total as f64);
            let mut paged_rates = Vec::new();
            let mut memcpy_rates = Vec::new();
            for _ in 0..rounds {
                paged_rates.push(paged()?);
                memcpy_rates.push(memcpy());
            }
            let rate = median(&mut paged_rates);
            let memcpy_rate = median(&mut memcpy_rates);
            let limit = cap.map_or(memcpy_rate, |c| c.min(memcpy_rate));
            cases.push(CopyCase {
                link: link.into(),
                page_size,
                bytes_per_sec: rate,
                memcpy_bytes_per_sec: memcpy_rate,
                limit_bytes_per_sec: limit,
                ratio: rate / limit,
                emulated: cap.is_some() && link != "dram->dram",
            });
            Ok(())
        };
        {
            let (ha, hb) = (&host_a, &host_b);
            let (sa, sb) = (&*a_ref, &mut *b_ref);
            run_case(
                "dram->dram",
                Box::new(move || {
                    let t = Instant::now();
                    for (s, d) in sa.iter().zip(sb.iter_mut()) {
                        ha.copy_page(s, hb, d)?;
                    }
                    Ok(bytes / t.elapsed().as_secs_f64())
                }),
                None,
            )?;
        }
        {
            let (ha, cx) = (&host_a, &cxl);
            let (sa, sc) = (&*a_ref, &mut *c_ref);
            run_case(
                "dram->cxl",
                Box::new(move || {
                    let t = Instant::now();
                    for (s, d) in sa.iter().zip(sc.iter_mut()) {
                        cx.copy_from_host(ha, s, d)?;
                    }
                    Ok(bytes / t.elapsed().as_secs_f64())
                }),
                limit_cap,
            )?;
        }
        {
            let (hb, cx) = (&host_b, &cxl);
            let (sc, sb) = (&*c_ref, &mut *b_ref);
            run_case(
                "cxl->dram",
                Box::new(move || {
                    let t = Instant::now();
                    for (s, d) in sc.iter().zip(sb.iter_mut()) {
                        cx.copy_to_host(s, hb, d)?;
                    }
                    Ok(bytes / t.elapsed().as_secs_f64())
                }),
                limit_cap,
            )?;
        }
        for s in a {
            host_a.free(s)?;
        }
        for s in b {
            host_b.free(s)?;
        }
        for s in c {
            cxl.free(s)?;
        }
    }
    Ok(CopyReport {
        backend: "none (memory only)",
        cxl: cxl_desc,
        cxl_emulation,
        cases,
        params: params.clone(),
    })
}
