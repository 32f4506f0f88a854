//! The header's preamble, checked call by call: several threads drive
//! random sequences of C-ABI calls on shared handles, freeing handles and
//! destroying runtimes at random points, and every status and output is
//! checked against what the preamble promises (a model of which handles
//! are live, freed or closed). Then one focused test per promise that the
//! C ABI once broke.

mod common;

use std::collections::HashSet;
use std::ffi::{c_char, c_int, CString};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use common::*;
use strata_ffi::*;

// ---------------------------------------------------------------- model --

/// SplitMix64: a fixed seed gives a fixed sequence of tries.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Runtime,
    Buffer,
    Ticket,
    Pin,
    Map,
    Launch,
    Optim,
    Moe,
    ExpertPin,
}

/// What a handle is, as far as the model knows: live, being freed or
/// closed (either outcome possible), or gone (freed: INVALID_HANDLE;
/// closed: CLOSED).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct State {
    live: bool,
    freed: bool,
    closed: bool,
}

const LIVE: State = State {
    live: true,
    freed: false,
    closed: false,
};

impl State {
    fn stable(self) -> bool {
        // Live alone, or gone for good.
        self == LIVE || !self.live
    }
    fn union(self, o: State) -> State {
        State {
            live: self.live || o.live,
            freed: self.freed || o.freed,
            closed: self.closed || o.closed,
        }
    }
}

struct Entry {
    kind: Kind,
    bits: u64,
    /// The runtime entry whose destruction closes it (None: not a child).
    rt: Option<usize>,
    /// Bytes (buffers), pages (pins, maps, launches), weights (optimizers).
    size: u64,
    state: State,
}

#[derive(Default)]
struct Pool {
    entries: Vec<Entry>,
}

/// A handle picked for a call: its bits and the state when picked.
#[derive(Clone, Copy)]
struct Pick {
    idx: Option<usize>,
    bits: u64,
    size: u64,
    at: State,
}

const NULL_STATE: State = State {
    live: false,
    freed: false,
    closed: false,
};

struct World {
    pool: Mutex<Pool>,
    dir: tempfile::TempDir,
    traces: AtomicU64,
}

impl World {
    fn state(&self, idx: usize) -> State {
        self.pool.lock().unwrap().entries[idx].state
    }

    /// Whether the runtime of entry `idx` (a runtime or its child) has an
    /// NVMe tier (runtimes from TOML do; a runtime's `size` says).
    fn has_nvme(&self, idx: Option<usize>) -> bool {
        let p = self.pool.lock().unwrap();
        idx.and_then(|i| p.entries[i].rt)
            .is_some_and(|r| p.entries[r].size == 1)
    }

    fn count_live(&self, kind: Kind) -> usize {
        let p = self.pool.lock().unwrap();
        p.entries
            .iter()
            .filter(|e| e.kind == kind && e.state.live)
            .count()
    }

    /// A handle of `kind`: mostly one from the pool (live or not), now and
    /// then NULL or a forged one.
    fn pick(&self, rng: &mut Rng, kind: Kind) -> Pick {
        if rng.one_in(25) {
            return Pick {
                idx: None,
                bits: 0,
                size: 0,
                at: NULL_STATE,
            };
        }
        if rng.one_in(25) {
            // Tag 0x7f is no handle type's.
            return Pick {
                idx: None,
                bits: 0x7f << 56 | rng.below(1 << 40),
                size: 0,
                at: State {
                    live: false,
                    freed: true,
                    closed: false,
                },
            };
        }
        let p = self.pool.lock().unwrap();
        let of: Vec<usize> = (0..p.entries.len())
            .filter(|&i| p.entries[i].kind == kind)
            .collect();
        if of.is_empty() {
            return Pick {
                idx: None,
                bits: 0,
                size: 0,
                at: NULL_STATE,
            };
        }
        // Prefer live handles two to one.
        let live: Vec<usize> = of
            .iter()
            .copied()
            .filter(|&i| p.entries[i].state.live)
            .collect();
        let i = if !live.is_empty() && rng.below(3) < 2 {
            live[rng.below(live.len() as u64) as usize]
        } else {
            of[rng.below(of.len() as u64) as usize]
        };
        let e = &p.entries[i];
        Pick {
            idx: Some(i),
            bits: e.bits,
            size: e.size,
            at: e.state,
        }
    }

    /// The states a call on `pick` may have seen: from when it was picked
    /// to now.
    fn seen(&self, pick: Pick) -> State {
        match pick.idx {
            None => pick.at,
            Some(i) => pick.at.union(self.state(i)),
        }
    }

    /// As [`seen`](Self::seen), for a call that makes a child through the
    /// object: if the object's runtime was destroyed meanwhile, the call
    /// may be refused with CLOSED even though the object was only freed.
    fn seen_making(&self, pick: Pick) -> State {
        let mut s = self.seen(pick);
        let p = self.pool.lock().unwrap();
        if let Some(r) = pick.idx.and_then(|i| p.entries[i].rt) {
            s.closed |= p.entries[r].state.closed;
        }
        s
    }

    /// Registers a handle a call made through the runtime entry `rt`.
    fn add(&self, kind: Kind, bits: u64, rt: Option<usize>, size: u64) {
        assert_ne!(
            bits, 0,
            "a {kind:?} handle made by a successful call is NULL"
        );
        let mut p = self.pool.lock().unwrap();
        // A child made while its runtime was being destroyed may have been
        // swept; one made before a destruction that has finished was.
        let state = match rt.map(|r| p.entries[r].state) {
            Some(s) if !s.live => State {
                live: false,
                freed: false,
                closed: true,
            },
            Some(s) if s.closed => State {
                live: true,
                freed: false,
                closed: true,
            },
            _ => LIVE,
        };
        p.entries.push(Entry {
            kind,
            bits,
            rt,
            size,
            state,
        });
    }

    /// Claims a live handle for freeing (true), so that only one thread
    /// frees it; false if it is not live-only.
    fn begin_free(&self, idx: usize) -> bool {
        let mut p = self.pool.lock().unwrap();
        let e = &mut p.entries[idx];
        if e.state != LIVE {
            return false;
        }
        e.state.freed = true;
        true
    }

    fn end_free(&self, idx: usize, status: c_int) {
        let mut p = self.pool.lock().unwrap();
        let e = &mut p.entries[idx];
        e.state = if status == STRATA_OK {
            State {
                live: false,
                freed: true,
                closed: false,
            }
        } else {
            assert_eq!(status, STRATA_ERR_CLOSED, "a claimed free failed");
            State {
                live: false,
                freed: false,
                closed: true,
            }
        };
    }

    fn begin_destroy(&self, idx: usize) -> bool {
        let mut p = self.pool.lock().unwrap();
        if p.entries[idx].state != LIVE {
            return false;
        }
        for e in p.entries.iter_mut() {
            if e.rt == Some(idx) && e.state.live {
                e.state.closed = true;
            }
        }
        true
    }

    fn end_destroy(&self, idx: usize) {
        let mut p = self.pool.lock().unwrap();
        for e in p.entries.iter_mut() {
            // A child being freed meanwhile is settled by its freer.
            if e.rt == Some(idx) && e.state.live && !e.state.freed {
                e.state = State {
                    live: false,
                    freed: false,
                    closed: true,
                };
            }
        }
    }
}

const SENTINEL: u8 = 0xa5;

/// Scratch memory for out-pointers, filled with a sentinel so that a write
/// shows.
#[repr(C, align(16))]
struct Scratch([u8; 256]);

impl Scratch {
    fn new() -> Self {
        Scratch([SENTINEL; 256])
    }
    fn untouched(&self) -> bool {
        self.0.iter().all(|&b| b == SENTINEL)
    }
    /// A pointer to a `T` at byte `at`.
    fn at<T>(&mut self, at: usize) -> *mut T {
        self.0[at..].as_mut_ptr().cast()
    }
}

/// How an out-pointer is passed: good, NULL or misaligned.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Ptr {
    Good,
    Null,
    Misaligned,
}

impl Ptr {
    fn draw(rng: &mut Rng) -> Ptr {
        match rng.below(14) {
            0 => Ptr::Null,
            1 => Ptr::Misaligned,
            _ => Ptr::Good,
        }
    }
    /// A pointer into `s` at byte `at` (aligned for every type used).
    fn make<T>(self, s: &mut Scratch, at: usize) -> *mut T {
        match self {
            Ptr::Good => s.at(at),
            Ptr::Null => null_mut(),
            Ptr::Misaligned => s.at(at + 1),
        }
    }
    /// The status a bad pointer must give.
    fn status(self) -> Option<c_int> {
        match self {
            Ptr::Good => None,
            Ptr::Null => Some(STRATA_ERR_NULL_POINTER),
            Ptr::Misaligned => Some(STRATA_ERR_INVALID_ARGUMENT),
        }
    }
}

