//! Fuzzes sequences of C-ABI calls: allocations, reads and writes at any
//! offset and length, moves, tickets, pins, device maps, launches, stats,
//! DLPack export, stale and forged handles, and the runtime destroyed in
//! the middle. Every call must return a status strata documents (never
//! `STRATA_ERR_PANIC`) with a message when it fails, and every successful
//! read must match what the successful writes put there.
#![no_main]

use std::ffi::{c_void, CString};
use std::os::unix::ffi::OsStrExt;
use std::ptr::null_mut;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use strata_ffi::*;

#[path = "common.rs"]
mod common;
use common::{st, threads};

const PAGE: u64 = 4096;

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        pages: u8,
        tail: u16,
        tier: Option<i8>,
    },
    Free {
        b: u8,
    },
    Write {
        b: u8,
        offset: u32,
        len: u16,
        seed: u8,
    },
    Read {
        b: u8,
        offset: u32,
        len: u16,
    },
    TierOf {
        b: u8,
        page: u16,
    },
    Evict {
        b: u8,
        offset: u32,
        len: u32,
        tier: i8,
    },
    Prefetch {
        b: u8,
        offset: u32,
        len: u32,
        tier: i8,
    },
    Wait {
        t: u8,
    },
    Poll {
        t: u8,
    },
    WaitTimeout {
        t: u8,
        ns: u16,
    },
    TicketFree {
        t: u8,
    },
    TicketCancel {
        t: u8,
        b: u8,
    },
    Pin {
        b: u8,
        offset: u32,
        len: u32,
        tier: i8,
    },
    PinAddresses {
        p: u8,
        cap: u8,
    },
    Unpin {
        p: u8,
    },
    Map {
        b: u8,
    },
    Prepare {
        m: u8,
        access: i8,
    },
    Entry {
        l: u8,
        page: u16,
    },
    LaunchEnd {
        l: u8,
    },
    MapFree {
        m: u8,
    },
    Stats,
    StatsCopy {
        cap: u16,
    },
    Dlpack {
        b: u8,
        offset: u32,
        len: u32,
        tier: i8,
        code: u8,
        bits: u8,
        lanes: u16,
    },
    DlpackFree {
        d: u8,
    },
    Forged {
        bits: u64,
        call: u8,
    },
    Destroy,
}

#[derive(Arbitrary, Debug)]
struct Input {
    device_pages: u8,
    host_pages: u8,
    nvme_pages: u8,
    ops: Vec<Op>,
}

/// What a buffer should hold, while it is known.
struct Model {
    handle: *mut strata_buffer,
    bytes: Option<Vec<u8>>,
    len: u64,
}

fn pick<T: Copy>(v: &[T], i: u8) -> Option<T> {
    (!v.is_empty()).then(|| v[i as usize % v.len()])
}

/// A tier value: mostly valid, sometimes not.
fn tier(t: i8) -> i32 {
    if (-2..=5).contains(&t) {
        t as i32
    } else {
        t as i32 % 4
    }
}

