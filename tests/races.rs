//! Races between moves and everything else, made deterministic: an engine
//! that holds NVMe writes (and, when asked, reads) at a gate, so a move is
//! caught between its copy and its commit. Also capacity coming back at once when a buffer is
//! dropped while background work still holds its page table.

mod common;

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use strata::device::DeviceChoice;
use strata::io::{EngineChoice, IoEngine, IoOp};
use strata::lowlevel::{BufPool, RawOp, RawQueue};
use strata::runtime::{Access, Watermarks};
use strata::tier::NvmeConfig;
use strata::{ErrorKind, Runtime, Tier};

use common::pattern;

const PAGE: usize = 16 << 10;

/// Unless `open`, queues that were handed a write (or, with `reads`, a
/// read) hold it in `wait` (the I/O has not completed) until the test hands
/// out a permit, one batch per permit; `waiting` counts the batches held.
#[derive(Default)]
struct Gate {
    left: parking_lot::Mutex<u32>,
    open: AtomicBool,
    reads: AtomicBool,
    waiting: std::sync::atomic::AtomicUsize,
}

struct GateEngine {
    inner: Arc<dyn IoEngine>,
    gate: Arc<Gate>,
}

struct GateQueue {
    inner: Box<dyn RawQueue>,
    gate: Arc<Gate>,
    held: bool,
}

impl IoEngine for GateEngine {
    fn kind(&self) -> strata::io::EngineKind {
        self.inner.kind()
    }
    fn open_raw(
        &self,
        file: &Arc<File>,
        depth: usize,
        pool: Option<&Arc<BufPool>>,
    ) -> strata::Result<Box<dyn RawQueue>> {
        Ok(Box::new(GateQueue {
            inner: self.inner.open_raw(file, depth, pool)?,
            gate: self.gate.clone(),
            held: false,
        }))
    }
}

// SAFETY: every operation goes to the inner queue unchanged, which upholds
// the contract; the gate only delay `wait`.
unsafe impl RawQueue for GateQueue {
    unsafe fn push(&mut self, op: RawOp) {
        self.held |= op.op == IoOp::Write || self.gate.reads.load(Ordering::SeqCst);
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.push(op) }
    }
    fn wait(&mut self, min: usize, out: &mut Vec<(u32, io::Result<usize>)>) -> io::Result<()> {
        if self.held {
            let p = &self.gate;
            p.waiting.fetch_add(1, Ordering::SeqCst);
            loop {
                if p.open.load(Ordering::SeqCst) {
                    break;
                }
                let mut left = p.left.lock();
                if *left > 0 {
                    *left -= 1;
                    break;
                }
                drop(left);
                std::thread::sleep(Duration::from_millis(1));
            }
            p.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        self.held = false;
        self.inner.wait(min, out)
    }
}

fn gated(dir: &std::path::Path) -> (Runtime, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    gate.open.store(true, Ordering::SeqCst);
    let engine = Arc::new(GateEngine {
        inner: strata::io::engine(EngineChoice::Psync).unwrap(),
        gate: gate.clone(),
    });
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(4 * PAGE as u64)
        .nvme(NvmeConfig::new(dir, 16 * PAGE as u64, PAGE))
        .nvme_engine(engine)
        .background_eviction(false)
        .build()
        .unwrap();
    (rt, gate)
}

/// Runs `meanwhile` while an eviction of `b`'s page to NVMe is between its
/// copy and its commit, then lets the eviction finish.
fn during_demotion(gate: &Gate, b: &strata::Buffer, meanwhile: impl FnOnce()) {
    gate.open.store(false, Ordering::SeqCst);
    std::thread::scope(|s| {
        let evict = s.spawn(|| b.evict(0..b.len(), Tier::Nvme));
        while gate.waiting.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        meanwhile();
        gate.open.store(true, Ordering::SeqCst);
        evict.join().unwrap().unwrap();
    });
}

fn first_byte(b: &strata::Buffer) -> u8 {
    let mut out = [0u8; 1];
    b.read(0, &mut out).unwrap();
    out[0]
}

#[test]
fn a_write_racing_a_demotion_wins() {
    let dir = tempfile::tempdir().unwrap();
    let (rt, gate) = gated(dir.path());
    let b = rt.alloc(PAGE as u64).unwrap();
    b.write(0, &[0xAA; PAGE]).unwrap();
    during_demotion(&gate, &b, || b.write(0, &[0xBB; 100]).unwrap());
    assert_eq!(first_byte(&b), 0xBB);
    // The move that copied the old bytes gave up; evict then moved the
    // page as written.
    assert_eq!(rt.stats().abandoned_moves, 1);
    assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme), "evict tried again");
    let mut page = vec![0u8; PAGE];
    b.read(0, &mut page).unwrap();
    assert!(page[..100].iter().all(|&x| x == 0xBB) && page[100..].iter().all(|&x| x == 0xAA));
}

