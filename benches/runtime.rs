//! The runtime's access path: the page-table lookup (target ≤ 50 ns) and
//! small reads through it from pages resident in host memory and on the
//! simulated device; and a simulated kernel reading through a device map
//! with access counting off, on every access, and sampled (the counter
//! overhead target: ≤ 10% of the kernel's time with sampling).

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

/// A simulated kernel: sums 4 MiB of u64 through the device map, gathering
/// 8 consecutive elements at random places (graph kernels read neighbour
/// lists that way), counting accesses as configured.
fn counters(c: &mut Criterion) {
    let page = 64 << 10;
    let mut g = c.benchmark_group("kernel-counters");
    let words = (4u64 << 20) / 8;
    g.throughput(Throughput::Bytes(words * 8));
    for (name, shift) in [
        ("off", None),
        ("every access", Some(0)),
        ("1 in 32", Some(5)),
    ] {
        let rt = Runtime::builder()
            .page_size(page)
            .device(DeviceChoice::Sim, 128 * page as u64)
            .host(64 * page as u64)
            .sampling(shift)
            .build()
            .unwrap();
        let b = rt.alloc(words * 8).unwrap();
        let data: Vec<u8> = (0..words).flat_map(|w| w.to_ne_bytes()).collect();
        b.write(0, &data).unwrap();
        let map = b.device_map().unwrap();
        let launch = map.prepare(strata::runtime::Access::ReadOnly).unwrap();
        g.bench_function(name, |bench| {
            bench.iter(|| {
                let mut r = launch.reader(1);
                let mut sum = 0u64;
                let mut at = 12345u64;
                for _ in 0..words / 8 {
                    at = (at
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407))
                        % (words - 8);
                    for i in 0..8 {
                        sum = sum.wrapping_add(r.load::<u64>(at + i));
                    }
                }
                std::hint::black_box(sum)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, runtime, counters);
criterion_main!(benches);