/// Two bad arguments at once: either may be told.
const EITHER: c_int = c_int::MIN;

trait Also {
    /// Both bad statuses, if both arguments are bad.
    fn also(self, other: Option<c_int>) -> Option<c_int>;
}

impl Also for Option<c_int> {
    fn also(self, other: Option<c_int>) -> Option<c_int> {
        match (self, other) {
            (Some(a), Some(b)) if a != b => Some(EITHER),
            (a, b) => a.or(b),
        }
    }
}

/// Checks one call's status against the preamble. `seen`: the handle's
/// states during the call; `bad`: the status a bad argument (a pointer)
/// must give; `ok`: the statuses the call may give on a live handle with
/// good arguments. Returns true if the call succeeded (status >= 0).
#[track_caller]
fn check(what: &str, status: c_int, seen: State, bad: Option<c_int>, ok: &[c_int]) -> bool {
    assert_ne!(
        status,
        STRATA_ERR_PANIC,
        "{what}: a panic: {}",
        last_error()
    );
    let mut allowed: Vec<c_int> = Vec::new();
    if seen == NULL_STATE {
        allowed.push(STRATA_ERR_NULL_POINTER);
    }
    if seen.freed {
        allowed.push(STRATA_ERR_INVALID_HANDLE);
    }
    if seen.closed {
        allowed.push(STRATA_ERR_CLOSED);
    }
    match bad {
        // A bad pointer is refused; which of it and a dead handle is told
        // first the preamble does not say.
        Some(EITHER) => {
            allowed.extend_from_slice(&[STRATA_ERR_INVALID_ARGUMENT, STRATA_ERR_NULL_POINTER])
        }
        Some(b) => allowed.push(b),
        None if seen.live => allowed.extend_from_slice(ok),
        None => {}
    }
    assert!(
        allowed.contains(&status),
        "{what}: status {status} ({}), allowed {allowed:?} (handle {seen:?}), last error: {}",
        status_name(status),
        last_error()
    );
    if status < 0 {
        let message = last_error();
        let name = what.split('(').next().unwrap();
        assert!(
            message.starts_with(name) || name == "strata_last_error_copy",
            "{what}: the last error {message:?} does not name the function"
        );
    }
    status >= 0
}

fn status_name(s: c_int) -> String {
    // SAFETY: a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(strata_status_string(s)) }
        .to_string_lossy()
        .into_owned()
}

fn h<T>(bits: u64) -> *mut T {
    std::ptr::without_provenance_mut(bits as usize)
}

fn bits<T>(p: *mut T) -> u64 {
    p.addr() as u64
}

const PAGE_SIZE: u64 = PAGE;
const RT_DEVICE_PAGES: u64 = 4;
const RT_HOST_PAGES: u64 = 24;
const WEIGHTS: usize = 1024;

fn sim_config() -> strata_config {
    let none = CString::new("").unwrap();
    config(RT_DEVICE_PAGES, RT_HOST_PAGES, 0, &none)
}

