//! What the C ABI adds to a call (target ≤ 50 ns): each operation timed
//! through the Rust API and through its `extern "C"` function, on twin
//! runtimes built the same way. The difference is the ABI's cost: the panic
//! boundary, the handle lookup (a read lock, a generation check, an `Arc`
//! clone) and the argument checks.

use std::hint::black_box;
use std::ptr::null_mut;

use criterion::{criterion_group, criterion_main, Criterion};
use strata::device::DeviceChoice;
use strata::runtime::Placement;
use strata::{Runtime, Tier};
use strata_ffi::*;

const PAGE: u64 = 64 << 10;
const PAGES: u64 = 128;

fn abi(c: &mut Criterion) {
    // The Rust twin.
    let rt = Runtime::builder()
        .page_size(PAGE as usize)
        .device(DeviceChoice::Sim, 64 * PAGE)
        .host(256 * PAGE)
        .build()
        .unwrap();
    let buf = rt
        .alloc_with(PAGES * PAGE, Placement::Prefer(Tier::Host))
        .unwrap();
    buf.write(0, &vec![1u8; (PAGES * PAGE) as usize]).unwrap();
    let ticket = buf.prefetch(0..PAGE, Tier::Host);
    ticket.poll().unwrap().unwrap();

    // The C twin, through the ABI only.
    let mut config = std::mem::MaybeUninit::<strata_config>::uninit();
    // SAFETY: a writable strata_config.
    let status = unsafe { strata_config_init(config.as_mut_ptr()) };
    assert_eq!(status, STRATA_OK);
    // SAFETY: filled by strata_config_init.
    let mut config = unsafe { config.assume_init() };
    config.page_size = PAGE;
    config.device = STRATA_DEVICE_SIM;
    config.device_capacity = 64 * PAGE;
    config.host_capacity = 256 * PAGE;
    let (mut crt, mut cbuf, mut cticket) = (null_mut(), null_mut(), null_mut());
    // SAFETY: a readable config and writable out-pointers; `data` is
    // readable for its length.
    unsafe {
        assert_eq!(strata_runtime_create(&config, &mut crt), STRATA_OK);
        assert_eq!(
            strata_alloc_in(crt, PAGES * PAGE, STRATA_TIER_HOST, &mut cbuf),
            STRATA_OK
        );
        let data = vec![1u8; (PAGES * PAGE) as usize];
        assert_eq!(
            strata_write(cbuf, 0, data.as_ptr().cast(), data.len()),
            STRATA_OK
        );
        assert_eq!(
            strata_prefetch(cbuf, 0, PAGE, STRATA_TIER_HOST, &mut cticket),
            STRATA_OK
        );
    }
    assert_eq!(strata_ticket_poll(cticket), STRATA_OK);

    let mut g = c.benchmark_group("abi");
    g.bench_function("buffer len: rust", |b| b.iter(|| black_box(&buf).len()));
    g.bench_function("buffer len: c-abi", |b| {
        let mut len = 0u64;
        // SAFETY: a writable u64.
        b.iter(|| unsafe { strata_buffer_len(black_box(cbuf), &mut len) })
    });

    let mut p = 0usize;
    g.bench_function("tier_of: rust", |b| {
        b.iter(|| {
            p = (p + 37) % PAGES as usize;
            black_box(buf.tier_of(p).unwrap())
        })
    });
    g.bench_function("tier_of: c-abi", |b| {
        let mut t = 0;
        b.iter(|| {
            p = (p + 37) % PAGES as usize;
            // SAFETY: a writable strata_tier.
            unsafe { strata_buffer_tier_of(black_box(cbuf), p, &mut t) }
        })
    });

    let mut out = [0u8; 64];
    let mut off = 0u64;
    g.bench_function("64 B read: rust", |b| {
        b.iter(|| {
            off = (off + 4160) % (PAGES * PAGE - 64);
            buf.read(off, &mut out).unwrap()
        })
    });
    g.bench_function("64 B read: c-abi", |b| {
        b.iter(|| {
            off = (off + 4160) % (PAGES * PAGE - 64);
            // SAFETY: `out` is 64 writable bytes, ours alone.
            unsafe { strata_read(black_box(cbuf), off, out.as_mut_ptr().cast(), 64) }
        })
    });

    g.bench_function("ticket poll: rust", |b| {
        b.iter(|| black_box(&ticket).poll().is_some())
    });
    g.bench_function("ticket poll: c-abi", |b| {
        b.iter(|| strata_ticket_poll(black_box(cticket)))
    });
    g.finish();

    assert_eq!(strata_ticket_free(cticket), STRATA_OK);
    assert_eq!(strata_runtime_destroy(crt), STRATA_OK);
}

criterion_group!(benches, abi);
criterion_main!(benches);
