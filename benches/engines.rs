//! The I/O engines under the NVMe store: one verified 4 KiB page read and
//! one 64 KiB page write at a time, per engine, in a temporary directory of
//! the working directory's filesystem (not /tmp, which may be a tmpfs or
//! ramfs without O_DIRECT).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use strata::io::{self, EngineChoice};
use strata::tier::{NvmeConfig, NvmeStore, PageStore};

fn engines(c: &mut Criterion) {
    let mut choices = vec![EngineChoice::Psync];
    if io::engine(EngineChoice::Uring).is_ok() {
        choices.push(EngineChoice::Uring);
    } else {
        eprintln!("skipping io_uring: unavailable here");
    }
    let dir = tempfile::tempdir_in(".").expect("a temporary directory");
    for page in [4096usize, 65536] {
        let mut g = c.benchmark_group(format!("nvme page {}K", page / 1024));
        g.throughput(Throughput::Bytes(page as u64));
        for &choice in &choices {
            let mut cfg = NvmeConfig::new(dir.path(), 256 * page as u64, page);
            cfg.engine = choice;
            let store = NvmeStore::new(&cfg).unwrap();
            let mut slots: Vec<_> = (0..store.capacity_pages())
                .map(|_| store.alloc().unwrap())
                .collect();
            let data = vec![5u8; page];
            for s in slots.iter_mut() {
                store.write_page(s, &data).unwrap();
            }
            let name = store.engine().name();
            let mut out = vec![0u8; page];
            let mut i = 0;
            g.bench_function(format!("{name} read"), |b| {
                b.iter(|| {
                    i = (i * 97 + 13) % slots.len();
                    store.read_page(&slots[i], &mut out).unwrap();
                })
            });
            g.bench_function(format!("{name} write"), |b| {
                b.iter(|| {
                    i = (i * 97 + 13) % slots.len();
                    store.write_page(&mut slots[i], &data).unwrap();
                })
            });
            for s in slots {
                store.free(s).unwrap();
            }
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = engines
}
criterion_main!(benches);