fn moe_config() -> strata_moe_config {
    let mut c = std::mem::MaybeUninit::<strata_moe_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(unsafe { strata_moe_config_init(c.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: filled above.
    let mut c = unsafe { c.assume_init() };
    c.device_slots = 2;
    c.slot_bytes = 64 << 10;
    c.host_bytes = 1 << 20;
    c
}

fn optim_config() -> strata_optim_config {
    let mut c = std::mem::MaybeUninit::<strata_optim_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_optim_config_init(c.as_mut_ptr()) },
        STRATA_OK
    );
    // SAFETY: filled above.
    let mut c = unsafe { c.assume_init() };
    c.chunk_bytes = 4096;
    c
}

/// One random call, checked.
#[allow(clippy::too_many_lines)]
fn step(w: &World, rng: &mut Rng) {
    use Kind::*;
    let mut s = Scratch::new();
    let op = rng.below(57);
    match op {
        // ------------------------------------------------ runtimes --
        0 | 1 => {
            let p = w.pick(rng, Runtime);
            let ptr = Ptr::draw(rng);
            let bytes = if rng.one_in(10) {
                0
            } else {
                (1 + rng.below(4)) * PAGE_SIZE - rng.below(100)
            };
            let out = ptr.make::<*mut strata_buffer>(&mut s, 0);
            let (status, what, bad_tier) = if op == 0 {
                // SAFETY: `out` is NULL, misaligned (refused) or writable.
                let st = unsafe { strata_alloc(h(p.bits), bytes, out) };
                (st, "strata_alloc", false)
            } else {
                let tier = [STRATA_TIER_DEVICE, STRATA_TIER_HOST, STRATA_TIER_NVME, 9]
                    [rng.below(4) as usize];
                // SAFETY: as above.
                let st = unsafe { strata_alloc_in(h(p.bits), bytes, tier, out) };
                let bad_tier = tier == 9 || (tier == STRATA_TIER_NVME && !w.has_nvme(p.idx));
                (st, "strata_alloc_in", bad_tier)
            };
            let bad = ptr
                .status()
                .also((bytes == 0 || bad_tier).then_some(STRATA_ERR_INVALID_ARGUMENT));
            let ok = [STRATA_OK, STRATA_ERR_OUT_OF_CAPACITY];
            // A destruction under way refuses new children with CLOSED.
            if check(what, status, w.seen(p), bad, &ok) {
                // SAFETY: a good pointer, written by the call.
                let b = unsafe { *out };
                w.add(Buffer, bits(b), p.idx, bytes);
            } else {
                assert!(s.untouched(), "{what}: out-pointer written on error");
            }
        }
        2 => {
            let p = w.pick(rng, Runtime);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<usize>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_runtime_page_size(h(p.bits), out) };
            if check(
                "strata_runtime_page_size",
                st,
                w.seen(p),
                ptr.status(),
                &[0],
            ) {
                // SAFETY: written by the call.
                assert_eq!(unsafe { *out }, PAGE_SIZE as usize);
            } else {
                assert!(s.untouched());
            }
        }
        3 => {
            let p = w.pick(rng, Runtime);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<u32>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_runtime_tiers(h(p.bits), out) };
            if check("strata_runtime_tiers", st, w.seen(p), ptr.status(), &[0]) {
                // SAFETY: written by the call.
                let m = unsafe { *out };
                let nvme = if w.has_nvme(p.idx) {
                    1 << STRATA_TIER_NVME
                } else {
                    0
                };
                assert_eq!(m, 1 << STRATA_TIER_DEVICE | 1 << STRATA_TIER_HOST | nvme);
            } else {
                assert!(s.untouched());
            }
        }
        4 => {
            let p = w.pick(rng, Runtime);
            let (ptr, lptr) = (Ptr::draw(rng), Ptr::draw(rng));
            let json = ptr.make::<*mut c_char>(&mut s, 0);
            // `len` is optional: NULL is fine.
            let len = lptr.make::<usize>(&mut s, 16);
            // `json` is checked first.
            let bad = ptr.status().also(match lptr {
                Ptr::Misaligned => Some(STRATA_ERR_INVALID_ARGUMENT),
                _ => None,
            });
            // SAFETY: as above.
            let st = unsafe { strata_stats_json(h(p.bits), json, len) };
            if check("strata_stats_json", st, w.seen(p), bad, &[0]) {
                // SAFETY: written by the call.
                let j = unsafe { *json };
                assert_eq!(strata_string_free(j), STRATA_OK);
                assert_eq!(strata_string_free(j), STRATA_ERR_INVALID_HANDLE);
            } else {
                assert!(s.untouched(), "strata_stats_json wrote on error");
            }
        }
        5 => {
            let p = w.pick(rng, Runtime);
            let mut big = vec![SENTINEL as c_char; 1 << 16];
            let cap = [0usize, 8, 1 << 16][rng.below(3) as usize];
            let nullbuf = rng.one_in(8) && cap > 0;
            let buf = if nullbuf || cap == 0 {
                null_mut()
            } else {
                big.as_mut_ptr()
            };
            let lptr = Ptr::draw(rng);
            let len = lptr.make::<usize>(&mut s, 0);
            // SAFETY: `buf` holds `cap` bytes or is NULL.
            let st = unsafe { strata_stats_json_copy(h(p.bits), buf, cap, len) };
            let bad = if lptr == Ptr::Misaligned {
                Some(STRATA_ERR_INVALID_ARGUMENT)
            } else if nullbuf {
                Some(STRATA_ERR_NULL_POINTER)
            } else {
                None
            };
            let ok = [STRATA_OK, STRATA_ERR_BUFFER_TOO_SMALL];
            let seen = w.seen(p);
            if bad.is_some() && lptr == Ptr::Misaligned && nullbuf {
                // Either pointer may be told first.
                assert!(
                    st == STRATA_ERR_INVALID_ARGUMENT
                        || st == STRATA_ERR_NULL_POINTER
                        || (!seen.live && st < 0),
                    "{st}"
                );
                assert!(s.untouched());
                return;
            }
            check("strata_stats_json_copy", st, seen, bad, &ok);
            if st == STRATA_ERR_BUFFER_TOO_SMALL {
                if lptr == Ptr::Good {
                    // SAFETY: written by the call.
                    assert!(unsafe { *len } + 1 > cap);
                }
            } else if st < 0 {
                assert!(s.untouched(), "stats_json_copy: len written on error");
                assert!(big.iter().all(|&b| b == SENTINEL as c_char));
            }
        }
        6 | 7 => {
            let p = w.pick(rng, Runtime);
            if op == 6 {
                let n = w.traces.fetch_add(1, Ordering::Relaxed);
                let path = c_path(&w.dir.path().join(format!("{n}.trace")));
                // SAFETY: a NUL-terminated path.
                let st = unsafe { strata_trace_start(h(p.bits), path.as_ptr(), 4) };
                let ok = [STRATA_OK, STRATA_ERR_INVALID_ARGUMENT];
                check("strata_trace_start", st, w.seen(p), None, &ok);
            } else {
                let ptr = Ptr::draw(rng);
                let out = ptr.make::<u64>(&mut s, 0);
                // SAFETY: as above (NULL is allowed).
                let st = unsafe { strata_trace_stop(h(p.bits), out) };
                let bad = (ptr == Ptr::Misaligned).then_some(STRATA_ERR_INVALID_ARGUMENT);
                // No trace running: INVALID_ARGUMENT.
                let ok = [STRATA_OK, STRATA_ERR_INVALID_ARGUMENT];
                if !check("strata_trace_stop", st, w.seen(p), bad, &ok) || ptr != Ptr::Good {
                    assert!(s.untouched());
                }
            }
        }
        8 => {
            let p = w.pick(rng, Runtime);
            let policy = if rng.one_in(6) { 99 } else { STRATA_POLICY_LFU };
            let st = strata_balancer_start(h(p.bits), policy, 2000, 0);
            let bad = (policy == 99).then_some(STRATA_ERR_INVALID_ARGUMENT);
            check("strata_balancer_start", st, w.seen(p), bad, &[0]);
            let p = w.pick(rng, Runtime);
            let st = strata_balancer_stop(h(p.bits));
            check("strata_balancer_stop", st, w.seen(p), None, &[0]);
            let p = w.pick(rng, Runtime);
            let st = strata_runtime_check(h(p.bits));
            check("strata_runtime_check", st, w.seen(p), None, &[0]);
        }
        9 => {
            let p = w.pick(rng, Runtime);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<strata_balance_report>(&mut s, 0);
            // SAFETY: as above (NULL is allowed).
            let st = unsafe { strata_balance_once(h(p.bits), out) };
            let bad = (ptr == Ptr::Misaligned).then_some(STRATA_ERR_INVALID_ARGUMENT);
            if !check("strata_balance_once", st, w.seen(p), bad, &[0]) || ptr != Ptr::Good {
                assert!(s.untouched());
            }
        }
        10 => {
            let p = w.pick(rng, Runtime);
            match p.idx {
                Some(i) if w.begin_destroy(i) => {
                    let st = strata_runtime_destroy(h(p.bits));
                    assert_eq!(st, STRATA_OK, "{}", last_error());
                    w.end_destroy(i);
                }
                // Only once it is surely gone, so that no other destruction
                // of it is under way.
                _ if p.bits == 0 => assert_eq!(strata_runtime_destroy(null_mut()), STRATA_OK),
                _ if p.at.stable() && p.at != LIVE => {
                    let st = strata_runtime_destroy(h(p.bits));
                    check("strata_runtime_destroy", st, p.at, None, &[]);
                }
                _ => {}
            }
        }
        11 | 12 => {
            if w.count_live(Runtime) >= 3 {
                return;
            }
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<*mut strata_runtime>(&mut s, 0);
            let (st, what, bad, nvme) = if op == 11 {
                let mut c = sim_config();
                let bad = if rng.one_in(6) {
                    c.page_size = 1000;
                    Some(STRATA_ERR_INVALID_ARGUMENT)
                } else {
                    None
                };
                // SAFETY: a readable config; `out` as above.
                let st = unsafe { strata_runtime_create(&c, out) };
                (st, "strata_runtime_create", ptr.status().also(bad), 0)
            } else {
                let text = format!(
                    "device = \"sim\"\ndevice_capacity = \"256k\"\n[host]\ncapacity = \"1536k\"\n\
                     [nvme]\npath = {:?}\ncapacity = \"1M\"\n",
                    w.dir.path().display().to_string()
                );
                let flags = if rng.one_in(6) { 2 } else { 0 };
                // SAFETY: readable text; `out` as above.
                let st = unsafe {
                    strata_runtime_from_toml(text.as_ptr().cast(), text.len(), flags, out)
                };
                let bad = (flags != 0).then_some(STRATA_ERR_INVALID_ARGUMENT);
                (st, "strata_runtime_from_toml", ptr.status().also(bad), 1)
            };
            if check(what, st, LIVE, bad, &[0]) {
                // SAFETY: written by the call.
                let r = unsafe { *out };
                let mut pool = w.pool.lock().unwrap();
                let idx = pool.entries.len();
                pool.entries.push(Entry {
                    kind: Runtime,
                    bits: bits(r),
                    rt: Some(idx),
                    size: nvme,
                    state: LIVE,
                });
            } else {
                assert!(s.untouched());
            }
        }
        // ------------------------------------------------- buffers --
        13 => {
            let p = w.pick(rng, Buffer);
            free_call(w, p, "strata_buffer_free", |b| strata_buffer_free(h(b)));
        }
        14 | 15 => {
            let p = w.pick(rng, Buffer);
            let ptr = Ptr::draw(rng);
            if op == 14 {
                let out = ptr.make::<u64>(&mut s, 0);
                // SAFETY: as above.
                let st = unsafe { strata_buffer_len(h(p.bits), out) };
                if check("strata_buffer_len", st, w.seen(p), ptr.status(), &[0]) {
                    // SAFETY: written by the call.
                    assert_eq!(unsafe { *out }, p.size);
                } else {
                    assert!(s.untouched());
                }
            } else {
                let out = ptr.make::<usize>(&mut s, 0);
                // SAFETY: as above.
                let st = unsafe { strata_buffer_page_count(h(p.bits), out) };
                if check(
                    "strata_buffer_page_count",
                    st,
                    w.seen(p),
                    ptr.status(),
                    &[0],
                ) {
                    // SAFETY: written by the call.
                    assert_eq!(unsafe { *out } as u64, p.size.div_ceil(PAGE_SIZE));
                } else {
                    assert!(s.untouched());
                }
            }
        }
        16 => {
            let p = w.pick(rng, Buffer);
            let ptr = Ptr::draw(rng);
            let pages = p.size.div_ceil(PAGE_SIZE);
            let page = rng.below(pages + 2);
            let out = ptr.make::<strata_tier>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_buffer_tier_of(h(p.bits), page as usize, out) };
            let bad = ptr
                .status()
                .also((page >= pages).then_some(STRATA_ERR_INVALID_ARGUMENT));
            if check("strata_buffer_tier_of", st, w.seen(p), bad, &[0]) {
                // SAFETY: written by the call.
                let t = unsafe { *out };
                let tiers = [
                    STRATA_TIER_NONE,
                    STRATA_TIER_DEVICE,
                    STRATA_TIER_HOST,
                    STRATA_TIER_NVME,
                ];
                assert!(tiers.contains(&t), "{t}");
            } else {
                assert!(s.untouched());
            }
        }
        17 | 18 => {
            let p = w.pick(rng, Buffer);
            let (offset, len, bad) = range_in(rng, p.size);
            let mut data = vec![SENTINEL; len as usize];
            let st = if op == 17 {
                read(h(p.bits), offset, &mut data)
            } else {
                data.fill(op as u8);
                write(h(p.bits), offset, &data)
            };
            let what = if op == 17 {
                "strata_read"
            } else {
                "strata_write"
            };
            // Writes are refused while a read-only launch maps the pages.
            let ok: &[c_int] = if op == 17 {
                &[0]
            } else {
                &[0, STRATA_ERR_OUT_OF_CAPACITY, STRATA_ERR_INVALID_ARGUMENT]
            };
            if !check(what, st, w.seen(p), bad, ok) && op == 17 {
                assert!(data.iter().all(|&b| b == SENTINEL), "read wrote on error");
            }
        }
        19 => {
            let p = w.pick(rng, Buffer);
            let (offset, len, bad) = range_in(rng, p.size);
            let to = [STRATA_TIER_HOST, STRATA_TIER_DEVICE][rng.below(2) as usize];
            let st = strata_evict(h(p.bits), offset, len, to);
            check(
                "strata_evict",
                st,
                w.seen(p),
                bad,
                &[0, STRATA_ERR_OUT_OF_CAPACITY],
            );
        }
        20 => {
            let p = w.pick(rng, Buffer);
            let (offset, len, bad) = range_in(rng, p.size);
            let tier =
                [STRATA_TIER_DEVICE, STRATA_TIER_HOST, STRATA_TIER_NVME, -5][rng.below(4) as usize];
            let bad_tier = tier == -5 || (tier == STRATA_TIER_NVME && !w.has_nvme(p.idx));
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<*mut strata_ticket>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_prefetch(h(p.bits), offset, len, tier, out) };
            let bad = ptr.status().also(if bad_tier {
                Some(STRATA_ERR_INVALID_ARGUMENT)
            } else {
                bad
            });
            // Promise: with good arguments the moves' errors come from the
            // ticket, never from here (only a destruction under way: CLOSED).
            if check("strata_prefetch", st, w.seen_making(p), bad, &[0]) {
                // SAFETY: written by the call.
                let t = unsafe { *out };
                let rt = p.idx.and_then(|i| w.pool.lock().unwrap().entries[i].rt);
                w.add(Ticket, bits(t), rt, 0);
            } else {
                assert!(s.untouched(), "strata_prefetch wrote on error");
            }
        }
        21 => {
            let p = w.pick(rng, Buffer);
            let (offset, len, bad) = range_in(rng, p.size);
            let tier = [STRATA_TIER_DEVICE, STRATA_TIER_HOST][rng.below(2) as usize];
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<*mut strata_pin>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_buffer_pin(h(p.bits), offset, len.max(1), tier, out) };
            let bad = ptr.status().also(bad);
            // A page pinned in another tier: INVALID_ARGUMENT.
            let ok = [0, STRATA_ERR_OUT_OF_CAPACITY, STRATA_ERR_INVALID_ARGUMENT];
            if check("strata_buffer_pin", st, w.seen_making(p), bad, &ok) {
                // SAFETY: written by the call.
                let pin = unsafe { *out };
                let rt = p.idx.and_then(|i| w.pool.lock().unwrap().entries[i].rt);
                w.add(Pin, bits(pin), rt, 0);
            } else {
                assert!(s.untouched());
            }
        }
        22 => {
            let p = w.pick(rng, Buffer);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<*mut strata_map>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_device_map(h(p.bits), out) };
            if check(
                "strata_device_map",
                st,
                w.seen_making(p),
                ptr.status(),
                &[0],
            ) {
                // SAFETY: written by the call.
                let m = unsafe { *out };
                let rt = p.idx.and_then(|i| w.pool.lock().unwrap().entries[i].rt);
                w.add(Map, bits(m), rt, p.size.div_ceil(PAGE_SIZE));
            } else {
                assert!(s.untouched());
            }
        }
        23 => {
            let p = w.pick(rng, Buffer);
            let cap = rng.below(3) as usize;
            let decay = if rng.one_in(8) { 0.0 } else { 0.5 };
            let (hl, cl) = (Ptr::draw(rng), Ptr::draw(rng));
            let (hp, hs, cp, cs) = (
                s.at::<u64>(0),
                s.at::<f32>(16),
                s.at::<u64>(32),
                s.at::<f32>(48),
            );
            let (hlen, clen) = (hl.make::<usize>(&mut s, 64), cl.make::<usize>(&mut s, 80));
            // SAFETY: each array holds 2 elements (cap <= 2); lengths as above.
            let st =
                unsafe { strata_buffer_harvest(h(p.bits), decay, cap, hp, hs, hlen, cp, cs, clen) };
            let bad = (decay == 0.0)
                .then_some(STRATA_ERR_INVALID_ARGUMENT)
                .also(hl.status())
                .also(cl.status());
            let seen = w.seen(p);
            if bad.is_some() {
                assert!(
                    [
                        STRATA_ERR_INVALID_ARGUMENT,
                        STRATA_ERR_NULL_POINTER,
                        STRATA_ERR_INVALID_HANDLE,
                        STRATA_ERR_CLOSED
                    ]
                    .contains(&st),
                    "harvest: {st}"
                );
            } else {
                check("strata_buffer_harvest", st, seen, None, &[0]);
            }
            if st < 0 {
                assert!(s.untouched(), "harvest wrote on error");
            }
        }
        24 => {
            let p = w.pick(rng, Buffer);
            let pages = p.size.div_ceil(PAGE_SIZE);
            let (offset, len) = (0, (pages * PAGE_SIZE).min(p.size) / 4 * 4);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<*mut DLManagedTensor>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe {
                strata_dlpack_export(h(p.bits), offset, len, STRATA_TIER_HOST, 2, 32, 1, out)
            };
            let bad = ptr
                .status()
                .also((len == 0).then_some(STRATA_ERR_INVALID_ARGUMENT));
            let ok = [
                0,
                STRATA_ERR_OUT_OF_CAPACITY,
                STRATA_ERR_UNSUPPORTED,
                STRATA_ERR_INVALID_ARGUMENT,
            ];
            if check("strata_dlpack_export", st, w.seen(p), bad, &ok) {
                // SAFETY: written by the call.
                let t = unsafe { *out };
                if rng.one_in(2) {
                    assert_eq!(strata_dlpack_free(t), STRATA_OK);
                } else {
                    // SAFETY: a live tensor from strata; its deleter once.
                    unsafe { ((*t).deleter.unwrap())(t) };
                }
                assert_eq!(strata_dlpack_free(t), STRATA_ERR_INVALID_HANDLE);
            } else {
                assert!(s.untouched());
            }
        }
        // ------------------------------------------------- tickets --
        25..=27 => {
            let p = w.pick(rng, Ticket);
            let (st, what) = match op {
                25 => (strata_ticket_wait(h(p.bits)), "strata_ticket_wait"),
                26 => (strata_ticket_poll(h(p.bits)), "strata_ticket_poll"),
                _ => (
                    strata_ticket_wait_timeout(h(p.bits), rng.below(200_000)),
                    "strata_ticket_wait_timeout",
                ),
            };
            // A move's error (a full tier); PENDING only from the polls.
            let ok: &[c_int] = if op == 25 {
                &[STRATA_OK, STRATA_ERR_OUT_OF_CAPACITY]
            } else {
                &[STRATA_OK, STRATA_PENDING, STRATA_ERR_OUT_OF_CAPACITY]
            };
            check(what, st, w.seen(p), None, ok);
        }
        28 => {
            let p = w.pick(rng, Ticket);
            free_call(w, p, "strata_ticket_free", |b| strata_ticket_free(h(b)));
        }
        // ---------------------------------------------------- pins --
        29 => {
            let p = w.pick(rng, Pin);
            let ptrs = [Ptr::draw(rng), Ptr::draw(rng), Ptr::draw(rng)];
            let t = ptrs[0].make::<strata_tier>(&mut s, 0);
            let f = ptrs[1].make::<usize>(&mut s, 16);
            let c = ptrs[2].make::<usize>(&mut s, 32);
            // SAFETY: each NULL, misaligned (refused) or writable.
            let st = unsafe { strata_pin_info(h(p.bits), t, f, c) };
            let bad = ptrs
                .contains(&Ptr::Misaligned)
                .then_some(STRATA_ERR_INVALID_ARGUMENT);
            if check("strata_pin_info", st, w.seen(p), bad, &[0]) {
                if ptrs[2] == Ptr::Good {
                    // SAFETY: written by the call.
                    assert!(unsafe { *c } >= 1);
                }
            } else {
                assert!(s.untouched(), "strata_pin_info wrote on error");
            }
        }
        30 => {
            let p = w.pick(rng, Pin);
            let cap = rng.below(3) as usize;
            let ptr = Ptr::draw(rng);
            let count = ptr.make::<usize>(&mut s, 64);
            let nullarr = cap > 0 && rng.one_in(8);
            let arr = if nullarr { null_mut() } else { s.at::<u64>(0) };
            // SAFETY: `arr` holds 2 or more u64s or is NULL.
            let st = unsafe { strata_pin_addresses(h(p.bits), arr, cap, count) };
            let bad = ptr
                .status()
                .also(nullarr.then_some(STRATA_ERR_NULL_POINTER));
            let ok = [STRATA_OK, STRATA_ERR_BUFFER_TOO_SMALL];
            check("strata_pin_addresses", st, w.seen(p), bad, &ok);
            if st < 0 && st != STRATA_ERR_BUFFER_TOO_SMALL {
                assert!(s.untouched(), "strata_pin_addresses wrote on error");
            }
        }
        31 => {
            let p = w.pick(rng, Pin);
            free_call(w, p, "strata_unpin", |b| strata_unpin(h(b)));
        }
        // ---------------------------------------- maps and launches --
        32 => {
            let p = w.pick(rng, Map);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<usize>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_map_pages(h(p.bits), out) };
            if check("strata_map_pages", st, w.seen(p), ptr.status(), &[0]) {
                // SAFETY: written by the call.
                assert_eq!(unsafe { *out } as u64, p.size);
            } else {
                assert!(s.untouched());
            }
        }
        33 => {
            let p = w.pick(rng, Map);
            let cap = rng.below(5) as usize;
            let ptr = Ptr::draw(rng);
            let count = ptr.make::<usize>(&mut s, 64);
            let arr = s.at::<u32>(0);
            // SAFETY: `arr` holds 16 u32s.
            let st = unsafe { strata_map_counts(h(p.bits), arr, cap, count) };
            let ok = [STRATA_OK, STRATA_ERR_BUFFER_TOO_SMALL];
            check("strata_map_counts", st, w.seen(p), ptr.status(), &ok);
            if st < 0 && st != STRATA_ERR_BUFFER_TOO_SMALL {
                assert!(s.untouched(), "strata_map_counts wrote on error");
            }
        }
        34 => {
            let p = w.pick(rng, Map);
            let access =
                [STRATA_ACCESS_READ_ONLY, STRATA_ACCESS_READ_WRITE, 7][rng.below(3) as usize];
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<*mut strata_launch>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_map_prepare(h(p.bits), access, out) };
            let bad = ptr
                .status()
                .also((access == 7).then_some(STRATA_ERR_INVALID_ARGUMENT));
            // CLOSED: the map's buffer was freed; INVALID_ARGUMENT: a launch
            // of the buffer in the other mode is live.
            let ok = [
                0,
                STRATA_ERR_OUT_OF_CAPACITY,
                STRATA_ERR_CLOSED,
                STRATA_ERR_INVALID_ARGUMENT,
            ];
            if check("strata_map_prepare", st, w.seen_making(p), bad, &ok) {
                // SAFETY: written by the call.
                let l = unsafe { *out };
                let rt = p.idx.and_then(|i| w.pool.lock().unwrap().entries[i].rt);
                w.add(Launch, bits(l), rt, p.size);
            } else {
                assert!(s.untouched());
            }
        }
        35 => {
            let p = w.pick(rng, Map);
            free_call(w, p, "strata_map_free", |b| strata_map_free(h(b)));
        }
        36..=38 => {
            let p = w.pick(rng, Launch);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<u64>(&mut s, 0);
            let page = rng.below(p.size + 2);
            // SAFETY: as above.
            let (st, what, bad) = unsafe {
                match op {
                    36 => (
                        strata_launch_map_address(h(p.bits), out),
                        "strata_launch_map_address",
                        None,
                    ),
                    37 => (
                        strata_launch_counters_address(h(p.bits), out),
                        "strata_launch_counters_address",
                        None,
                    ),
                    _ => (
                        strata_launch_entry(h(p.bits), page as usize, out),
                        "strata_launch_entry",
                        (page >= p.size).then_some(STRATA_ERR_INVALID_ARGUMENT),
                    ),
                }
            };
            if !check(what, st, w.seen(p), ptr.status().also(bad), &[0]) {
                assert!(s.untouched(), "{what} wrote on error");
            }
        }
        39 => {
            let p = w.pick(rng, Launch);
            free_call(w, p, "strata_launch_end", |b| strata_launch_end(h(b)));
        }
        // ---------------------------------------------- optimizers --
        40 | 41 => {
            let p = w.pick(rng, Optim);
            let n = if rng.one_in(8) { WEIGHTS - 1 } else { WEIGHTS };
            let mut v = vec![0.25f32; n];
            let bad = (n != WEIGHTS).then_some(STRATA_ERR_INVALID_ARGUMENT);
            if op == 40 {
                let ptr = Ptr::draw(rng);
                let out = ptr.make::<strata_step_stats>(&mut s, 0);
                // SAFETY: `n` readable floats; `out` as above (NULL is fine).
                let st = unsafe { strata_optim_step(h(p.bits), v.as_ptr(), n, out) };
                let pbad = (ptr == Ptr::Misaligned).then_some(STRATA_ERR_INVALID_ARGUMENT);
                if !check("strata_optim_step", st, w.seen(p), pbad.also(bad), &[0])
                    || ptr != Ptr::Good
                {
                    assert!(s.untouched());
                }
            } else {
                v.fill(f32::NAN);
                // SAFETY: `n` writable floats.
                let st = unsafe { strata_optim_weights(h(p.bits), v.as_mut_ptr(), n) };
                if !check("strata_optim_weights", st, w.seen(p), bad, &[0]) {
                    assert!(v.iter().all(|x| x.is_nan()), "weights written on error");
                }
            }
        }
        42 => {
            let p = w.pick(rng, Optim);
            free_call(w, p, "strata_optim_free", |b| strata_optim_free(h(b)));
        }
        43 => {
            if w.count_live(Optim) >= 2 {
                return;
            }
            let w0 = vec![0.5f32; WEIGHTS];
            let mut c = optim_config();
            let bad = if rng.one_in(6) {
                c.tier = 42;
                Some(STRATA_ERR_INVALID_ARGUMENT)
            } else {
                None
            };
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<*mut strata_optim>(&mut s, 0);
            // SAFETY: readable weights and config; `out` as above.
            let st = unsafe { strata_optim_create(w0.as_ptr(), WEIGHTS, &c, out) };
            let bad = match (ptr.status(), bad) {
                (Some(_), Some(_)) => {
                    assert!(st == STRATA_ERR_INVALID_ARGUMENT || st == STRATA_ERR_NULL_POINTER);
                    assert!(s.untouched());
                    return;
                }
                (a, b) => a.also(b),
            };
            if check("strata_optim_create", st, LIVE, bad, &[0]) {
                // SAFETY: written by the call.
                w.add(Optim, bits(unsafe { *out }), None, WEIGHTS as u64);
            } else {
                assert!(s.untouched());
            }
        }
        // ------------------------------------------- expert caches --
        44 => {
            let p = w.pick(rng, Moe);
            let weights = vec![7u8; 1000];
            let expert = 10 + rng.below(4) as u32;
            // SAFETY: readable weights.
            let st = unsafe {
                strata_moe_register(h(p.bits), 1, expert, weights.as_ptr().cast(), weights.len())
            };
            // Refused while experts are pinned, or registered twice.
            let ok = [0, STRATA_ERR_INVALID_ARGUMENT];
            check("strata_moe_register", st, w.seen(p), None, &ok);
        }
        45 => {
            let p = w.pick(rng, Moe);
            let cap = rng.below(3) as usize;
            let (nptr, optr) = (Ptr::draw(rng), Ptr::draw(rng));
            let arr = s.at::<u64>(0);
            let n = nptr.make::<usize>(&mut s, 32);
            let out = optr.make::<*mut strata_expert_pin>(&mut s, 48);
            // SAFETY: `arr` holds 4 u64s; `n` and `out` as above.
            let st =
                unsafe { strata_moe_fetch(h(p.bits), 0, rng.below(4) as u32, arr, cap, n, out) };
            let bad = nptr.status().also(optr.status());
            let seen = w.seen(p);
            let ok = [0, STRATA_ERR_OUT_OF_CAPACITY];
            if nptr.status().is_some() && optr.status().is_some() {
                assert!(
                    st == STRATA_ERR_INVALID_ARGUMENT
                        || st == STRATA_ERR_NULL_POINTER
                        || (!seen.live && st < 0)
                );
                assert!(s.untouched());
                return;
            }
            if check("strata_moe_fetch", st, seen, bad, &ok) {
                // SAFETY: written by the call.
                w.add(ExpertPin, bits(unsafe { *out }), None, 0);
            } else {
                assert!(s.untouched(), "strata_moe_fetch wrote on error");
            }
        }
        46 => {
            let p = w.pick(rng, ExpertPin);
            free_call(w, p, "strata_moe_release", |b| strata_moe_release(h(b)));
        }
        47 | 48 => {
            let p = w.pick(rng, Moe);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<usize>(&mut s, 0);
            let pbad = (ptr == Ptr::Misaligned).then_some(STRATA_ERR_INVALID_ARGUMENT);
            let (st, what) = if op == 47 {
                let experts = [rng.below(4) as u32, rng.below(4) as u32];
                // SAFETY: two readable ids; `out` as above (NULL is fine).
                let st = unsafe { strata_moe_prefetch(h(p.bits), 0, experts.as_ptr(), 2, out) };
                (st, "strata_moe_prefetch")
            } else {
                // SAFETY: as above.
                (
                    unsafe { strata_moe_cancel_prefetches(h(p.bits), 0, out) },
                    "strata_moe_cancel_prefetches",
                )
            };
            if !check(what, st, w.seen(p), pbad, &[0]) || ptr != Ptr::Good {
                assert!(s.untouched(), "{what} wrote on error");
            }
        }
        49 => {
            let p = w.pick(rng, Moe);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<strata_moe_stats>(&mut s, 0);
            // SAFETY: as above.
            let st = unsafe { strata_moe_get_stats(h(p.bits), out) };
            if check("strata_moe_get_stats", st, w.seen(p), ptr.status(), &[0]) {
                // SAFETY: written by the call.
                let st = unsafe { *out };
                assert!(st.hits <= st.fetches && st.stall_modelled == 1);
            } else {
                assert!(s.untouched());
            }
        }
        50 => {
            let p = w.pick(rng, Moe);
            free_call(w, p, "strata_moe_free", |b| strata_moe_free(h(b)));
        }
        51 => {
            if w.count_live(Moe) >= 2 {
                return;
            }
            let c = moe_config();
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<*mut strata_moe>(&mut s, 0);
            // SAFETY: a readable config; `out` as above.
            let st = unsafe { strata_moe_create(&c, out) };
            if check("strata_moe_create", st, LIVE, ptr.status(), &[0]) {
                // SAFETY: written by the call.
                let m = unsafe { *out };
                register_experts(m);
                w.add(Moe, bits(m), None, 0);
            } else {
                assert!(s.untouched());
            }
        }
        // --------------------------------------------------- misc --
        52 => {
            let ptr = Ptr::draw(rng);
            match rng.below(3) {
                0 => {
                    let out = ptr.make::<strata_config>(&mut s, 0);
                    // SAFETY: as above.
                    let st = unsafe { strata_config_init(out) };
                    check("strata_config_init", st, LIVE, ptr.status(), &[0]);
                }
                1 => {
                    let out = ptr.make::<strata_optim_config>(&mut s, 0);
                    // SAFETY: as above.
                    let st = unsafe { strata_optim_config_init(out) };
                    check("strata_optim_config_init", st, LIVE, ptr.status(), &[0]);
                }
                _ => {
                    let out = ptr.make::<strata_moe_config>(&mut s, 0);
                    // SAFETY: as above.
                    let st = unsafe { strata_moe_config_init(out) };
                    check("strata_moe_config_init", st, LIVE, ptr.status(), &[0]);
                }
            }
            if ptr != Ptr::Good {
                assert!(s.untouched());
            }
        }
        53 => {
            let before = last_error();
            let mut buf = [SENTINEL as c_char; 16];
            let cap = [0usize, 4, 16][rng.below(3) as usize];
            let nullbuf = cap > 0 && rng.one_in(6);
            let b = if nullbuf || cap == 0 {
                null_mut()
            } else {
                buf.as_mut_ptr()
            };
            let lptr = Ptr::draw(rng);
            let len = lptr.make::<usize>(&mut s, 0);
            // SAFETY: `b` holds `cap` bytes or is NULL; `len` as above.
            let st = unsafe { strata_last_error_copy(b, cap, len) };
            let bad = if lptr == Ptr::Misaligned {
                Some(STRATA_ERR_INVALID_ARGUMENT)
            } else if nullbuf {
                Some(STRATA_ERR_NULL_POINTER)
            } else {
                None
            };
            let ok = [STRATA_OK, STRATA_ERR_BUFFER_TOO_SMALL];
            if !(lptr == Ptr::Misaligned && nullbuf) {
                check("strata_last_error_copy", st, LIVE, bad, &ok);
            }
            if st < 0 && st != STRATA_ERR_BUFFER_TOO_SMALL {
                assert!(s.untouched(), "last_error_copy wrote len on error");
                assert!(buf.iter().all(|&c| c == SENTINEL as c_char));
            } else if lptr == Ptr::Good {
                // SAFETY: written by the call.
                assert_eq!(unsafe { *len }, before.len());
            }
            assert_eq!(last_error(), before, "strata_last_error_copy changed it");
        }
        54 => {
            // Pointers strata never returned are refused, never freed.
            let mut local = 0u64;
            let p: *mut u64 = &mut local;
            let st = strata_string_free(p.cast());
            check(
                "strata_string_free",
                st,
                State {
                    live: false,
                    freed: true,
                    closed: false,
                },
                None,
                &[],
            );
            let st = strata_dlpack_free(p.cast());
            check(
                "strata_dlpack_free",
                st,
                State {
                    live: false,
                    freed: true,
                    closed: false,
                },
                None,
                &[],
            );
            assert_eq!(strata_string_free(null_mut()), STRATA_OK);
            assert_eq!(strata_dlpack_free(null_mut()), STRATA_OK);
        }
        55 => {
            let p = w.pick(rng, Moe);
            let ptr = Ptr::draw(rng);
            let out = ptr.make::<u32>(&mut s, 0);
            // Layer 0 holds experts 0 to 3: 4 is not registered.
            let expert = rng.below(5) as u32;
            // SAFETY: `out` as above.
            let st = unsafe { strata_moe_is_ready(h(p.bits), 0, expert, out) };
            let ok = [0, STRATA_ERR_NOT_FOUND];
            if check("strata_moe_is_ready", st, w.seen(p), ptr.status(), &ok) {
                // SAFETY: written by the call.
                assert!(unsafe { *out } <= 1);
            } else {
                assert!(s.untouched(), "strata_moe_is_ready wrote on error");
            }
        }
        _ => {
            assert!(!strata_version().is_null());
            let code = [0, 1, -1, -8, -100, -103, 77][rng.below(7) as usize];
            assert!(!strata_status_string(code).is_null());
            assert!(!strata_last_error().is_null());
        }
    }
}

