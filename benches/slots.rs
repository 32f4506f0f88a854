//! Slot allocation: one alloc + free pair, uncontended (target ≤ 100 ns each).

use criterion::{criterion_group, criterion_main, Criterion};
use strata::lowlevel::SlotAllocator;
use strata::tier::{HostConfig, HostStore, PageStore};

fn slots(c: &mut Criterion) {
    let mut g = c.benchmark_group("slots");
    let alloc = SlotAllocator::new(1 << 20);
    // Warm the free list so alloc takes the free-list path, as in steady state.
    let warm: Vec<_> = (0..1024).map(|_| alloc.alloc().unwrap()).collect();
    for s in warm {
        alloc.free(s).unwrap();
    }
    g.bench_function("allocator alloc+free", |b| {
        b.iter(|| {
            let s = alloc.alloc().unwrap();
            alloc.free(std::hint::black_box(s)).unwrap();
        })
    });
    let store = HostStore::new(&HostConfig::new(64 << 20, 64 << 10)).unwrap();
    g.bench_function("host store alloc+free", |b| {
        b.iter(|| {
            let s = store.alloc().unwrap();
            store.free(std::hint::black_box(s)).unwrap();
        })
    });
    g.finish();
}

criterion_group!(benches, slots);
criterion_main!(benches);