/// An offset mostly inside a buffer of `len` bytes, sometimes beyond.
fn offset(raw: u32, len: u64) -> u64 {
    if raw & 0x8000_0000 != 0 {
        u64::MAX - u64::from(raw & 0xff)
    } else {
        u64::from(raw) % (len + len / 4 + 1)
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fuzz_target!(|input: Input| {
    let threads_before = threads();
    let dir = tempfile::tempdir().unwrap();
    let path = CString::new(dir.path().as_os_str().as_bytes()).unwrap();
    let mut c = std::mem::MaybeUninit::<strata_config>::uninit();
    // SAFETY: a writable strata_config.
    assert_eq!(unsafe { strata_config_init(c.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: strata_config_init filled it.
    let mut c = unsafe { c.assume_init() };
    c.page_size = PAGE;
    c.device = STRATA_DEVICE_SIM;
    c.device_capacity = u64::from(input.device_pages % 8) * PAGE;
    c.host_capacity = (1 + u64::from(input.host_pages % 16)) * PAGE;
    let nvme_pages = u64::from(input.nvme_pages % 32);
    if nvme_pages > 0 {
        c.nvme_path = path.as_ptr();
        c.nvme_capacity = nvme_pages * PAGE;
        c.nvme_engine = STRATA_IO_PSYNC;
    }
    let mut rt = null_mut();
    // SAFETY: a readable config with a live path, a writable out-pointer.
    if st(unsafe { strata_runtime_create(&c, &mut rt) }) != STRATA_OK {
        return;
    }
    let mut bufs: Vec<Model> = Vec::new();
    let mut tickets: Vec<*mut strata_ticket> = Vec::new();
    let mut pins: Vec<*mut strata_pin> = Vec::new();
    let mut maps: Vec<*mut strata_map> = Vec::new();
    let mut launches: Vec<*mut strata_launch> = Vec::new();
    let mut tensors: Vec<*mut DLManagedTensor> = Vec::new();

    for op in input.ops.into_iter().take(64) {
        match op {
            Op::Alloc {
                pages,
                tail,
                tier: t,
            } => {
                let len = u64::from(pages % 16) * PAGE + u64::from(tail % 4096);
                let mut b = null_mut();
                // SAFETY: a writable out-pointer.
                let s = st(unsafe {
                    match t {
                        Some(t) => strata_alloc_in(rt, len, tier(t), &mut b),
                        None => strata_alloc(rt, len, &mut b),
                    }
                });
                if s == STRATA_OK {
                    bufs.push(Model {
                        handle: b,
                        bytes: Some(vec![0; len as usize]),
                        len,
                    });
                }
            }
            Op::Free { b } => {
                if let Some(i) = (!bufs.is_empty()).then(|| b as usize % bufs.len()) {
                    if st(strata_buffer_free(bufs[i].handle)) == STRATA_OK {
                        bufs[i].bytes = None;
                    }
                }
            }
            Op::Write {
                b,
                offset: o,
                len,
                seed,
            } => {
                let Some(i) = (!bufs.is_empty()).then(|| b as usize % bufs.len()) else {
                    continue;
                };
                let m = &mut bufs[i];
                let o = offset(o, m.len);
                let data = pattern(seed, len as usize % 20000);
                // SAFETY: `data` is readable for its length.
                let s = st(unsafe { strata_write(m.handle, o, data.as_ptr().cast(), data.len()) });
                match (&mut m.bytes, s) {
                    (Some(bytes), STRATA_OK) => {
                        bytes[o as usize..o as usize + data.len()].copy_from_slice(&data)
                    }
                    // A failed write may have written the pages before the
                    // failing one: the model no longer knows.
                    (bytes, _) => *bytes = None,
                }
            }
            Op::Read { b, offset: o, len } => {
                let Some(i) = (!bufs.is_empty()).then(|| b as usize % bufs.len()) else {
                    continue;
                };
                let m = &bufs[i];
                let o = offset(o, m.len);
                let mut out = vec![0xa5u8; len as usize % 20000];
                // SAFETY: `out` is writable for its length and ours alone.
                let s = st(unsafe { strata_read(m.handle, o, out.as_mut_ptr().cast(), out.len()) });
                if let (Some(bytes), STRATA_OK) = (&m.bytes, s) {
                    assert!(
                        out == bytes[o as usize..o as usize + out.len()],
                        "read differs from the writes"
                    );
                }
            }
            Op::TierOf { b, page } => {
                let Some(m) = (!bufs.is_empty()).then(|| &bufs[b as usize % bufs.len()]) else {
                    continue;
                };
                let mut t = 0;
                // SAFETY: a writable strata_tier.
                st(unsafe { strata_buffer_tier_of(m.handle, page as usize, &mut t) });
            }
            Op::Evict {
                b,
                offset: o,
                len,
                tier: t,
            } => {
                let Some(m) = (!bufs.is_empty()).then(|| &bufs[b as usize % bufs.len()]) else {
                    continue;
                };
                st(strata_evict(
                    m.handle,
                    offset(o, m.len),
                    u64::from(len),
                    tier(t),
                ));
            }
            Op::Prefetch {
                b,
                offset: o,
                len,
                tier: t,
            } => {
                let Some(m) = (!bufs.is_empty()).then(|| &bufs[b as usize % bufs.len()]) else {
                    continue;
                };
                let mut tk = null_mut();
                // SAFETY: a writable out-pointer.
                let s = st(unsafe {
                    strata_prefetch(m.handle, offset(o, m.len), u64::from(len), tier(t), &mut tk)
                });
                if s == STRATA_OK {
                    tickets.push(tk);
                }
            }
            Op::Wait { t } => {
                if let Some(tk) = pick(&tickets, t) {
                    st(strata_ticket_wait(tk));
                }
            }
            Op::Poll { t } => {
                if let Some(tk) = pick(&tickets, t) {
                    st(strata_ticket_poll(tk));
                    let mut declined = 0usize;
                    // SAFETY: a writable size_t.
                    st(unsafe { strata_ticket_declined(tk, &mut declined) });
                }
            }
            Op::WaitTimeout { t, ns } => {
                if let Some(tk) = pick(&tickets, t) {
                    st(strata_ticket_wait_timeout(tk, u64::from(ns)));
                }
            }
            Op::TicketFree { t } => {
                if let Some(tk) = pick(&tickets, t) {
                    st(strata_ticket_free(tk));
                }
            }
            Op::TicketCancel { t, b } => {
                if let (Some(tk), Some(m)) = (
                    pick(&tickets, t),
                    (!bufs.is_empty()).then(|| &bufs[b as usize % bufs.len()]),
                ) {
                    let mut dropped = 0usize;
                    // SAFETY: a writable size_t.
                    st(unsafe { strata_ticket_cancel(m.handle, tk, &mut dropped) });
                }
            }
            Op::Pin {
                b,
                offset: o,
                len,
                tier: t,
            } => {
                let Some(m) = (!bufs.is_empty()).then(|| &bufs[b as usize % bufs.len()]) else {
                    continue;
                };
                let mut p = null_mut();
                // SAFETY: a writable out-pointer.
                let s = st(unsafe {
                    strata_buffer_pin(
                        m.handle,
                        offset(o, m.len),
                        u64::from(len % 65536),
                        tier(t),
                        &mut p,
                    )
                });
                if s == STRATA_OK {
                    pins.push(p);
                }
            }
            Op::PinAddresses { p, cap } => {
                if let Some(p) = pick(&pins, p) {
                    let mut a = vec![0u64; cap as usize % 20];
                    let mut n = 0;
                    // SAFETY: `a` holds its length in writable u64s.
                    st(unsafe { strata_pin_addresses(p, a.as_mut_ptr(), a.len(), &mut n) });
                }
            }
            Op::Unpin { p } => {
                if let Some(p) = pick(&pins, p) {
                    st(strata_unpin(p));
                }
            }
            Op::Map { b } => {
                let Some(m) = (!bufs.is_empty()).then(|| &bufs[b as usize % bufs.len()]) else {
                    continue;
                };
                let mut map = null_mut();
                // SAFETY: a writable out-pointer.
                if st(unsafe { strata_device_map(m.handle, &mut map) }) == STRATA_OK {
                    maps.push(map);
                }
            }
            Op::Prepare { m, access } => {
                if let Some(map) = pick(&maps, m) {
                    let mut l = null_mut();
                    // SAFETY: a writable out-pointer.
                    if st(unsafe { strata_map_prepare(map, i32::from(access % 3), &mut l) })
                        == STRATA_OK
                    {
                        launches.push(l);
                        let mut a = 0;
                        // SAFETY: a writable u64.
                        st(unsafe { strata_launch_map_address(l, &mut a) });
                        // SAFETY: a writable u64.
                        st(unsafe { strata_launch_counters_address(l, &mut a) });
                    }
                }
            }
            Op::Entry { l, page } => {
                if let Some(l) = pick(&launches, l) {
                    let mut e = 0;
                    // SAFETY: a writable u64.
                    st(unsafe { strata_launch_entry(l, page as usize, &mut e) });
                }
            }
            Op::LaunchEnd { l } => {
                if let Some(l) = pick(&launches, l) {
                    st(strata_launch_end(l));
                }
            }
            Op::MapFree { m } => {
                if let Some(m) = pick(&maps, m) {
                    st(strata_map_free(m));
                }
            }
            Op::Stats => {
                let mut s = null_mut();
                // SAFETY: a writable out-pointer.
                if st(unsafe { strata_stats_json(rt, &mut s, null_mut()) }) == STRATA_OK {
                    st(strata_string_free(s));
                    assert_eq!(st(strata_string_free(s)), STRATA_ERR_INVALID_HANDLE);
                }
            }
            Op::StatsCopy { cap } => {
                let mut buf = vec![0u8; cap as usize % 4096];
                let mut need = 0;
                // SAFETY: `buf` holds its length in writable bytes.
                st(unsafe {
                    strata_stats_json_copy(rt, buf.as_mut_ptr().cast(), buf.len(), &mut need)
                });
            }
            Op::Dlpack {
                b,
                offset: o,
                len,
                tier: t,
                code,
                bits,
                lanes,
            } => {
                let Some(m) = (!bufs.is_empty()).then(|| &bufs[b as usize % bufs.len()]) else {
                    continue;
                };
                let mut d = null_mut();
                // SAFETY: a writable out-pointer.
                let s = st(unsafe {
                    strata_dlpack_export(
                        m.handle,
                        offset(o, m.len),
                        u64::from(len % 65536),
                        tier(t),
                        code % 20,
                        bits,
                        lanes % 4,
                        &mut d,
                    )
                });
                if s == STRATA_OK {
                    // SAFETY: a live exported tensor: shape and data are valid.
                    unsafe {
                        let dl = &(*d).dl_tensor;
                        assert_eq!(dl.ndim, 1);
                        assert!(*dl.shape > 0);
                        if dl.device.device_type == DLDeviceType::kDLCPU {
                            std::ptr::read_volatile(dl.data as *const u8);
                        }
                    }
                    tensors.push(d);
                }
            }
            Op::DlpackFree { d } => {
                if let Some(i) = (!tensors.is_empty()).then(|| d as usize % tensors.len()) {
                    st(strata_dlpack_free(tensors.swap_remove(i)));
                }
            }
            Op::Forged { bits, call } => {
                let h = bits as usize;
                let mut out = [0u8; 8];
                let s = match call % 8 {
                    // SAFETY: `out` is writable for its length.
                    0 => unsafe {
                        strata_read(
                            h as *mut strata_buffer,
                            0,
                            out.as_mut_ptr().cast::<c_void>(),
                            8,
                        )
                    },
                    1 => strata_ticket_poll(h as *mut strata_ticket),
                    2 => strata_unpin(h as *mut strata_pin),
                    3 => strata_launch_end(h as *mut strata_launch),
                    4 => strata_map_free(h as *mut strata_map),
                    5 => strata_buffer_free(h as *mut strata_buffer),
                    6 => strata_string_free(h as *mut std::ffi::c_char),
                    _ => strata_dlpack_free(h as *mut DLManagedTensor),
                };
                // A forged value can match a live handle only by luck.
                st(s);
            }
            Op::Destroy => {
                st(strata_runtime_destroy(rt));
                for m in &mut bufs {
                    m.bytes = None;
                }
            }
        }
    }
    for d in tensors {
        assert_eq!(st(strata_dlpack_free(d)), STRATA_OK);
    }
    // Destroying frees what is left (a second destroy is refused: the
    // destroyed runtime's handle is closed).
    let s = st(strata_runtime_destroy(rt));
    assert!(s == STRATA_OK || s == STRATA_ERR_CLOSED);
    // The runtime's worker threads end on their own shortly after (they are
    // not joined); wait for them, so that the leak checker does not take
    // their handles, still in flight, for leaks.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while threads() > threads_before && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
});