/// A random range of a buffer of `size` bytes: in it (bad None), or
/// beyond its end or overflowing (bad INVALID_ARGUMENT).
fn range_in(rng: &mut Rng, size: u64) -> (u64, u64, Option<c_int>) {
    match rng.below(10) {
        0 => (size, 1, Some(STRATA_ERR_INVALID_ARGUMENT)),
        1 => (u64::MAX - 2, 8, Some(STRATA_ERR_INVALID_ARGUMENT)),
        _ => {
            let size = size.max(1);
            let offset = rng.below(size);
            let len = 1 + rng.below((size - offset).min(2 * PAGE_SIZE));
            (offset, len, None)
        }
    }
}

/// A free-like call: claimed live handles are freed by this thread alone;
/// others only once surely gone.
fn free_call(w: &World, p: Pick, what: &str, free: impl Fn(u64) -> c_int) {
    match p.idx {
        Some(i) if w.begin_free(i) => {
            let st = free(p.bits);
            assert!(
                st == STRATA_OK || st == STRATA_ERR_CLOSED,
                "{what}: {st}: {}",
                last_error()
            );
            w.end_free(i, st);
        }
        Some(_) if !p.at.stable() || p.at == LIVE => {}
        _ => {
            let st = free(p.bits);
            if p.bits == 0 {
                assert_eq!(st, STRATA_OK, "{what}(NULL) is a no-op");
            } else {
                check(what, st, p.at, None, &[]);
            }
        }
    }
}