/// What a kernel or a C caller does: write through a pinned page's address.
#[test]
fn a_write_through_a_pin_racing_a_demotion_wins() {
    let dir = tempfile::tempdir().unwrap();
    let (rt, gate) = gated(dir.path());
    let b = rt.alloc(PAGE as u64).unwrap();
    b.write(0, &[0xAA; PAGE]).unwrap();
    during_demotion(&gate, &b, || {
        let pin = b.pin(0..PAGE as u64, Tier::Host).unwrap();
        let ptr = pin.addresses()[0] as *mut u8;
        // SAFETY: the pin keeps the page's host slot allocated and in place
        // until it drops; nothing else touches the page meanwhile (the
        // demotion copied it already and waits at the gate).
        unsafe { std::ptr::write_bytes(ptr, 0xBB, PAGE) };
    });
    assert_eq!(first_byte(&b), 0xBB);
    assert_eq!(rt.stats().abandoned_moves, 1);
}

/// A (simulated) kernel writing through the device map under a read-write
/// launch.
#[test]
fn a_kernel_write_racing_a_demotion_wins() {
    let dir = tempfile::tempdir().unwrap();
    let (rt, gate) = gated(dir.path());
    let b = rt.alloc(PAGE as u64).unwrap();
    b.write(0, &[0xAA; PAGE]).unwrap();
    let map = b.device_map().unwrap();
    during_demotion(&gate, &b, || {
        let launch = map.prepare(Access::ReadWrite).unwrap();
        let ptr = launch.entry(0) as *mut u8;
        // SAFETY: a read-write launch keeps every mapped page in place and
        // allocated until it drops; on the simulated device the entry is a
        // host address.
        unsafe { std::ptr::write_bytes(ptr, 0xCC, PAGE) };
    });
    assert_eq!(first_byte(&b), 0xCC);
    assert_eq!(rt.stats().abandoned_moves, 1);
}

#[test]
fn tickets_wait_with_any_timeout() {
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(4 * PAGE as u64)
        .build()
        .unwrap();
    let b = rt.alloc(PAGE as u64).unwrap();
    let t = b.prefetch(0..1, Tier::Device);
    let e = t.wait_timeout(Duration::MAX).unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "no device tier: {e}");
    assert!(t.poll().unwrap().is_err());
}

/// Capacity comes back when `drop` returns, even while the reclaimer or the
/// mover is working on the buffer's pages.
#[test]
fn a_dropped_buffer_gives_its_capacity_back_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 8 * PAGE as u64)
        .host(8 * PAGE as u64)
        .nvme(NvmeConfig::new(dir.path(), 32 * PAGE as u64, PAGE))
        .watermarks(Watermarks::new(0.1, 0.2))
        .build()
        .unwrap();
    let total: u64 = rt.stats().tiers.iter().map(|t| t.free_pages as u64).sum();
    for round in 0..200 {
        let b = rt
            .alloc(total * PAGE as u64)
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        b.write(0, &pattern(round, 0, 16 * PAGE)).unwrap();
        // Not waited for: the move may still be running at the drop.
        let _ = b.prefetch(0..b.len(), Tier::Nvme);
        drop(b);
    }
    // Every slot comes back once the background work has ended.
    for _ in 0..500 {
        if rt.stats().tiers.iter().all(|t| t.used_pages == 0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        rt.stats().tiers.iter().all(|t| t.used_pages == 0),
        "{:?}",
        rt.stats().tiers
    );
}

/// A stats snapshot taken while pages come and go reports each tier's
/// used and free slots from one reading: they add up to its capacity.
#[test]
fn a_stats_snapshot_during_first_writes_adds_up_to_the_capacity() {
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(64 * PAGE as u64)
        .background_eviction(false)
        .build()
        .unwrap();
    let capacity = rt.stats().tiers[0].free_pages;
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (rt, stop) = (rt.clone(), stop.clone());
        std::thread::spawn(move || {
            let page = pattern(1, 1, PAGE);
            while !stop.load(Ordering::Relaxed) {
                // A slot taken by the first write, given back by the drop.
                rt.alloc(PAGE as u64).unwrap().write(0, &page).unwrap();
            }
        })
    };
    let start = std::time::Instant::now();
    let mut seen = Vec::new();
    while seen.is_empty() && start.elapsed() < Duration::from_secs(3) {
        let host = &rt.stats().tiers[0];
        if host.used_pages + host.free_pages != capacity {
            seen.push((host.used_pages, host.free_pages));
        }
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    assert!(
        seen.is_empty(),
        "used and free {seen:?}, capacity {capacity}"
    );
}

