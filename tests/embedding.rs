//! The embedding table on tiny tiers (two pages of simulated device, two
//! of host memory, NVMe below), so that its pages move between calls —
//! by the balancer, by evictions and prefetches — against a naive
//! in-memory table: every gather, update and read must give exactly what
//! the in-memory table gives.

use rand::{Rng, SeedableRng};
use strata::device::DeviceChoice;
use strata::offload::embedding::{Bags, EmbeddingTable, Pooling, RowCacheOptions, TableOptions};
use strata::runtime::BalancerConfig;
use strata::tier::NvmeConfig;
use strata::{Runtime, Tier};

const PAGE: usize = 4096;

fn tiny(dir: &std::path::Path, host_pages: u64) -> Runtime {
    Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 2 * PAGE as u64)
        .host(host_pages * PAGE as u64)
        .nvme(NvmeConfig::new(dir, 256 * PAGE as u64, PAGE))
        .sampling(Some(0))
        .build()
        .unwrap()
}

/// The naive table: rows in a Vec, pooled and updated in index order.
struct Naive {
    w: Vec<f32>,
    dim: usize,
    state: Vec<f32>,
}

impl Naive {
    fn gather(&self, bags: &Bags<'_>) -> Vec<f32> {
        let d = self.dim;
        let mut out = vec![0f32; bags.len() * d];
        for b in 0..bags.len() {
            let dst = &mut out[b * d..(b + 1) * d];
            let mut n = 0;
            for i in bags.offsets[b] as usize..bags.offsets[b + 1] as usize {
                let r = bags.indices[i];
                if Some(r) == bags.padding_idx {
                    continue;
                }
                let row = &self.w[r as usize * d..(r as usize + 1) * d];
                for (o, &v) in dst.iter_mut().zip(row) {
                    *o += match bags.weights {
                        Some(w) => w[i] * v,
                        None => v,
                    };
                }
                n += 1;
            }
            if bags.pooling == Pooling::Mean && n > 0 {
                dst.iter_mut().for_each(|o| *o /= n as f32);
            }
        }
        out
    }

