//! The NVMe store: page-aligned slots in an O_DIRECT file or block device,
//! over an [`IoEngine`]. Every page written carries a checksum (XXH3,
//! 62 bits kept) in the store's metadata; a read that does not match is a
//! `Corrupted` error, never bad data. Pages larger than 4 KiB also keep a
//! 32-bit XXH3 per 4 KiB sector (4 bytes of DRAM per sector, 0.1% of the
//! tier), so a small read ([`PageStore::read_range`]) reads and verifies
//! only the sectors it covers instead of the whole page.
//!
//! Why XXH3 and not CRC32C: the checksum of a page that was just read is
//! computed over memory the device has just written, so it runs from DRAM,
//! not cache. Measured here on 4 KiB pages out of cache, XXH3 takes 200 ns
//! a page and hardware CRC32C 300 ns; at 100 K random reads a second that
//! difference showed up as lost IOPS.
//!
//! The swap file is private: created with mode 0600 and never visible by
//! name (O_TMPFILE in a directory, or created and unlinked at once).

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::slots::{Slot, SlotAllocator};
use super::store::{check_page_len, full_error, PageStore, Tier};
use crate::error::{Error, ErrorKind, Result};
use crate::io::{
    self, AlignedBuf, BufPool, EngineChoice, EngineKind, IoCompletion, IoEngine, IoOp, IoQueue,
    IoRequest,
};
use crate::size::{check_page_size, format_size};

/// How to build an [`NvmeStore`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmeConfig {
    /// A directory (a private swap file is made in it), a file name that
    /// does not exist yet (created, then unlinked), or a block device.
    pub path: PathBuf,
    /// Capacity in bytes: a whole number of pages, at least two (1/64 of
    /// them, at least one, is held back for copy-then-commit writes).
    pub capacity: u64,
    /// Slot size: a power of two, 4 KiB … 2 MiB.
    pub page_size: usize,
    /// io_uring, psync, or auto.
    pub engine: EngineChoice,
    /// Operations in flight per queue.
    pub queue_depth: usize,
    /// Bytes of the store's registered I/O buffers, whole pages, at least
    /// one (64 MiB by default): two per queue slot up to this. An I/O
    /// beyond the pool takes a heap buffer of its own. A caller whose reads
    /// land in its own memory (the expert cache's device slots) needs a
    /// page or two; the pool is resident for the store's life.
    #[serde(default = "default_pool_bytes")]
    pub pool_bytes: u64,
}

/// The registered pool's default size.
pub(crate) const DEFAULT_POOL_BYTES: u64 = 64 << 20;

fn default_pool_bytes() -> u64 {
    DEFAULT_POOL_BYTES
}

impl NvmeConfig {
    /// A config with the automatic engine and queue depth 32.
    pub fn new(path: impl Into<PathBuf>, capacity: u64, page_size: usize) -> Self {
        Self {
            path: path.into(),
            capacity,
            page_size,
            engine: EngineChoice::Auto,
            queue_depth: 32,
            pool_bytes: DEFAULT_POOL_BYTES,
        }
    }
}

/// Slots held back so that a full store can still write a page's new copy
/// before freeing the old one: 1/64 of the store, at least 1, at most 64.
fn reserve_pages(pages: u32) -> u32 {
    (pages / 64).clamp(1, 64)
}

/// Buffers in a store's registered pool: two per queue slot (one in flight,
/// one being filled or verified), at least 16, at most `pool_bytes` of
/// them, and at least one.
fn pool_buffers(page_size: usize, queue_depth: usize, pool_bytes: u64) -> u32 {
    let cap = (pool_bytes / page_size as u64).clamp(1, 1024) as usize;
    (2 * queue_depth).clamp(16, 1024).min(cap) as u32
}

/// Per-slot metadata: empty, torn (a write was started and has not
/// succeeded), or valid with the low 62 bits of the page's XXH3.
const META_EMPTY: u64 = 0;
const META_TORN: u64 = 1 << 62;
const META_VALID: u64 = 1 << 63;
const HASH_MASK: u64 = (1 << 62) - 1;
/// A slot given up to a write that may still land: the engine failed
/// while it was in flight and could not wait for it. Never freed, so never
/// reused under that write.
const META_ABANDONED: u64 = META_TORN | 1;

/// XXH3-64 of `data`, with the fastest vector unit the CPU has (chosen at
/// run time: the build is portable).
fn xxh3(data: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(data)
}

fn checksum(data: &[u8]) -> u64 {
    xxh3(data) & HASH_MASK
}

/// The unit of a partial read: O_DIRECT's alignment.
const SECTOR: usize = crate::io::IO_ALIGN;

fn sector_sum(data: &[u8]) -> u32 {
    xxh3(data) as u32
}

/// Counters of an NVMe store.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize)]
pub struct NvmeStats {
    /// Pages read successfully.
    pub reads: u64,
    /// Pages written successfully.
    pub writes: u64,
    /// Bytes read (whole pages and the sectors of partial reads).
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Operations that failed (I/O errors and checksum mismatches).
    pub errors: u64,
    /// Reads whose checksum did not match.
    pub corrupted: u64,
    /// Seconds with at least one of the store's operations in flight (from
    /// its submission to its completion being reaped): the bytes moved over
    /// this are the rate the store got from its device while it had work,
    /// whatever the queue depth and whatever else shared the device.
    pub busy_seconds: f64,
}

/// The time a store had operations in flight.
#[derive(Debug, Default)]
struct Busy(Mutex<BusyState>);

#[derive(Debug, Default)]
struct BusyState {
    in_flight: u64,
    since: Option<std::time::Instant>,
    total: std::time::Duration,
}

impl Busy {
    fn start(&self) {
        let mut s = self.0.lock();
        if s.in_flight == 0 {
            s.since = Some(std::time::Instant::now());
        }
        s.in_flight += 1;
    }

    fn end(&self, n: u64) {
        let mut s = self.0.lock();
        s.in_flight = s.in_flight.saturating_sub(n);
        if s.in_flight == 0 {
            if let Some(t) = s.since.take() {
                s.total += t.elapsed();
            }
        }
    }

