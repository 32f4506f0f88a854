//! Trace replay speed per policy (target: lru, lfu and default at least
//! 10 M accesses/s in release): a Zipf(1.0) trace over 1 M pages through a
//! cache of 1/8 of its footprint; and the default alone at capacities from
//! 64 pages up (target: at least 10 M accesses/s at every capacity).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use strata::policy::{self, PolicyKind};
use strata_bench::gen;

fn replay(c: &mut Criterion) {
    // Small in debug builds, where `cargo test --benches` runs each once.
    let (pages, accesses) = if cfg!(debug_assertions) {
        (10_000, 50_000)
    } else {
        (1 << 20, 4 << 20)
    };
    let t = gen::zipf(1.0, pages, accesses, 1).unwrap();
    let mut distinct = t.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let capacity = distinct.len() / 8;

    let mut g = c.benchmark_group("replay");
    g.sample_size(10);
    g.throughput(Throughput::Elements(t.len() as u64));
    for kind in PolicyKind::ALL {
        // Building the policy is timed too: Belady's next-use pass is part
        // of its cost.
        g.bench_function(kind.name(), |b| {
            b.iter(|| {
                let mut p = policy::build(kind, capacity, Some(&t)).unwrap();
                policy::replay(p.as_mut(), &t)
            })
        });
    }
    g.finish();

    // The default at several capacities: its tuner's share of the work is
    // largest at small ones.
    let mut g = c.benchmark_group("replay-default");
    g.sample_size(10);
    g.throughput(Throughput::Elements(t.len() as u64));
    for cap in [64, 256, 1024, 4096, capacity] {
        g.bench_function(format!("{cap}"), |b| {
            b.iter(|| {
                let mut p = policy::build(PolicyKind::Default, cap, None).unwrap();
                policy::replay(p.as_mut(), &t)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, replay);
criterion_main!(benches);