/// A device map outliving its buffer refuses new launches.
#[test]
fn a_map_of_a_freed_buffer_refuses_launches() {
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(4 * PAGE as u64)
        .build()
        .unwrap();
    let b = rt.alloc(PAGE as u64).unwrap();
    let map = b.device_map().unwrap();
    drop(b);
    assert_eq!(
        map.prepare(Access::ReadOnly).unwrap_err().kind(),
        ErrorKind::Closed
    );
    assert_eq!(rt.stats().reserved_pages, 0);
}

fn engine_batches(rt: &Runtime, priority: &str) -> u64 {
    rt.stats()
        .engine
        .iter()
        .find(|p| p.priority == priority)
        .map_or(0, |p| p.batches)
}

fn wait_until(what: &str, done: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting: {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// 64 pages of DRAM over NVMe in `dir` whose I/O waits at a gate (closed),
/// in batches of 2 pages (many batches from few pages); background
/// eviction off.
fn gated_batches(dir: &std::path::Path) -> (Runtime, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    let engine = Arc::new(GateEngine {
        inner: strata::io::engine(EngineChoice::Psync).unwrap(),
        gate: gate.clone(),
    });
    let mut nvme = NvmeConfig::new(dir, 128 * PAGE as u64, PAGE);
    nvme.queue_depth = 2;
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(64 * PAGE as u64)
        .nvme(nvme)
        .nvme_engine(engine)
        .background_eviction(false)
        .build()
        .unwrap();
    (rt, gate)
}

/// A demand move submitted behind a queue of background demotions on the
/// same lane runs before them: the first worker to come free takes it.
#[test]
fn a_demand_move_overtakes_queued_background_moves() {
    let dir = tempfile::tempdir().unwrap();
    let (rt, gate) = gated_batches(dir.path());
    let a = rt.alloc(24 * PAGE as u64).unwrap();
    a.write(0, &vec![1u8; 24 * PAGE]).unwrap();
    let b = rt.alloc(PAGE as u64).unwrap();
    b.write(0, &[2u8; PAGE]).unwrap();

    // 12 background batches: the lane's two workers take two and hold
    // them at the closed engine; ten wait in the queue.
    let background = a.prefetch(0..a.len(), Tier::Nvme);
    wait_until("two prefetch batches at the engine", || {
        gate.waiting.load(Ordering::SeqCst) == 2
    });
    assert_eq!(engine_batches(&rt, "prefetch"), 2);
    // Whatever the outcome, the engine opens before the scope joins.
    struct Open<'a>(&'a Gate);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.open.store(true, Ordering::SeqCst);
        }
    }
    std::thread::scope(|s| {
        let demand = s.spawn(|| b.evict(0..b.len(), Tier::Nvme));
        let _open = Open(&gate);
        wait_until("the demand request queued", || {
            rt.stats().in_flight_moves == 24 + 1
        });
        // One write completes: its worker takes the demand batch, not the
        // next of the ten queued before it.
        *gate.left.lock() = 1;
        wait_until("a worker took the next batch", || {
            engine_batches(&rt, "demand") + engine_batches(&rt, "prefetch") == 3
        });
        assert_eq!(
            engine_batches(&rt, "demand"),
            1,
            "the demand batch went first"
        );
        assert_eq!(engine_batches(&rt, "prefetch"), 2);
        gate.open.store(true, Ordering::SeqCst);
        demand.join().unwrap().unwrap();
    });
    background.wait().unwrap();
    assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Nvme));
    assert!((0..24).all(|p| a.tier_of(p).unwrap() == Some(Tier::Nvme)));
    let mut out = vec![0u8; 24 * PAGE];
    a.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 1));
}

