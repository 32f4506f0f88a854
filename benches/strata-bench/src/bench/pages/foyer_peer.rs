//! foyer's hybrid cache, `strata bench pages`' third configuration (the
//! `foyer` cargo feature): `--dram` bytes of in-memory cache (weighted by
//! the values' bytes), its block engine on a direct-I/O device in `--path`
//! twice the data's size (so it need not drop pages for room), foyer's
//! defaults otherwise (eviction policy, write-on-eviction, I/O engine). A
//! miss reads the page from the data file (O_DIRECT) and inserts it;
//! reads come from the same threads as strata's, through `get_or_fetch`.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use foyer::{
    BlockEngineConfig, DeviceBuilder, FsDeviceBuilder, HybridCache, HybridCacheBuilder, Source,
};

use super::{data_file, drive, open_direct, read_source, PagesParams, PagesResult};
use strata::error::{Error, ErrorKind, Result};
use strata::io::AlignedBuf;

fn foyer_err(what: &str) -> impl Fn(foyer::Error) -> Error + '_ {
    move |e| Error::new(ErrorKind::Io, format!("foyer: {what}: {e}"))
}

pub(super) fn run(p: &PagesParams, seq: &[u32], trial: usize) -> Result<PagesResult> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(p.threads)
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting a tokio runtime for foyer", e))?;
    let dir = p
        .path
        .join(format!("strata-bench-foyer-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let disk_cache = (2 * p.data) as usize;
    let device = FsDeviceBuilder::new(&dir)
        .with_capacity(disk_cache)
        .with_direct(true)
        .build()
        .map_err(foyer_err("its device"))?;
    let cache: HybridCache<u32, Vec<u8>> = runtime
        .block_on(
            HybridCacheBuilder::new()
                .memory(p.dram as usize)
                .with_weighter(|_: &u32, v: &Vec<u8>| v.len())
                .storage()
                .with_engine_config(BlockEngineConfig::new(device))
                .build(),
        )
        .map_err(foyer_err("building the cache"))?;
    let source = Arc::new(open_direct(&data_file(p))?);
    let fetched: Vec<AtomicBool> = (0..p.data_pages())
        .map(|_| AtomicBool::new(false))
        .collect();
    let (from_disk, refetched) = (AtomicU64::new(0), AtomicU64::new(0));
    let ps = p.page_size;
    let handle = runtime.handle().clone();
    let disk0 = super::DiskIo::now()?;
    let run = drive(p, seq, &|| Ok(()), &|_, page, off, out| {
        let q = page as u32;
        let (file, params) = (source.clone(), p.clone());
        let entry = handle
            .block_on(cache.get_or_fetch(&q, move || async move {
                let mut buf = AlignedBuf::new(params.page_size).map_err(std::io::Error::other)?;
                read_source(&file, &params, page, &mut buf).map_err(std::io::Error::other)?;
                Ok::<Vec<u8>, std::io::Error>(buf[..params.page_size].to_vec())
            }))
            .map_err(foyer_err("get_or_fetch"))?;
        out.copy_from_slice(&entry.value()[off..off + out.len()]);
        match entry.source() {
            Source::Memory => return Ok(true),
            Source::Disk => {
                from_disk.fetch_add(1, Ordering::Relaxed);
            }
            Source::Outer => {
                if fetched[page as usize].swap(true, Ordering::Relaxed) {
                    refetched.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        debug_assert_eq!(entry.value().len(), ps);
        Ok(false)
    });
    // After close: the flushes it waits for count.
    let closed = runtime.block_on(cache.close());
    let disk = disk0.since()?;
    drop(cache);
    let _ = std::fs::remove_dir_all(&dir);
    let (tally, seconds) = run?;
    closed.map_err(foyer_err("closing"))?;
    let lost = refetched.load(Ordering::Relaxed);
    let note = format!(
        "HybridCache<u32, Vec<u8>>: memory {} bytes weighted by value size, block engine on a direct-I/O device of {} bytes, defaults otherwise; {} reads from its disk cache, {} pages fetched from the data file again after it dropped them",
        p.dram,
        disk_cache,
        from_disk.load(Ordering::Relaxed),
        lost
    );
    Ok(super::finish(
        "foyer", trial, tally, seconds, disk, lost, note,
    ))
}
