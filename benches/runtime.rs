//! The runtime's access path: the page-table lookup (target ≤ 50 ns) and
//! small reads through it from pages resident in host memory and on the
//! simulated device.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use strata::device::DeviceChoice;
use strata::runtime::Placement;
use strata::{Runtime, Tier};

fn runtime(c: &mut Criterion) {
    let page = 64 << 10;
    let rt = Runtime::builder()
        .page_size(page)
        .device(DeviceChoice::Sim, 64 * page as u64)
        .host(256 * page as u64)
        .build()
        .unwrap();
    let host = rt
        .alloc_with(128 * page as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    host.write(0, &vec![1u8; host.len() as usize]).unwrap();
    let dev = rt.alloc(32 * page as u64).unwrap();
    dev.write(0, &vec![2u8; dev.len() as usize]).unwrap();
    assert_eq!(dev.tier_of(0).unwrap(), Some(Tier::Device));

    let mut g = c.benchmark_group("runtime");
    let mut p = 0usize;
    g.bench_function("page-table lookup", |b| {
        b.iter(|| {
            p = (p + 37) % 128;
            std::hint::black_box(host.tier_of(p).unwrap());
        })
    });
    g.throughput(Throughput::Bytes(64));
    let mut out = [0u8; 64];
    let mut off = 0u64;
    g.bench_function("64 B read, host page", |b| {
        b.iter(|| {
            off = (off + 4160) % (host.len() - 64);
            host.read(off, &mut out).unwrap();
        })
    });
    g.bench_function("64 B read, simulated device page", |b| {
        b.iter(|| {
            off = (off + 4160) % (dev.len() - 64);
            dev.read(off, &mut out).unwrap();
        })
    });
    g.finish();
}

criterion_group!(benches, runtime);
criterion_main!(benches);