    fn seconds(&self) -> f64 {
        let s = self.0.lock();
        (s.total + s.since.map_or_else(Default::default, |t| t.elapsed())).as_secs_f64()
    }
}

/// Ends one operation's busy span when dropped (a synchronous operation
/// that returns early ends it too).
struct BusySpan<'a>(&'a Busy);

impl<'a> BusySpan<'a> {
    fn new(busy: &'a Busy) -> Self {
        busy.start();
        Self(busy)
    }
}

impl Drop for BusySpan<'_> {
    fn drop(&mut self) {
        self.0.end(1);
    }
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    /// Bytes of partial (sector) reads.
    range_bytes: AtomicU64,
    writes: AtomicU64,
    errors: AtomicU64,
    corrupted: AtomicU64,
}

/// Page slots on an O_DIRECT file or block device.
pub struct NvmeStore {
    file: Arc<File>,
    description: String,
    page_size: usize,
    slots: SlotAllocator,
    meta: Box<[AtomicU64]>,
    /// Pages over one sector: each sector's checksum, `index * per + k`.
    sectors: Box<[std::sync::atomic::AtomicU32]>,
    engine: Arc<dyn IoEngine>,
    queue_depth: usize,
    queues: Mutex<Vec<IoQueue>>,
    /// Depth-1 queues for the one-page calls (`read_page`, `write_page`).
    sync_queues: Mutex<Vec<IoQueue>>,
    pool: Arc<BufPool>,
    counters: Counters,
    busy: Busy,
}

impl std::fmt::Debug for NvmeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeStore")
            .field("file", &self.description)
            .field("page_size", &self.page_size)
            .field("capacity_pages", &self.slots.capacity())
            .field("engine", &self.engine.kind())
            .finish()
    }
}

impl NvmeStore {
    /// Opens the store with the engine the config names.
    pub fn new(config: &NvmeConfig) -> Result<Self> {
        let engine = io::engine(config.engine)?;
        Self::with_engine(config, engine)
    }

    /// Opens the store over a given engine (e.g. a fault-injecting one).
    pub fn with_engine(config: &NvmeConfig, engine: Arc<dyn IoEngine>) -> Result<Self> {
        check_page_size(config.page_size)?;
        if config.capacity == 0 {
            return Err(Error::invalid("nvme capacity is zero"));
        }
        if config.capacity % config.page_size as u64 != 0 {
            return Err(Error::invalid(format!(
                "nvme capacity {} is not a multiple of the page size {}",
                config.capacity, config.page_size
            )));
        }
        if !(1..=4096).contains(&config.queue_depth) {
            return Err(Error::invalid(format!(
                "queue depth {} is outside 1..=4096",
                config.queue_depth
            )));
        }
        let pages = u32::try_from(config.capacity / config.page_size as u64).map_err(|_| {
            Error::invalid(format!(
                "nvme capacity {} has too many pages",
                config.capacity
            ))
        })?;
        if pages < 2 {
            return Err(Error::invalid(format!(
                "nvme capacity {} holds {pages} page of {} bytes; the tier needs at least 2 (one is held back for copy-then-commit writes)",
                config.capacity, config.page_size
            )));
        }
        let (file, description) = open_private(&config.path, config.capacity)?;
        Ok(Self {
            file: Arc::new(file),
            description,
            page_size: config.page_size,
            slots: SlotAllocator::with_reserve(pages, reserve_pages(pages)),
            meta: (0..pages).map(|_| AtomicU64::new(META_EMPTY)).collect(),
            sectors: if config.page_size > SECTOR {
                (0..pages as usize * (config.page_size / SECTOR))
                    .map(|_| std::sync::atomic::AtomicU32::new(0))
                    .collect()
            } else {
                Box::default()
            },
            engine,
            queue_depth: config.queue_depth,
            queues: Mutex::new(Vec::new()),
            sync_queues: Mutex::new(Vec::new()),
            pool: BufPool::new(
                config.page_size,
                pool_buffers(config.page_size, config.queue_depth, config.pool_bytes),
            )?,
            counters: Counters::default(),
            busy: Busy::default(),
        })
    }

    /// Operations a session keeps in flight.
    pub fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    /// The engine in use.
    pub fn engine(&self) -> EngineKind {
        self.engine.kind()
    }