fn register_experts(m: *mut strata_moe) {
    for e in 0..4u8 {
        let w = vec![e + 1; 64 << 10];
        // SAFETY: readable weights.
        let s = unsafe { strata_moe_register(m, 0, e as u32, w.as_ptr().cast(), w.len()) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
    }
}

/// Frees whatever the model still holds live, so that the next round
/// starts clean.
fn cleanup(w: &World) {
    let p = w.pool.lock().unwrap();
    for e in p.entries.iter().filter(|e| e.state.live) {
        let b = e.bits;
        let _ = match e.kind {
            Kind::ExpertPin => strata_moe_release(h(b)),
            Kind::Moe => strata_moe_free(h(b)),
            Kind::Optim => strata_optim_free(h(b)),
            _ => STRATA_OK,
        };
    }
    for e in p.entries.iter().filter(|e| e.state.live) {
        if e.kind == Kind::Runtime {
            assert_eq!(strata_runtime_destroy(h(e.bits)), STRATA_OK);
        }
    }
}

const SEEDS: [u64; 10] = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89];

/// A closed handle reads CLOSED until 64 later objects have used its slot:
/// the tests that make many tickets do not run beside the model.
static SERIAL: Mutex<()> = Mutex::new(());
const THREADS: u64 = 4;
const STEPS: usize = 500;