/// Cancelling a request drops its batches still queued — their pages stay
/// where they are, readable — and lets the batches already moving finish;
/// the ticket then completes with no error, and the engine's counts of
/// what is queued come back to zero, so later moves run as before.
#[test]
fn a_cancelled_request_drops_its_queued_batches() {
    let dir = tempfile::tempdir().unwrap();
    let (rt, gate) = gated_batches(dir.path());
    let a = rt.alloc(24 * PAGE as u64).unwrap();
    a.write(0, &vec![1u8; 24 * PAGE]).unwrap();
    // 12 batches: the lane's two workers hold two at the closed engine;
    // ten wait in the queue.
    let moving = a.prefetch(0..a.len(), Tier::Nvme);
    wait_until("two batches at the engine", || {
        gate.waiting.load(Ordering::SeqCst) == 2
    });
    assert!(!moving.is_cancelled());
    assert_eq!(a.cancel(&moving), 20, "the ten queued batches dropped");
    assert!(moving.is_cancelled());
    assert_eq!(rt.stats().in_flight_moves, 4, "the two running remain");
    assert!(moving.poll().is_none(), "the running batches are not done");
    gate.open.store(true, Ordering::SeqCst);
    moving.clone().wait().unwrap();
    assert_eq!(a.cancel(&moving), 0, "nothing left to drop");
    let on_nvme = (0..24)
        .filter(|&p| a.tier_of(p).unwrap() == Some(Tier::Nvme))
        .count();
    assert_eq!(on_nvme, 4, "only the batches that had started moved");
    assert_eq!(rt.stats().in_flight_moves, 0);
    // The engine runs the next request whole.
    a.prefetch(0..a.len(), Tier::Nvme).wait().unwrap();
    assert!((0..24).all(|p| a.tier_of(p).unwrap() == Some(Tier::Nvme)));
    let mut out = vec![0u8; 24 * PAGE];
    a.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 1));
}

/// A ticket cancelled through another runtime's buffer: nothing there to
/// drop (0), but the request is marked, and its own runtime's lanes drop
/// its queued batches as they reach them — the pages stay, the ticket
/// completes.
#[test]
fn a_request_cancelled_elsewhere_is_dropped_by_its_own_lanes() {
    let dir = tempfile::tempdir().unwrap();
    let (rt, gate) = gated_batches(dir.path());
    let other = Runtime::builder()
        .page_size(PAGE)
        .host(4 * PAGE as u64)
        .build()
        .unwrap();
    let elsewhere = other.alloc(PAGE as u64).unwrap();
    let a = rt.alloc(24 * PAGE as u64).unwrap();
    a.write(0, &vec![1u8; 24 * PAGE]).unwrap();
    let moving = a.prefetch(0..a.len(), Tier::Nvme);
    wait_until("two batches at the engine", || {
        gate.waiting.load(Ordering::SeqCst) == 2
    });
    assert_eq!(elsewhere.cancel(&moving), 0, "none of its batches here");
    assert!(moving.is_cancelled());
    gate.open.store(true, Ordering::SeqCst);
    moving.clone().wait().unwrap();
    let on_nvme = (0..24)
        .filter(|&p| a.tier_of(p).unwrap() == Some(Tier::Nvme))
        .count();
    assert_eq!(on_nvme, 4, "only the batches that had started moved");
    assert_eq!(rt.stats().in_flight_moves, 0);
    let mut out = vec![0u8; 24 * PAGE];
    a.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 1));
}

/// A prefetch cancelled while its batch is moving makes no room for what
/// did not fit, so it declines nothing: the pages that found the tier full
/// stay where they are as the cancel asked, and neither the ticket nor
/// `Stats::prefetches_declined` counts them as declined.
#[test]
fn a_prefetch_cancelled_while_it_moves_declines_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (rt, gate) = gated(dir.path());
    // Three of the host tier's four slots taken by pages room could be made
    // from (demoted to NVMe, which has room).
    let hot = rt.alloc(3 * PAGE as u64).unwrap();
    hot.write(0, &vec![7u8; 3 * PAGE]).unwrap();
    let a = rt
        .alloc_with(2 * PAGE as u64, strata::Placement::Prefer(Tier::Nvme))
        .unwrap();
    a.write(0, &vec![1u8; 2 * PAGE]).unwrap();
    assert_eq!(a.tier_of(1).unwrap(), Some(Tier::Nvme));

    // One page fits in the host tier's free slot; its read waits at the
    // gate while the other page has found the tier full.
    gate.reads.store(true, Ordering::SeqCst);
    gate.open.store(false, Ordering::SeqCst);
    let t = a.prefetch(0..a.len(), Tier::Host);
    wait_until("the prefetch's read at the engine", || {
        gate.waiting.load(Ordering::SeqCst) == 1
    });
    assert_eq!(a.cancel(&t), 0, "its only batch is moving");
    gate.open.store(true, Ordering::SeqCst);
    t.clone().wait().unwrap();

    assert_eq!(
        a.tier_of(0).unwrap(),
        Some(Tier::Host),
        "the moving batch finished"
    );
    assert_eq!(
        a.tier_of(1).unwrap(),
        Some(Tier::Nvme),
        "no room made for it"
    );
    assert!((0..3).all(|p| hot.tier_of(p).unwrap() == Some(Tier::Host)));
    assert_eq!(t.declined(), 0, "cancelled, not declined");
    assert_eq!(rt.stats().prefetches_declined, 0);
}