    fn step(&mut self, rows: &[i64], grads: &[f32], lr: f32, adagrad: bool) {
        let d = self.dim;
        for (k, &r) in rows.iter().enumerate() {
            let g = &grads[k * d..(k + 1) * d];
            let scale = if adagrad {
                let acc = &mut self.state[r as usize];
                *acc += g.iter().map(|x| x * x).sum::<f32>() / d as f32;
                lr / (acc.sqrt() + 1e-6)
            } else {
                lr
            };
            for (x, &gx) in self.w[r as usize * d..(r as usize + 1) * d]
                .iter_mut()
                .zip(g)
            {
                *x -= scale * gx;
            }
        }
    }
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// One table shape: `dim` floats a row (rows straddle pages unless the
/// row size divides the page size), on a host tier of `host_pages`. With
/// `mapped`, every fifth gather runs as the simulated kernel does (the
/// memory tiers must then hold the whole table: the launch stages its
/// NVMe pages in). With `cached` rows, the table keeps a row cache in a
/// page of the device (every gather reads through it, and every update
/// writes through it).
fn run(dim: usize, seed: u64, host_pages: u64, mapped: bool, cached: Option<usize>) {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), host_pages);
    let rows = 1500u64;
    let table = EmbeddingTable::with_options(
        &rt,
        rows,
        dim,
        TableOptions {
            threads: 4,
            row_cache: cached.map(RowCacheOptions::new),
            ..TableOptions::default()
        },
    )
    .unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let w: Vec<f32> = (0..rows as usize * dim)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    table.write_rows(0, &w).unwrap();
    let mut naive = Naive {
        w,
        dim,
        state: vec![0.0; rows as usize],
    };
    let mut state = vec![0f32; rows as usize];
    let pages = table.buffer().page_count();
    let mut tiers_seen = [false; 4];
    for step in 0..24 {
        // Hot rows at the front, the rest anywhere.
        let n = rng.random_range(0..200);
        let idx: Vec<i64> = (0..n)
            .map(|_| {
                if rng.random_bool(0.6) {
                    rng.random_range(0..64)
                } else {
                    rng.random_range(0..rows as i64)
                }
            })
            .collect();
        let mut offsets = vec![0i64];
        while *offsets.last().unwrap() < n as i64 {
            let next = (offsets.last().unwrap() + rng.random_range(0..12)).min(n as i64);
            offsets.push(next);
        }
        offsets.push(n as i64); // an empty last bag
        let weights: Vec<f32> = (0..n).map(|_| rng.random_range(0.0..2.0)).collect();
        let mut bags = Bags::new(&idx, &offsets);
        if step % 3 == 1 {
            bags = bags.weights(&weights);
        }
        if step % 2 == 1 {
            bags = bags.pooling(Pooling::Mean);
        }
        if step % 4 == 3 {
            bags = bags.padding_idx(Some(rng.random_range(0..64)));
        }
        let mut out = vec![f32::NAN; bags.len() * dim];
        if mapped && step % 5 == 4 {
            table.gather_mapped(&bags, step, &mut out).unwrap();
        } else {
            table.gather(&bags, &mut out).unwrap();
        }
        assert!(
            same(&out, &naive.gather(&bags)),
            "dim {dim} step {step}: gather"
        );
        // The distinct rows of the batch, updated.
        let mut touched = idx.clone();
        touched.sort_unstable();
        touched.dedup();
        let grads: Vec<f32> = (0..touched.len() * dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let adagrad = step % 2 == 0;
        if adagrad {
            table
                .rowwise_adagrad(&touched, &grads, &mut state, 0.05, 1e-6)
                .unwrap();
        } else {
            table.sgd(&touched, &grads, 0.05).unwrap();
        }
        naive.step(&touched, &grads, 0.05, adagrad);
        assert!(same(&state, &naive.state), "dim {dim} step {step}: state");
        // Pages move between calls: the balancer, then an eviction of a
        // range to NVMe and a prefetch of another into the device.
        rt.balance_once().unwrap();
        let a = rng.random_range(0..pages as u64) * PAGE as u64;
        table
            .buffer()
            .evict(
                a..(a + 2 * PAGE as u64).min(table.buffer().len()),
                Tier::Nvme,
            )
            .unwrap();
        let b = rng.random_range(0..pages as u64) * PAGE as u64;
        let _ = table
            .buffer()
            .prefetch(b..b + PAGE as u64, Tier::Device)
            .wait();
        for p in 0..pages {
            if let Some(t) = table.buffer().tier_of(p).unwrap() {
                tiers_seen[t as usize] = true;
            }
        }
    }
    assert!(
        tiers_seen[Tier::Device as usize]
            && tiers_seen[Tier::Host as usize]
            && tiers_seen[Tier::Nvme as usize],
        "pages were in every tier: {tiers_seen:?}"
    );
    let all: Vec<i64> = (0..rows as i64).collect();
    let mut back = vec![0f32; naive.w.len()];
    table.read_rows(&all, &mut back).unwrap();
    assert!(same(&back, &naive.w), "dim {dim}: the rows at the end");
    if cached.is_some() {
        let s = table.stats();
        assert!(
            s.cache_hits > 0 && s.cache_fills > 0,
            "the hot rows were cached: {s:?}"
        );
    }
    rt.check().unwrap();
}

#[test]
fn rows_that_fit_pages_match_the_naive_table_while_pages_move() {
    run(16, 1, 2, false, None);
}

#[test]
fn rows_that_straddle_pages_match_the_naive_table_while_pages_move() {
    run(7, 2, 2, false, None);
}

#[test]
fn mapped_gathers_stage_nvme_pages_and_match_the_naive_table() {
    run(16, 3, 32, true, None);
}

#[test]
fn a_row_cache_matches_the_naive_table_while_pages_move_and_rows_update() {
    run(16, 4, 2, false, Some(64));
    run(7, 5, 2, false, Some(100));
}

#[test]
fn a_row_cache_read_by_mapped_and_buffer_gathers_matches_the_naive_table() {
    run(16, 6, 32, true, Some(64));
}

#[test]
fn a_mapped_gather_of_a_table_larger_than_memory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), 2);
    let table = EmbeddingTable::new(&rt, 1024, 16).unwrap(); // 16 pages
    table.write_rows(0, &vec![1.0; 1024 * 16]).unwrap();
    let mut out = vec![0f32; 16];
    let e = table
        .gather_mapped(&Bags::new(&[3], &[0, 1]), 0, &mut out)
        .unwrap_err();
    assert_eq!(e.kind(), strata::ErrorKind::OutOfCapacity, "{e}");
    assert_eq!(table.stats().lookups, 0);
    // The buffer gather reads it from wherever it is.
    table.gather(&Bags::new(&[3], &[0, 1]), &mut out).unwrap();
    assert_eq!(out, vec![1.0; 16]);
}