#[test]
fn random_calls_from_many_threads_keep_the_preamble() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for seed in SEEDS {
        let w = World {
            pool: Mutex::new(Pool::default()),
            dir: tempfile::tempdir().unwrap(),
            traces: AtomicU64::new(0),
        };
        // The shared world: two runtimes with a buffer each, an expert
        // cache and an optimizer.
        for _ in 0..2 {
            let rt = create(&sim_config());
            let idx = {
                let mut p = w.pool.lock().unwrap();
                let idx = p.entries.len();
                p.entries.push(Entry {
                    kind: Kind::Runtime,
                    bits: bits(rt),
                    rt: Some(idx),
                    size: 0,
                    state: LIVE,
                });
                idx
            };
            let b = alloc(rt, 3 * PAGE_SIZE);
            w.add(Kind::Buffer, bits(b), Some(idx), 3 * PAGE_SIZE);
        }
        let c = moe_config();
        let mut m = null_mut();
        // SAFETY: a readable config and a writable handle.
        assert_eq!(unsafe { strata_moe_create(&c, &mut m) }, STRATA_OK);
        register_experts(m);
        w.add(Kind::Moe, bits(m), None, 0);
        let w0 = vec![0.5f32; WEIGHTS];
        let mut o = null_mut();
        // SAFETY: readable weights and config, a writable handle.
        let st = unsafe { strata_optim_create(w0.as_ptr(), WEIGHTS, &optim_config(), &mut o) };
        assert_eq!(st, STRATA_OK, "{}", last_error());
        w.add(Kind::Optim, bits(o), None, WEIGHTS as u64);

        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let w = &w;
                scope.spawn(move || {
                    let mut rng = Rng(seed << 8 | t);
                    for _ in 0..STEPS {
                        step(w, &mut rng);
                    }
                });
            }
        });
        cleanup(&w);
        // Every handle the model knows as gone reads as gone.
        let p = w.pool.lock().unwrap();
        let mut seen = HashSet::new();
        for e in p.entries.iter().filter(|e| !e.state.live) {
            assert!(seen.insert(e.bits), "a handle was issued twice");
            let b = e.bits;
            let (st, what) = match e.kind {
                Kind::Runtime => (strata_runtime_destroy(h(b)), "strata_runtime_destroy"),
                Kind::Buffer => (strata_buffer_free(h(b)), "strata_buffer_free"),
                Kind::Ticket => (strata_ticket_poll(h(b)), "strata_ticket_poll"),
                Kind::Pin => (strata_unpin(h(b)), "strata_unpin"),
                Kind::Map => (strata_map_free(h(b)), "strata_map_free"),
                Kind::Launch => (strata_launch_end(h(b)), "strata_launch_end"),
                Kind::Optim => (strata_optim_free(h(b)), "strata_optim_free"),
                Kind::Moe => (strata_moe_free(h(b)), "strata_moe_free"),
                Kind::ExpertPin => (strata_moe_release(h(b)), "strata_moe_release"),
            };
            check(what, st, e.state, None, &[]);
        }
    }
}