    /// What backs the store (for reports).
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.slots.capacity() as u64 * self.page_size as u64
    }

    /// Counters since the store was opened.
    pub fn stats(&self) -> NvmeStats {
        let reads = self.counters.reads.load(Ordering::Relaxed);
        let writes = self.counters.writes.load(Ordering::Relaxed);
        NvmeStats {
            reads,
            writes,
            bytes_read: reads * self.page_size as u64
                + self.counters.range_bytes.load(Ordering::Relaxed),
            bytes_written: writes * self.page_size as u64,
            errors: self.counters.errors.load(Ordering::Relaxed),
            corrupted: self.counters.corrupted.load(Ordering::Relaxed),
            busy_seconds: self.busy.seconds(),
        }
    }

    /// A page-sized I/O buffer: from the store's registered pool while it
    /// has one free (it returns there when dropped), else from the heap.
    pub fn buffer(&self) -> Result<AlignedBuf> {
        match self.pool.take() {
            Some(b) => Ok(b),
            None => AlignedBuf::new(self.page_size),
        }
    }

    /// A session: a queue of the store's depth for batched asynchronous
    /// reads and writes from one thread.
    pub fn session(&self) -> Result<NvmeSession<'_>> {
        self.session_with_depth(self.queue_depth)
    }

    /// A session with its own queue depth.
    pub fn session_with_depth(&self, depth: usize) -> Result<NvmeSession<'_>> {
        let pooled = if depth == self.queue_depth {
            self.queues.lock().pop()
        } else {
            None
        };
        let queue = match pooled {
            Some(q) => q,
            None => IoQueue::new(&*self.engine, &self.file, depth, Some(&self.pool))?,
        };
        Ok(NvmeSession {
            store: self,
            queue: Some(queue),
            pending: (0..depth).map(|_| None).collect(),
            free: (0..depth as u64).rev().collect(),
            healthy: true,
            raw: Vec::with_capacity(depth),
        })
    }

    /// Writes `data` to a fresh slot and, only once that write succeeded,
    /// frees the old one and puts the new slot in `slot`'s place
    /// (copy-then-commit). On any failure `slot` still holds the previous
    /// copy, intact. The fresh slot may come from the store's reserve, so a
    /// full store can still be written; only when the reserve is in use too
    /// does this fail with `OutOfCapacity` (the page unchanged).
    /// [`PageStore::write_page`] on this store does exactly this.
    pub fn replace(&self, slot: &mut Slot, data: &[u8]) -> Result<()> {
        self.slots.check(slot)?;
        check_page_len("source", data.len(), self.page_size)?;
        let mut buf = self.buffer()?;
        buf.copy_from_slice(data);
        let mut fresh = self.fresh_slot()?;
        let written = match self.sync_op(IoOp::Write, &fresh, buf) {
            Ok((_buf, result)) => result,
            Err(e) => Err(e),
        };
        match written {
            Ok(()) => {
                std::mem::swap(slot, &mut fresh);
                self.end_borrow(fresh)
            }
            Err(e) => {
                self.end_borrow(fresh)?;
                Err(e)
            }
        }
    }

    /// Ends a copy-then-commit write, giving `slot` (the old copy, or the
    /// new one that failed) back — unless a lost write may still land on it
    /// ([`META_ABANDONED`]): then it stays allocated for good, and only the
    /// borrow of the reserve ends.
    fn end_borrow(&self, slot: Slot) -> Result<()> {
        if self.abandoned(&slot) {
            self.slots.end_borrow_keeping(slot)
        } else {
            self.slots.end_borrow(slot)
        }
        .map_err(|(e, _)| e)
    }

    /// Whether `slot` was given up to a write that may still land
    /// ([`META_ABANDONED`]): it stays allocated for good.
    fn abandoned(&self, slot: &Slot) -> bool {
        self.meta
            .get(slot.index() as usize)
            .is_some_and(|m| m.load(Ordering::Acquire) == META_ABANDONED)
    }

    /// A slot for a copy-then-commit write. The reserve's slots are held
    /// only while one page is written, so when concurrent writers have
    /// taken them all, waiting briefly gets one back.
    fn fresh_slot(&self) -> Result<Slot> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        loop {
            if let Some(slot) = self.slots.alloc_reserve() {
                return Ok(slot);
            }
            if self.slots.total() == self.slots.capacity() || std::time::Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::OutOfCapacity,
                    "nvme tier has no free slot for a copy-then-commit write; the page is unchanged",
                ));
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }

    fn offset(&self, index: u32) -> u64 {
        index as u64 * self.page_size as u64
    }

    /// Before an operation starts: a write marks the slot torn (until it
    /// succeeds) and returns the new page's checksum.
    fn begin(&self, op: IoOp, index: u32, data: &[u8]) -> u64 {
        match op {
            IoOp::Write => {
                self.meta[index as usize].store(META_TORN, Ordering::Release);
                checksum(data)
            }
            IoOp::Read => 0,
        }
    }

    /// After an operation's bytes moved: commit a write's checksum, or
    /// verify a read's.
    fn finish(&self, op: IoOp, index: u32, offset: u64, sum: u64, data: &[u8]) -> Result<()> {
        match op {
            IoOp::Write => {
                if !self.sectors.is_empty() {
                    let per = self.page_size / SECTOR;
                    for (k, sector) in data.chunks(SECTOR).enumerate() {
                        self.sectors[index as usize * per + k]
                            .store(sector_sum(sector), Ordering::Relaxed);
                    }
                }
                // Release: a reader that sees the page valid sees its
                // sector checksums too.
                self.meta[index as usize].store(META_VALID | sum, Ordering::Release);
                self.counters.writes.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            IoOp::Read => {
                self.verify(index, offset, data)?;
                self.counters.reads.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// One page operation, start to finish, on a pooled queue. The outer
    /// `Err` is an engine failure (the buffer stays with the dropped queue);
    /// the inner result is the operation's.
    fn sync_op(&self, op: IoOp, slot: &Slot, buf: AlignedBuf) -> Result<(AlignedBuf, Result<()>)> {
        self.slots.check(slot)?;
        let index = slot.index();
        let pooled = self.sync_queues.lock().pop();
        let mut queue = match pooled {
            Some(q) => q,
            // Not registered: one-page calls gain little from it, and each
            // registration pins the whole pool again against the memlock
            // limit.
            None => IoQueue::new(&*self.engine, &self.file, 1, None)?,
        };
        let sum = self.begin(op, index, &buf);
        let offset = self.offset(index);
        let span = BusySpan::new(&self.busy);
        let c = match queue.run(IoRequest {
            op,
            offset,
            buf,
            tag: 0,
        }) {
            Ok(c) => c,
            Err(e) => {
                // An engine failure: the operation may still be in flight.
                // A write that could not be waited for may land later, so
                // its slot is never handed out again.
                if !queue.settle() && op == IoOp::Write {
                    self.meta[index as usize].store(META_ABANDONED, Ordering::Release);
                }
                return Err(e);
            }
        };
        drop(span);
        self.sync_queues.lock().push(queue);
        let result = c
            .result
            .and_then(|()| self.finish(op, index, offset, sum, &c.buf));
        if result.is_err() {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        Ok((c.buf, result))
    }

    /// Reads the sectors of `slot` that cover `offset..offset + out.len()`
    /// and verifies each against its checksum.
    fn read_sectors(&self, slot: &Slot, offset: usize, out: &mut [u8]) -> Result<()> {
        self.slots.check(slot)?;
        let index = slot.index();
        let lo = offset / SECTOR * SECTOR;
        let hi = (offset + out.len()).div_ceil(SECTOR) * SECTOR;
        let at = self.offset(index) + lo as u64;
        let pooled = self.sync_queues.lock().pop();
        let mut queue = match pooled {
            Some(q) => q,
            None => IoQueue::new(&*self.engine, &self.file, 1, None)?,
        };
        let buf = AlignedBuf::new(hi - lo)?;
        let span = BusySpan::new(&self.busy);
        let c = queue.run(IoRequest {
            op: IoOp::Read,
            offset: at,
            buf,
            tag: 0,
        })?;
        drop(span);
        self.sync_queues.lock().push(queue);
        let checked = c.result.and_then(|()| {
            let meta = self.meta[index as usize].load(Ordering::Acquire);
            if meta & META_VALID == 0 {
                // Never written, or torn: the whole-page check says which.
                return self.verify(index, at, &c.buf);
            }
            let per = self.page_size / SECTOR;
            for (k, sector) in c.buf.chunks(SECTOR).enumerate() {
                let s = lo / SECTOR + k;
                let stored = self.sectors[index as usize * per + s].load(Ordering::Relaxed);
                let actual = sector_sum(sector);
                if stored != actual {
                    self.counters.corrupted.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::new(
                        ErrorKind::Corrupted,
                        format!(
                            "sector {s} of the page in nvme slot {index} (offset {}) fails its checksum: stored {stored:#010x}, read {actual:#010x}",
                            self.offset(index)
                        ),
                    ));
                }
            }
            Ok(())
        });
        match checked {
            Ok(()) => {
                out.copy_from_slice(&c.buf[offset - lo..offset - lo + out.len()]);
                self.counters
                    .range_bytes
                    .fetch_add((hi - lo) as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    fn verify(&self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        let meta = self.meta[index as usize].load(Ordering::Acquire);
        if meta & META_VALID != 0 {
            let stored = meta & HASH_MASK;
            let actual = checksum(data);
            if stored == actual {
                return Ok(());
            }
            self.counters.corrupted.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::Corrupted,
                format!(
                    "page in nvme slot {index} (offset {offset}) fails its checksum: stored {stored:#018x}, read {actual:#018x}"
                ),
            ));
        }
        if meta == META_ABANDONED {
            Err(Error::new(
                ErrorKind::Io,
                format!("nvme slot {index} holds no valid page: the I/O engine failed during its last write"),
            ))
        } else if meta == META_TORN {
            Err(Error::new(
                ErrorKind::Io,
                format!("nvme slot {index} holds no valid page: its last write did not succeed"),
            ))
        } else {
            Err(Error::invalid(format!(
                "nvme slot {index} was never written"
            )))
        }
    }
}

/// A request the session refused, handed back whole.
#[derive(Debug)]
pub struct Rejected {
    /// Why.
    pub error: Error,
    /// The slot, returned.
    pub slot: Slot,
    /// The buffer, returned.
    pub buf: AlignedBuf,
}

/// A finished read or write of a session.
#[derive(Debug)]
pub struct NvmeCompletion {
    /// The caller's tag.
    pub tag: u64,
    /// Read or write.
    pub op: IoOp,
    /// The slot, returned.
    pub slot: Slot,
    /// The buffer, returned (holding the page after a successful read).
    pub buf: AlignedBuf,
    /// `Ok` when the page was written, or read and verified.
    pub result: Result<()>,
}

struct Pending {
    slot: Slot,
    tag: u64,
    sum: u64,
    op: IoOp,
}

/// Batched asynchronous page I/O from one thread. Requests take the slot
/// and the buffer by value and hand both back in their completion, so
/// neither can be freed or reused while the device works on it.
pub struct NvmeSession<'a> {
    store: &'a NvmeStore,
    queue: Option<IoQueue>,
    pending: Vec<Option<Pending>>,
    free: Vec<u64>,
    healthy: bool,
    raw: Vec<IoCompletion>,
}

/// The host slot a buffer from [`NvmeSession::submit_read_into`] was lent
/// by (`None` for any other buffer).
pub fn lent_host_slot(buf: AlignedBuf) -> Option<Slot> {
    buf.into_lender()
        .and_then(|t| t.downcast::<(Slot, Arc<crate::sys::Arena>)>().ok())
        .map(|b| b.0)
}

impl NvmeCompletion {
    /// For a read from [`NvmeSession::submit_read_into`]: the host slot it
    /// read into (holding the page when `result` is `Ok`).
    pub fn into_host_slot(self) -> Option<Slot> {
        lent_host_slot(self.buf)
    }
}

impl NvmeSession<'_> {
    /// Maximum requests in flight.
    pub fn depth(&self) -> usize {
        self.pending.len()
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.pending.len() - self.free.len()
    }

    /// Starts writing `buf` (one page) to `slot`, in place: until it
    /// completes the slot reads as torn, and a failed write leaves it torn
    /// (an error on read, never stale data) — the slot's previous content
    /// is gone. To keep a page's previous copy until the new one is safe,
    /// write to a fresh slot and free the old one on success (what
    /// [`NvmeStore::replace`] does one page at a time).
    pub fn submit_write(&mut self, slot: Slot, buf: AlignedBuf, tag: u64) -> Result<(), Rejected> {
        self.submit(IoOp::Write, slot, buf, tag)
    }

    /// Starts reading `slot` into `buf`; the completion verifies the checksum.
    pub fn submit_read(&mut self, slot: Slot, buf: AlignedBuf, tag: u64) -> Result<(), Rejected> {
        self.submit(IoOp::Read, slot, buf, tag)
    }

    /// Starts reading `slot` straight into `dst`, a slot of `host` (no
    /// bounce buffer); the completion verifies the checksum, and its buffer
    /// gives `dst` back through [`NvmeCompletion::into_host_slot`]. The
    /// request holds the host arena, so the read can never land in memory
    /// that is gone.
    pub fn submit_read_into(
        &mut self,
        slot: Slot,
        host: &super::host::HostStore,
        dst: Slot,
        tag: u64,
    ) -> Result<(), (Error, Slot, Slot)> {
        if host.page_size() != self.store.page_size {
            return Err((Error::invalid("host and nvme page sizes differ"), slot, dst));
        }
        let ptr = match host.slot_ptr(&dst) {
            Ok(p) => p,
            Err(e) => return Err((e, slot, dst)),
        };
        let token: Box<dyn std::any::Any + Send + Sync> = Box::new((dst, host.arena_handle()));
        // SAFETY: `dst` is a slot of `host` (checked by `slot_ptr`), a
        // page-aligned, page-sized range of its arena that only the holder of
        // the `dst` token may touch; the token travels inside the buffer, so
        // nothing else uses the range until it is handed back. The buffer
        // also holds the arena, so even a buffer leaked by a queue that
        // could not wait for its I/O keeps the memory mapped.
        let buf = unsafe { AlignedBuf::lent(ptr, self.store.page_size, token) };
        self.submit(IoOp::Read, slot, buf, tag).map_err(|r| {
            let dst = lent_host_slot(r.buf).expect("the buffer lent above");
            (r.error, r.slot, dst)
        })
    }

    /// Submits a read of NVMe slot `slot` straight into device slot `dst`
    /// of the simulated device (its memory is host memory: no bounce
    /// buffer, no copy). The completion's buffer carries `dst` back, as
    /// for [`submit_read_into`](Self::submit_read_into). Refused (the
    /// slots come back) on a GPU, whose memory a read cannot reach.
    pub(crate) fn submit_read_into_device(
        &mut self,
        slot: Slot,
        device: &super::device::DeviceStore,
        dst: Slot,
        tag: u64,
    ) -> Result<(), (Error, Slot, Slot)> {
        if device.page_size() != self.store.page_size {
            return Err((
                Error::invalid("device and nvme page sizes differ"),
                slot,
                dst,
            ));
        }
        let Some((ptr, arena)) = device.direct_target(&dst) else {
            return Err((
                Error::new(
                    ErrorKind::Unsupported,
                    "the device's memory is not host memory",
                ),
                slot,
                dst,
            ));
        };
        let token: Box<dyn std::any::Any + Send + Sync> = Box::new((dst, arena));
        // SAFETY: `ptr` is `dst`'s page in the host memory behind the
        // simulated device's allocation (`direct_target` checked the slot
        // and the bounds); that memory is page-aligned (an arena) and only
        // the holder of the `dst` token may touch the page, and the token
        // travels inside the buffer until it is handed back. The buffer
        // holds the arena, so a buffer leaked by a queue that could not wait
        // for its I/O keeps the memory mapped.
        let buf = unsafe { AlignedBuf::lent(ptr, self.store.page_size, token) };
        self.submit(IoOp::Read, slot, buf, tag).map_err(|r| {
            let dst = lent_host_slot(r.buf).expect("the buffer lent above");
            (r.error, r.slot, dst)
        })
    }

    fn submit(&mut self, op: IoOp, slot: Slot, buf: AlignedBuf, tag: u64) -> Result<(), Rejected> {
        let reject = |error, slot, buf| Err(Rejected { error, slot, buf });
        if !self.healthy {
            return reject(
                Error::new(
                    ErrorKind::Closed,
                    "this nvme session's queue failed; open a new session",
                ),
                slot,
                buf,
            );
        }
        if let Err(e) = self.store.slots.check(&slot) {
            return reject(e, slot, buf);
        }
        if op == IoOp::Write && self.store.abandoned(&slot) {
            return reject(
                Error::invalid(format!(
                    "nvme slot {} was given up to a lost write that may still land; free it and write to a fresh slot",
                    slot.index()
                )),
                slot,
                buf,
            );
        }
        if let Err(e) = check_page_len("i/o", buf.len(), self.store.page_size) {
            return reject(e, slot, buf);
        }
        let Some(id) = self.free.pop() else {
            return reject(
                Error::invalid("nvme session is full: reap first"),
                slot,
                buf,
            );
        };
        let index = slot.index();
        let sum = match op {
            IoOp::Write => checksum(&buf),
            IoOp::Read => 0,
        };
        let req = IoRequest {
            op,
            offset: self.store.offset(index),
            buf,
            tag: id,
        };
        let queue = self.queue.as_mut().expect("session has a queue");
        // In flight from its submission (which may itself take time).
        self.store.busy.start();
        match queue.push(req) {
            Ok(()) => {
                // Torn from now until the write's completion is reaped (on
                // this thread): a rejected request leaves the slot as it was.
                if op == IoOp::Write {
                    self.store.meta[index as usize].store(META_TORN, Ordering::Release);
                }
                self.pending[id as usize] = Some(Pending { slot, tag, sum, op });
                Ok(())
            }
            Err(req) => {
                self.store.busy.end(1);
                self.free.push(id);
                reject(Error::invalid("i/o queue is full"), slot, req.buf)
            }
        }
    }

    /// Gives up on the requests still in flight, after the engine failed
    /// to return them: the NVMe slots of reads come back with their tags
    /// (a read leaves its slot's bytes as they were, so the page's copy
    /// there is intact whether or not the read still runs); the slots of
    /// writes stay allocated for good (a write may still land), and every
    /// buffer stays with the engine. The session ends here.
    pub fn abandon(mut self) -> Vec<(u64, Slot)> {
        self.healthy = false;
        let mut reads = Vec::new();
        for entry in &mut self.pending {
            match entry.take() {
                Some(p) if p.op == IoOp::Read => reads.push((p.tag, p.slot)),
                Some(p) => {
                    self.store.meta[p.slot.index() as usize]
                        .store(META_ABANDONED, Ordering::Release);
                    // Not freed: the slot stays allocated.
                    let _ = p.slot;
                }
                None => {}
            }
        }
        reads
    }

    /// Waits until at least `min` requests (at most those in flight) have
    /// finished and appends them to `out`.
    pub fn reap(&mut self, min: usize, out: &mut Vec<NvmeCompletion>) -> Result<()> {
        let queue = self.queue.as_mut().expect("session has a queue");
        let res = queue.reap(min, &mut self.raw);
        if res.is_err() {
            self.healthy = false;
        }
        for c in self.raw.drain(..) {
            let p = self.pending[c.tag as usize]
                .take()
                .expect("completion of a pending request");
            self.free.push(c.tag);
            self.store.busy.end(1);
            let result = c.result.and_then(|()| {
                self.store
                    .finish(c.op, p.slot.index(), c.offset, p.sum, &c.buf)
            });
            if result.is_err() {
                self.store.counters.errors.fetch_add(1, Ordering::Relaxed);
            }
            out.push(NvmeCompletion {
                tag: p.tag,
                op: c.op,
                slot: p.slot,
                buf: c.buf,
                result,
            });
        }
        res
    }
}

impl Drop for NvmeSession<'_> {
    fn drop(&mut self) {
        if let Some(queue) = self.queue.take() {
            // Only queues of the store's own depth go back to its pool, so
            // that `session()` always gets a queue of the depth it asks for.
            if self.healthy && queue.in_flight() == 0 && queue.depth() == self.store.queue_depth {
                self.store.queues.lock().push(queue);
            }
        }
        // Completions not reaped are lost with the queue; their slots stay
        // allocated (leaked) rather than freed under a live operation.
        // Their time in flight is no longer known: it ends here.
        self.store.busy.end(self.in_flight() as u64);
    }
}

impl PageStore for NvmeStore {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn tier(&self) -> Tier {
        Tier::Nvme
    }
    fn page_size(&self) -> usize {
        self.page_size
    }
    fn capacity_pages(&self) -> u32 {
        self.slots.capacity()
    }
    fn used_pages(&self) -> u32 {
        // Reserve slots in use mid-write are not part of the capacity.
        self.slots.used_ordinary()
    }
    fn alloc(&self) -> Result<Slot> {
        let slot = self
            .slots
            .alloc()
            .ok_or_else(|| full_error(Tier::Nvme, self.slots.capacity(), self.page_size))?;
        self.meta[slot.index() as usize].store(META_EMPTY, Ordering::Release);
        Ok(slot)
    }
    fn free(&self, slot: Slot) -> Result<()> {
        if self.abandoned(&slot) {
            // A write may still land on it: kept out of use for good.
            return Ok(());
        }
        self.slots.free(slot).map_err(|(e, _)| e)
    }
    /// Copy-then-commit: see [`NvmeStore::replace`]. The slot's index may
    /// change; a failure leaves the previous copy in place.
    fn write_page(&self, slot: &mut Slot, data: &[u8]) -> Result<()> {
        self.replace(slot, data)
    }
    /// In place: the slot holds nothing to lose (a failure leaves it torn).
    fn write_new(&self, slot: &mut Slot, data: &[u8]) -> Result<()> {
        check_page_len("source", data.len(), self.page_size)?;
        if self.abandoned(slot) {
            return Err(Error::invalid(format!(
                "nvme slot {} was given up to a lost write that may still land; free it and write to a fresh slot",
                slot.index()
            )));
        }
        let mut buf = self.buffer()?;
        buf.copy_from_slice(data);
        self.sync_op(IoOp::Write, slot, buf)?.1
    }
    fn read_page(&self, slot: &Slot, out: &mut [u8]) -> Result<()> {
        check_page_len("destination", out.len(), self.page_size)?;
        let buf = self.buffer()?;
        let (buf, res) = self.sync_op(IoOp::Read, slot, buf)?;
        if res.is_ok() {
            out.copy_from_slice(&buf);
        }
        res
    }

    /// Reads only the 4 KiB sectors that cover the range (each verified by
    /// its own checksum); a range of most of the page reads it whole.
    fn read_range(&self, slot: &Slot, offset: usize, out: &mut [u8]) -> Result<()> {
        super::store::check_range(offset, out.len(), self.page_size)?;
        let covered = (offset + out.len()).div_ceil(SECTOR) * SECTOR - offset / SECTOR * SECTOR;
        if self.sectors.is_empty() || out.is_empty() || 2 * covered > self.page_size {
            let mut page = vec![0; self.page_size];
            self.read_page(slot, &mut page)?;
            out.copy_from_slice(&page[offset..offset + out.len()]);
            return Ok(());
        }
        self.read_sectors(slot, offset, out)
    }
}

/// What an NVMe path names: see [`NvmeConfig::path`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Medium {
    BlockDevice,
    Directory,
    NewFile,
}

/// Decides what `path` names, or why it cannot hold a store, without
/// opening anything.
fn classify(path: &Path) -> Result<Medium> {
    match fs::metadata(path) {
        Ok(meta) if meta.file_type().is_block_device() => Ok(Medium::BlockDevice),
        Ok(meta) if meta.is_dir() => Ok(Medium::Directory),
        Ok(_) => Err(Error::invalid(format!(
            "{} already exists; name a directory, a block device or a new file (strata will not overwrite a file)",
            path.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            if parent.is_dir() {
                Ok(Medium::NewFile)
            } else {
                Err(Error::new(
                    ErrorKind::NotFound,
                    format!("directory {} does not exist", parent.display()),
                ))
            }
        }
        Err(e) => Err(Error::io(format!("inspecting {}", path.display()), e)),
    }
}

impl NvmeConfig {
    /// Checks, without creating anything, that [`path`](Self::path) can
    /// hold a store of [`capacity`](Self::capacity) bytes: what it names
    /// (an existing file is refused), and for a file the free space of its
    /// filesystem. Opening the store can still fail later (O_DIRECT
    /// refused, a block device in use); `strata info` reports this check.
    pub fn check(&self) -> Result<()> {
        let medium = classify(&self.path)?;
        if medium != Medium::BlockDevice {
            if let Some(free) = crate::sys::fs_free_bytes(&self.path) {
                if free < self.capacity {
                    return Err(Error::new(
                        ErrorKind::NoSpace,
                        format!(
                            "{} has {} free, less than the nvme capacity {}",
                            self.path.display(),
                            format_size(free),
                            format_size(self.capacity)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Opens the medium behind a store: see [`NvmeConfig::path`]. Returns the
/// file (O_DIRECT, laid out to `capacity` bytes) and a description.
fn open_private(path: &Path, capacity: u64) -> Result<(File, String)> {
    let open_error = |e: std::io::Error| Error::io(format!("opening {}", path.display()), e);
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).mode(0o600);
    let (file, description) = match classify(path)? {
        Medium::BlockDevice => {
            // O_EXCL on a block device fails (EBUSY) while it is mounted or
            // claimed: strata never overwrites a live filesystem.
            let file = opts
                .clone()
                .custom_flags(libc::O_EXCL)
                .open(path)
                .map_err(|e| {
                    if e.raw_os_error() == Some(libc::EBUSY) {
                        Error::invalid(format!(
                            "block device {} is in use (mounted or claimed); strata will not overwrite it",
                            path.display()
                        ))
                    } else {
                        open_error(e)
                    }
                })?;
            let size = block_device_size(&file)
                .map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
            if size < capacity {
                return Err(Error::invalid(format!(
                    "block device {} holds {} bytes, less than the nvme capacity {capacity}",
                    path.display(),
                    size
                )));
            }
            (file, format!("block device {}", path.display()))
        }
        Medium::Directory => {
            // A directory that cannot hold a file (procfs answers ENOENT)
            // is named as the place the swap file could not be made.
            let open_error = |e: std::io::Error| {
                Error::io(format!("creating a swap file in {}", path.display()), e)
            };
            let file = match opts.clone().custom_flags(libc::O_TMPFILE).open(path) {
                Ok(f) => f,
                // Filesystems without O_TMPFILE: create a unique name, unlink it.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EOPNOTSUPP) | Some(libc::EISDIR)
                    ) =>
                {
                    let name = path.join(format!(
                        ".strata-swap-{}-{}",
                        std::process::id(),
                        crate::sys::next_id()
                    ));
                    create_unlinked(&opts, &name).map_err(open_error)?
                }
                Err(e) => return Err(open_error(e)),
            };
            (file, format!("private swap file in {}", path.display()))
        }
        Medium::NewFile => {
            let file = create_unlinked(&opts, path).map_err(open_error)?;
            (file, format!("private swap file {}", path.display()))
        }
    };
    // O_DIRECT is switched on after the file is private (unlinked), so a
    // filesystem that refuses it leaves nothing behind.
    set_direct(&file).map_err(|e| direct_io_error(path, e))?;
    if !description.starts_with("block device") {
        layout(&file, capacity, path)?;
    }
    Ok((file, description))
}

/// The error for a failure to switch O_DIRECT on: EINVAL means the
/// filesystem has no direct I/O.
fn direct_io_error(path: &Path, e: std::io::Error) -> Error {
    if e.raw_os_error() == Some(libc::EINVAL) {
        Error::new(
            ErrorKind::Unsupported,
            format!(
                "the filesystem at {} does not support O_DIRECT (ramfs, tmpfs before Linux 6.6, some FUSE filesystems); put the nvme tier on a disk",
                path.display()
            ),
        )
    } else {
        Error::io(format!("enabling O_DIRECT on {}", path.display()), e)
    }
}

fn set_direct(file: &File) -> std::io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on an fd we own, with integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // O_NOATIME spares every read an access-time check; it is refused
    // (EPERM) on files we do not own, such as some block devices.
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT | libc::O_NOATIME) } == 0 {
        return Ok(());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Creates `name` exclusively with mode 0600 and unlinks it at once, so no
/// other process can open it by name.
fn create_unlinked(opts: &OpenOptions, name: &Path) -> std::io::Result<File> {
    let file = opts.clone().create_new(true).open(name)?;
    fs::remove_file(name)?;
    Ok(file)
}

/// Reserves the file's blocks up front, as fio lays out a file, so that
/// ENOSPC shows at creation and writes never extend the file.
fn layout(file: &File, capacity: u64, path: &Path) -> Result<()> {
    let len = libc::off_t::try_from(capacity)
        .map_err(|_| Error::invalid(format!("nvme capacity {capacity} is too large")))?;
    // SAFETY: fallocate on an fd we own; no memory is passed.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EOPNOTSUPP) {
        return file
            .set_len(capacity)
            .map_err(|e| Error::io(format!("sizing the swap file in {}", path.display()), e));
    }
    Err(Error::io(
        format!(
            "reserving {} for the swap file at {}",
            format_size(capacity),
            path.display()
        ),
        err,
    ))
}

fn block_device_size(file: &File) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut f = file;
    f.seek(SeekFrom::End(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::fault::{Fault, FaultEngine, FaultPlan};

    fn store(dir: &Path, engine: Arc<dyn IoEngine>, pages: u64) -> NvmeStore {
        NvmeStore::with_engine(&NvmeConfig::new(dir, pages * 4096, 4096), engine).unwrap()
    }

    /// A store of `pages` 4 KiB pages whose operations go through a fault
    /// plan.
    fn faulty_store(dir: &Path, pages: u64) -> (NvmeStore, Arc<FaultPlan>) {
        let plan = FaultPlan::new();
        let engine = Arc::new(FaultEngine::new(
            io::engine(EngineChoice::Psync).unwrap(),
            plan.clone(),
        ));
        (store(dir, engine, pages), plan)
    }

    /// The checksums are XXH3-64 (seed 0) bit for bit, whichever vector
    /// unit computes them: the reference values of XXH3 for inputs in each
    /// of its length classes (empty, 1-3, 129-240 and above bytes).
    #[test]
    fn checksums_are_xxh3() {
        let a: Vec<u8> = (0..1usize << 16).map(|i| (i * 31 + 7) as u8).collect();
        for (len, want) in [
            (0, 0x2d06800538d394c2u64),
            (3, 0x15f7093b173d005c),
            (200, 0x12fdb864685f344d),
            (4096, 0xa3c19f8174cde0bb),
            (65536, 0xcf188822048798b0),
        ] {
            assert_eq!(xxh3(&a[..len]), want, "{len} bytes");
            assert_eq!(checksum(&a[..len]), want & HASH_MASK);
        }
    }

    #[test]
    fn swap_file_is_invisible() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), io::engine(EngineChoice::Psync).unwrap(), 4);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        let named = dir.path().join("swap");
        let s2 = NvmeStore::new(&NvmeConfig::new(&named, 8192, 4096)).unwrap();
        assert!(!named.exists());
        drop((s, s2));
    }

    #[test]
    fn no_direct_io_is_unsupported_and_names_the_path() {
        let e = direct_io_error(
            Path::new("/mnt/x"),
            std::io::Error::from_raw_os_error(libc::EINVAL),
        );
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(
            e.message().contains("/mnt/x") && e.message().contains("O_DIRECT"),
            "{e}"
        );
        let e = direct_io_error(
            Path::new("/mnt/x"),
            std::io::Error::from_raw_os_error(libc::EIO),
        );
        assert_eq!(e.kind(), ErrorKind::Io);
    }

    #[test]
    fn a_full_store_still_rewrites_pages() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), io::engine(EngineChoice::Psync).unwrap(), 8);
        let mut slots: Vec<Slot> = (0..s.capacity_pages())
            .map(|_| s.alloc().unwrap())
            .collect();
        assert_eq!(s.alloc().unwrap_err().kind(), ErrorKind::OutOfCapacity);
        for round in 0..3u8 {
            for slot in slots.iter_mut() {
                s.write_page(slot, &[round; 4096]).unwrap();
            }
        }
        let mut out = vec![0; 4096];
        for slot in slots.drain(..) {
            s.read_page(&slot, &mut out).unwrap();
            assert!(out.iter().all(|&b| b == 2));
            s.free(slot).unwrap();
        }
    }

    #[test]
    fn a_small_pool_serves_a_deep_queue_with_heap_buffers() {
        // One page of registered buffers: the store holds no more, and a
        // session of depth 8 still writes and reads back every page.
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = NvmeConfig::new(dir.path(), 16 * 4096, 4096);
        cfg.queue_depth = 8;
        cfg.pool_bytes = 4096;
        let s = NvmeStore::new(&cfg).unwrap();
        let pooled = s.buffer().unwrap();
        let heap = s.buffer().unwrap();
        assert!(pooled.registered_index().is_some());
        assert!(heap.registered_index().is_none(), "one pooled buffer only");
        drop((pooled, heap));
        let slots: Vec<Slot> = (0..12).map(|_| s.alloc().unwrap()).collect();
        let mut session = s.session().unwrap();
        let mut done = Vec::new();
        let mut back = Vec::new();
        for (i, slot) in slots.into_iter().enumerate() {
            let mut b = s.buffer().unwrap();
            b.fill(i as u8 + 1);
            while session.in_flight() == session.depth() {
                session.reap(1, &mut done).unwrap();
            }
            session.submit_write(slot, b, i as u64).unwrap();
        }
        while session.in_flight() > 0 {
            session.reap(1, &mut done).unwrap();
        }
        for c in done.drain(..) {
            c.result.unwrap();
            while session.in_flight() == session.depth() {
                session.reap(1, &mut back).unwrap();
            }
            let mut buf = c.buf;
            buf.fill(0);
            session.submit_read(c.slot, buf, c.tag).unwrap();
        }
        while session.in_flight() > 0 {
            session.reap(1, &mut back).unwrap();
        }
        assert_eq!(back.len(), 12);
        for c in back {
            c.result.unwrap();
            assert!(c.buf.iter().all(|&x| x == c.tag as u8 + 1));
        }
    }

    #[test]
    fn only_queues_of_the_store_depth_are_pooled() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = NvmeConfig::new(dir.path(), 16 * 4096, 4096);
        cfg.queue_depth = 4;
        cfg.engine = EngineChoice::Psync;
        let s = NvmeStore::new(&cfg).unwrap();
        drop(s.session_with_depth(8).unwrap());
        assert_eq!(
            s.queues.lock().len(),
            0,
            "a depth-8 queue must not serve depth-4 sessions"
        );
        drop(s.session().unwrap());
        assert_eq!(s.queues.lock().len(), 1);
        let again = s.session().unwrap();
        assert_eq!(again.queue.as_ref().unwrap().depth(), 4);
    }

    #[test]
    fn busy_time_counts_operations_in_flight_and_no_idle_time() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty_store(dir.path(), 4);
        let mut slots = Vec::new();
        for i in 0..2u8 {
            let mut slot = s.alloc().unwrap();
            s.write_new(&mut slot, &[i; 4096]).unwrap();
            slots.push(slot);
        }
        let before = s.stats().busy_seconds;
        assert!(before > 0.0, "the writes were in flight for a while");
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert_eq!(s.stats().busy_seconds, before, "no time counted while idle");
        // Two slow reads in one session (the delay holds each submission).
        for skip in 0..2 {
            plan.inject(
                IoOp::Read,
                skip,
                Fault::Delay(std::time::Duration::from_millis(60)),
            );
        }
        let t0 = std::time::Instant::now();
        let mut session = s.session_with_depth(2).unwrap();
        for (tag, slot) in slots.into_iter().enumerate() {
            session
                .submit_read(slot, s.buffer().unwrap(), tag as u64)
                .unwrap();
        }
        let mut done = Vec::new();
        session.reap(2, &mut done).unwrap();
        let wall = t0.elapsed().as_secs_f64();
        assert!(done.iter().all(|c| c.result.is_ok()));
        let busy = s.stats().busy_seconds - before;
        assert!(busy >= 0.12, "both delays were in flight: {busy}");
        assert!(
            busy <= wall,
            "busy {busy} s within the {wall} s the reads took"
        );
        let after = s.stats().busy_seconds;
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert_eq!(s.stats().busy_seconds, after);
    }

    #[test]
    fn torn_and_empty_slots_never_read_as_data() {
        let dir = tempfile::tempdir().unwrap();
        let (s, plan) = faulty_store(dir.path(), 4);
        let mut slot = s.alloc().unwrap();
        let mut out = vec![0; 4096];
        assert_eq!(
            s.read_page(&slot, &mut out).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        // A failed copy-then-commit write leaves the slot as it was.
        plan.inject(IoOp::Write, 0, Fault::Errno(libc::EIO));
        assert_eq!(
            s.write_page(&mut slot, &[1; 4096]).unwrap_err().kind(),
            ErrorKind::Io
        );
        assert!(s
            .read_page(&slot, &mut out)
            .unwrap_err()
            .message()
            .contains("never written"));
        // A failed in-place session write leaves it torn.
        plan.inject(IoOp::Write, 0, Fault::Errno(libc::EIO));
        let mut session = s.session_with_depth(1).unwrap();
        session.submit_write(slot, s.buffer().unwrap(), 0).unwrap();
        let mut done = Vec::new();
        session.reap(1, &mut done).unwrap();
        let c = done.pop().unwrap();
        assert_eq!(c.result.unwrap_err().kind(), ErrorKind::Io);
        let e = s.read_page(&c.slot, &mut out).unwrap_err();
        assert!(e.message().contains("last write did not succeed"), "{e}");
        drop(session);
        s.free(c.slot).unwrap();
    }
}