#[test]
fn concurrent_gathers_under_a_background_balancer_read_what_was_written() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tiny(dir.path(), 2);
    let (rows, dim) = (2000u64, 12usize);
    let table = EmbeddingTable::new(&rt, rows, dim).unwrap();
    let w: Vec<f32> = (0..rows as usize * dim).map(|i| i as f32).collect();
    table.write_rows(0, &w).unwrap();
    rt.start_balancer(BalancerConfig::default().with_interval(std::time::Duration::from_millis(1)))
        .unwrap();
    let naive = Naive {
        w,
        dim,
        state: Vec::new(),
    };
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (table, naive) = (&table, &naive);
            s.spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(t);
                for _ in 0..40 {
                    let idx: Vec<i64> = (0..64)
                        .map(|_| rng.random_range(0..rows as i64 / (t as i64 + 1)))
                        .collect();
                    let offsets: Vec<i64> = (0..=8).map(|b| b * 8).collect();
                    let bags = Bags::new(&idx, &offsets);
                    let mut out = vec![0f32; 8 * dim];
                    let l = table.gather(&bags, &mut out).unwrap();
                    assert_eq!(l.lookups, 64);
                    assert!(same(&out, &naive.gather(&bags)));
                }
            });
        }
    });
    rt.stop_balancer();
    assert_eq!(table.stats().lookups, 3 * 40 * 64);
    rt.check().unwrap();
}

/// A row across a page boundary, written by one thread while another
/// updates it or writes it too (no row cache): each call applies whole, so
/// the row ends as one order or the other made it, never half of each.
#[test]
fn a_row_across_two_pages_is_written_and_updated_whole() {
    for placement in [Tier::Host, Tier::Nvme] {
        let dir = tempfile::tempdir().unwrap();
        let rt = Runtime::builder()
            .page_size(PAGE)
            .host(64 * PAGE as u64)
            .nvme(NvmeConfig::new(dir.path(), 256 * PAGE as u64, PAGE))
            .background_eviction(false)
            .build()
            .unwrap();
        let dim = 300;
        let options = TableOptions {
            placement: strata::runtime::Placement::Prefer(placement),
            ..TableOptions::default()
        };
        let t = EmbeddingTable::with_options(&rt, 32, dim, options).unwrap();
        t.write_rows(0, &vec![0.0; 32 * dim]).unwrap();
        // Row 3 is bytes 3 600..4 800: pages 0 and 1.
        let r = 3i64;
        let rounds = 200;
        let barrier = std::sync::Barrier::new(3);
        let torn = std::thread::scope(|s| {
            let (t, b) = (&t, &barrier);
            s.spawn(move || {
                for k in 0..rounds {
                    b.wait();
                    t.write_rows(r, &vec![(k * 10) as f32; dim]).unwrap();
                    b.wait();
                }
            });
            s.spawn(move || {
                for k in 0..rounds {
                    b.wait();
                    if k % 2 == 0 {
                        t.sgd(&[r], &vec![1.0; dim], 1.0).unwrap();
                    } else {
                        t.write_rows(r, &vec![-7.0; dim]).unwrap();
                    }
                    b.wait();
                }
            });
            let mut torn = 0;
            for _ in 0..rounds {
                b.wait();
                b.wait();
                let mut got = vec![0.0f32; dim];
                t.read_rows(&[r], &mut got).unwrap();
                torn += usize::from(got.iter().any(|&x| x != got[0]));
            }
            torn
        });
        assert_eq!(
            torn, 0,
            "{placement:?}: {torn} of {rounds} rounds left a row half written"
        );
    }
}

/// A row a gather fills into the row cache counts as one access of its
/// page, as a lookup of the table without a cache does: the bytes read for
/// the fill are the ones pooled (read again, its page looked twice as hot
/// to the balancer as an NVMe page, whose lookups count once).
#[test]
fn a_row_filled_into_the_row_cache_counts_once_as_an_access_of_its_page() {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(64 * PAGE as u64)
        .nvme(NvmeConfig::new(dir.path(), 64 * PAGE as u64, PAGE))
        .sampling(Some(0))
        .background_eviction(false)
        .build()
        .unwrap();
    // 16 floats a row: rows 0..64 are page 0.
    let dim = 16;
    let accesses = |cache: Option<usize>| {
        let options = TableOptions {
            placement: strata::runtime::Placement::Prefer(Tier::Host),
            row_cache: cache.map(RowCacheOptions::new),
            ..TableOptions::default()
        };
        let t = EmbeddingTable::with_options(&rt, 64, dim, options).unwrap();
        t.write_rows(0, &vec![1.0; 64 * dim]).unwrap();
        let map = t.buffer().device_map().unwrap();
        let before = map.counts()[0];
        let mut out = vec![0.0; dim];
        t.gather(&Bags::new(&[5, 6, 7, 8], &[0, 4]), &mut out)
            .unwrap();
        assert_eq!(out, vec![4.0; dim]);
        map.counts()[0] - before
    };
    assert_eq!(accesses(Some(8)), accesses(None));
}