// ------------------------------------------------- focused regressions --

/// Promise 1: a destroyed runtime's own handle gives STRATA_ERR_CLOSED to
/// every call taking it (destroying it again, too), as its objects' do —
/// also after the runtime slot is reused and closed again.
#[test]
fn a_destroyed_runtimes_handle_reads_closed() {
    let rt = create(&sim_config());
    let buf = alloc(rt, PAGE_SIZE);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    // Another runtime, likely in the same slot, destroyed too.
    let other = create(&sim_config());
    assert_eq!(strata_runtime_destroy(other), STRATA_OK);
    let mut b = null_mut();
    let (mut n, mut mask, mut json, mut rep) =
        (0usize, 0u32, null_mut(), strata_balance_report::default());
    let mut text = [0 as c_char; 8];
    let mut acc = 0u64;
    let path = CString::new("/nonexistent/trace").unwrap();
    let closed = |what: &str, status: c_int| {
        assert_eq!(status, STRATA_ERR_CLOSED, "{what}: {}", last_error());
        let message = last_error();
        assert!(message.starts_with(what), "{message}");
        assert!(message.contains("closed"), "{message}");
    };
    // SAFETY: writable out-pointers, a NUL-terminated path.
    unsafe {
        closed("strata_alloc", strata_alloc(rt, PAGE_SIZE, &mut b));
        closed(
            "strata_alloc_in",
            strata_alloc_in(rt, PAGE_SIZE, STRATA_TIER_HOST, &mut b),
        );
        closed(
            "strata_runtime_page_size",
            strata_runtime_page_size(rt, &mut n),
        );
        closed("strata_runtime_tiers", strata_runtime_tiers(rt, &mut mask));
        closed(
            "strata_stats_json",
            strata_stats_json(rt, &mut json, &mut n),
        );
        closed(
            "strata_stats_json_copy",
            strata_stats_json_copy(rt, text.as_mut_ptr(), 8, &mut n),
        );
        closed(
            "strata_trace_start",
            strata_trace_start(rt, path.as_ptr(), 0),
        );
        closed("strata_trace_stop", strata_trace_stop(rt, &mut acc));
        closed(
            "strata_balancer_start",
            strata_balancer_start(rt, STRATA_POLICY_LFU, 1000, 0),
        );
        closed("strata_balancer_stop", strata_balancer_stop(rt));
        closed("strata_runtime_check", strata_runtime_check(rt));
        closed("strata_balance_once", strata_balance_once(rt, &mut rep));
        closed("strata_runtime_destroy", strata_runtime_destroy(rt));
        closed("strata_buffer_free", strata_buffer_free(buf));
    }
    assert!(b.is_null() && json.is_null() && n == 0 && mask == 0 && acc == 0);
    assert_eq!(strata_runtime_destroy(other), STRATA_ERR_CLOSED);
}

/// Promise 2: with good arguments strata_prefetch returns a ticket, and a
/// move that fails (here: to a full device tier) fails through the ticket,
/// however fast it failed. Several threads, so that moves often finish
/// before the call returns.
#[test]
fn prefetch_leaves_every_move_error_to_the_ticket() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = sim_config();
    c.device_capacity = PAGE_SIZE;
    c.background_eviction = 0;
    let rt = create(&c);
    // The device's one page is taken and pinned.
    let hog = alloc(rt, PAGE_SIZE);
    assert_eq!(write(hog, 0, &[1; 8]), STRATA_OK);
    let mut pin = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_buffer_pin(hog, 0, PAGE_SIZE, STRATA_TIER_DEVICE, &mut pin) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let rt_bits = bits(rt);
    let failed = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| {
                let rt: *mut strata_runtime = h(rt_bits);
                let buf = alloc(rt, PAGE_SIZE);
                assert_eq!(write(buf, 0, &[2; 8]), STRATA_OK);
                for _ in 0..400 {
                    let mut t = null_mut();
                    // SAFETY: a writable out-pointer.
                    let s =
                        unsafe { strata_prefetch(buf, 0, PAGE_SIZE, STRATA_TIER_DEVICE, &mut t) };
                    assert_eq!(
                        s,
                        STRATA_OK,
                        "a move's error came back at once: {}",
                        last_error()
                    );
                    assert!(!t.is_null());
                    let s = strata_ticket_wait(t);
                    assert_eq!(s, STRATA_ERR_OUT_OF_CAPACITY, "{}", last_error());
                    failed.fetch_add(1, Ordering::Relaxed);
                    assert_eq!(strata_ticket_poll(t), STRATA_ERR_OUT_OF_CAPACITY);
                    assert_eq!(strata_ticket_free(t), STRATA_OK);
                }
            });
        }
    });
    assert_eq!(failed.load(Ordering::Relaxed), 1200);
    // Argument errors still come at once, with no ticket.
    let buf = alloc(rt, PAGE_SIZE);
    let mut t = null_mut();
    // SAFETY: writable out-pointers.
    unsafe {
        fails(
            strata_prefetch(buf, PAGE_SIZE, 1, STRATA_TIER_HOST, &mut t),
            STRATA_ERR_INVALID_ARGUMENT,
            "outside",
        );
        fails(
            strata_prefetch(buf, 0, 1, STRATA_TIER_NVME, &mut t),
            STRATA_ERR_INVALID_ARGUMENT,
            "not configured",
        );
        fails(
            strata_prefetch(buf, 0, 1, 17, &mut t),
            STRATA_ERR_INVALID_ARGUMENT,
            "tier",
        );
    }
    assert!(t.is_null());
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

/// A misaligned pointer to a `T` (inside `s`).
fn misaligned<T>(s: &mut Scratch) -> *mut T {
    s.at(1)
}

/// Promise 3: out-pointers are checked before any work, and left as they
/// were on error.
#[test]
fn bad_out_pointers_are_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let rt = create(&sim_config());
    let buf = alloc(rt, 4 * PAGE_SIZE);
    let mut s = Scratch::new();

    // strata_trace_stop: the recording goes on.
    let path = c_path(&dir.path().join("t.trace"));
    // SAFETY: a NUL-terminated path.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_trace_start(rt, path.as_ptr(), 0) },
        STRATA_OK
    );
    // SAFETY: misaligned pointers are refused, never written.
    let st = unsafe { strata_trace_stop(rt, misaligned(&mut s)) };
    fails(st, STRATA_ERR_INVALID_ARGUMENT, "misaligned");
    assert!(s.untouched());
    assert_eq!(write(buf, 0, &[1; 8]), STRATA_OK);
    let mut n = 0u64;
    // SAFETY: a writable u64.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_trace_stop(rt, &mut n) },
        STRATA_OK,
        "{}",
        last_error()
    );
    assert_eq!(n, 1, "the access after the refused stop was recorded");

    // strata_balance_once: no round runs (page 2 stays in host memory).
    // SAFETY: a writable out-pointer.
    let mut b2 = null_mut();
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_alloc_in(rt, PAGE_SIZE, STRATA_TIER_HOST, &mut b2) },
        STRATA_OK
    );
    assert_eq!(write(b2, 0, &[1; 8]), STRATA_OK);
    let mut out = [0u8; 8];
    for _ in 0..20 {
        assert_eq!(read(b2, 0, &mut out), STRATA_OK);
    }
    assert_eq!(tier_of(b2, 0), STRATA_TIER_HOST);
    // SAFETY: as above.
    let st = unsafe { strata_balance_once(rt, misaligned(&mut s)) };
    fails(st, STRATA_ERR_INVALID_ARGUMENT, "misaligned");
    assert!(s.untouched());
    assert_eq!(
        tier_of(b2, 0),
        STRATA_TIER_HOST,
        "the refused round promoted"
    );
    let mut report = strata_balance_report::default();
    // SAFETY: a writable report.
    assert_eq!(unsafe { strata_balance_once(rt, &mut report) }, STRATA_OK);
    assert!(report.promotions >= 1, "{report:?}");

    // strata_pin_info: no output written when one pointer is bad.
    let mut pin = null_mut();
    // SAFETY: a writable out-pointer.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_buffer_pin(buf, 0, PAGE_SIZE, STRATA_TIER_HOST, &mut pin) },
        STRATA_OK
    );
    let (mut t, mut count) = (77 as strata_tier, 77usize);
    // SAFETY: writable or misaligned (refused) pointers.
    let st = unsafe { strata_pin_info(pin, &mut t, misaligned(&mut s), &mut count) };
    fails(st, STRATA_ERR_INVALID_ARGUMENT, "first_page");
    assert_eq!((t, count), (77, 77), "pin_info wrote outputs on error");
    assert!(s.untouched());

    // strata_stats_json_copy: `*len` unchanged when `buf` is bad.
    let mut len = 77usize;
    // SAFETY: a NULL buffer with cap > 0 is refused.
    let st = unsafe { strata_stats_json_copy(rt, null_mut(), 64, &mut len) };
    fails(st, STRATA_ERR_NULL_POINTER, "buf");
    assert_eq!(len, 77, "stats_json_copy wrote len on error");
    let mut text = [SENTINEL as c_char; 8];
    // SAFETY: 8 writable bytes; a misaligned len is refused.
    let st = unsafe { strata_stats_json_copy(rt, text.as_mut_ptr(), 8, misaligned(&mut s)) };
    fails(st, STRATA_ERR_INVALID_ARGUMENT, "len");
    assert!(text.iter().all(|&c| c == SENTINEL as c_char) && s.untouched());

    // strata_last_error_copy: likewise, and the last error stays.
    let before = last_error();
    let mut len = 77usize;
    // SAFETY: as above.
    let st = unsafe { strata_last_error_copy(null_mut(), 64, &mut len) };
    assert_eq!(st, STRATA_ERR_NULL_POINTER);
    assert_eq!(len, 77, "last_error_copy wrote len on error");
    assert_eq!(last_error(), before);

    // strata_optim_step: no step (the weights stay).
    let w0 = vec![0.5f32; WEIGHTS];
    let mut o = null_mut();
    // SAFETY: readable weights and config, a writable handle.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_optim_create(w0.as_ptr(), WEIGHTS, &optim_config(), &mut o) },
        STRATA_OK
    );
    let g = vec![1.0f32; WEIGHTS];
    // SAFETY: readable gradients; a misaligned stats pointer is refused.
    let st = unsafe { strata_optim_step(o, g.as_ptr(), WEIGHTS, misaligned(&mut s)) };
    fails(st, STRATA_ERR_INVALID_ARGUMENT, "stats");
    assert!(s.untouched());
    let mut wts = vec![0f32; WEIGHTS];
    // SAFETY: writable floats.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_optim_weights(o, wts.as_mut_ptr(), WEIGHTS) },
        STRATA_OK
    );
    assert!(
        wts.iter().zip(&w0).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the refused step stepped"
    );
    // SAFETY: a NULL stats pointer is allowed: this one steps.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_optim_step(o, g.as_ptr(), WEIGHTS, null_mut()) },
        STRATA_OK
    );
    // SAFETY: as above.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_optim_weights(o, wts.as_mut_ptr(), WEIGHTS) },
        STRATA_OK
    );
    assert!(wts.iter().zip(&w0).any(|(a, b)| a != b));
    assert_eq!(strata_optim_free(o), STRATA_OK);

    // strata_moe_prefetch and _cancel_prefetches: nothing started or
    // cancelled.
    let mut m = null_mut();
    // SAFETY: a readable config and a writable handle.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_moe_create(&moe_config(), &mut m) },
        STRATA_OK
    );
    register_experts(m);
    let stats = |m| {
        let mut st = strata_moe_stats::default();
        // SAFETY: a writable stats struct.
        assert_eq!(unsafe { strata_moe_get_stats(m, &mut st) }, STRATA_OK);
        st
    };
    // SAFETY: readable ids; a misaligned count is refused.
    let st = unsafe { strata_moe_prefetch(m, 0, [1u32, 2].as_ptr(), 2, misaligned(&mut s)) };
    fails(st, STRATA_ERR_INVALID_ARGUMENT, "started");
    assert_eq!(stats(m).prefetches, 0, "the refused call prefetched");
    let mut started = 0usize;
    // SAFETY: readable ids, a writable count.
    assert_eq!(
        // SAFETY: pointers as the call requires (see the comment above).
        unsafe { strata_moe_prefetch(m, 0, [1u32, 2].as_ptr(), 2, &mut started) },
        STRATA_OK
    );
    let cancelled_before = stats(m).prefetches_cancelled;
    // SAFETY: a misaligned count is refused.
    let st = unsafe { strata_moe_cancel_prefetches(m, 0, misaligned(&mut s)) };
    fails(st, STRATA_ERR_INVALID_ARGUMENT, "cancelled");
    assert_eq!(stats(m).prefetches_cancelled, cancelled_before);
    assert!(s.untouched());
    assert_eq!(strata_moe_free(m), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}
