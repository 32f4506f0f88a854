//! The optimizer's unit tests: failures part-way through a step, restored
//! and checkpointed state (the rest, against a reference Adam, is in
//! `tests/offload.rs`).

use super::*;
use crate::io::fault::{Fault, FaultEngine, FaultPlan};
use crate::io::IoOp;
use std::sync::Arc;

const PAGE: usize = 4096;

/// A runtime of 4 KiB pages with a small host tier beside an NVMe
/// tier whose engine injects the faults of the plan returned.
pub(super) fn faulty_runtime(dir: &std::path::Path) -> (Runtime, Arc<FaultPlan>) {
    let plan = FaultPlan::new();
    let engine = crate::io::engine(crate::io::EngineChoice::Psync).unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .host(64 * PAGE as u64)
        .nvme(NvmeConfig::new(dir, 256 * PAGE as u64, PAGE))
        .nvme_engine(Arc::new(FaultEngine::new(engine, plan.clone())))
        .background_eviction(false)
        .build()
        .unwrap();
    (rt, plan)
}

/// A flush that fails half-way leaves each chunk readable as it is:
/// the chunks it updated as after the step, the others as before it
/// (their resident elements included), and refuses further steps.
#[test]
fn a_failed_flush_leaves_each_chunk_readable() {
    let chunk = PAGE / 4;
    let n = 3 * chunk + 100;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let grads = |t: u64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| ((i * 2654435761 + t * 97) % 10007) as f32 / 10007.0 - 0.5)
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let (rt, plan) = faulty_runtime(dir.path());
    let mut cfg = OptimConfig::new(StateTier::Nvme(dir.path().into()));
    cfg.chunk_bytes = PAGE;
    cfg.adam.lr = 1e-2;
    cfg.importance = Some(Importance {
        fraction: 0.25,
        every: 3,
    });
    let mut a = OffloadedAdam::on(&rt, &w0, cfg.clone()).unwrap();
    let mut b = OffloadedAdam::on(&rt, &w0, cfg).unwrap();
    // Step 1 flushes, 2 and 3 update only the resident elements, 4
    // flushes again.
    for t in 1..=3 {
        a.step(&grads(t)).unwrap();
        b.step(&grads(t)).unwrap();
    }
    let before: Vec<Vec<f32>> = (0..3).map(|k| a.read_state(k).unwrap()).collect();
    b.step(&grads(4)).unwrap();
    let after: Vec<Vec<f32>> = (0..3).map(|k| b.read_state(k).unwrap()).collect();
    // The flush reads every page from NVMe, the last group's last:
    // that read fails, after the groups before it were updated.
    let window = a.states.window();
    assert!(window.group < a.chunks(), "more than one group");
    plan.inject(
        IoOp::Read,
        3 * a.chunks() as u64 - 1,
        Fault::Errno(libc::EIO),
    );
    assert_eq!(a.step(&grads(4)).unwrap_err().kind(), ErrorKind::Io);
    assert_eq!(plan.injected(), 1);
    let last_group = (a.chunks() - 1) / window.group * window.group;
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let cut = last_group * chunk;
    for k in 0..3 {
        let got = a.read_state(k).unwrap();
        assert_eq!(bits(&got[..cut]), bits(&after[k][..cut]), "state {k}");
        assert_eq!(bits(&got[cut..]), bits(&before[k][cut..]), "state {k}");
    }
    assert_eq!(a.step(&grads(5)).unwrap_err().kind(), ErrorKind::Closed);
}

/// A step that fails before any chunk is updated (here its first read
/// from NVMe) changes nothing: the optimizer takes the same step again,
/// and ends bitwise where its twin that never failed does — in plain and
/// in importance-aware mode.
#[test]
fn a_step_that_failed_before_any_update_can_be_taken_again() {
    let chunk = PAGE / 4;
    let n = 3 * chunk + 100;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.29).cos()).collect();
    let grads = |t: u64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| ((i * 40503 + t * 131) % 9973) as f32 / 9973.0 - 0.5)
            .collect()
    };
    for importance in [
        None,
        Some(Importance {
            fraction: 0.25,
            every: 2,
        }),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (rt, plan) = faulty_runtime(dir.path());
        let mut cfg = OptimConfig::new(StateTier::Nvme(dir.path().into()));
        cfg.chunk_bytes = PAGE;
        cfg.adam.lr = 1e-2;
        cfg.importance = importance;
        let mut a = OffloadedAdam::on(&rt, &w0, cfg.clone()).unwrap();
        let mut b = OffloadedAdam::on(&rt, &w0, cfg).unwrap();
        a.step(&grads(1)).unwrap();
        b.step(&grads(1)).unwrap();
        // Step 2 is a window's step in importance mode (no I/O); step 3
        // reads the states in both modes.
        for t in 2..=3 {
            if t == 3 {
                plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
                assert_eq!(a.step(&grads(t)).unwrap_err().kind(), ErrorKind::Io);
                assert_eq!(plan.injected(), 1);
            }
            a.step(&grads(t)).unwrap();
            b.step(&grads(t)).unwrap();
        }
        assert_eq!(a.steps(), b.steps());
        let bits = |x: Vec<f32>| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for k in 0..3 {
            assert_eq!(
                bits(a.read_state(k).unwrap()),
                bits(b.read_state(k).unwrap()),
                "{importance:?}: state {k}"
            );
        }
    }
}

/// A restored optimizer (weights, moments and step count written into
/// a fresh one) continues bitwise as the original does, on every tier
/// kind that needs no disk; hyper-parameters changed between steps
/// apply from the next one.
#[test]
fn restored_state_continues_bitwise() {
    let n = 3 * PAGE / 4 + 5;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let g = |t: u64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| ((i * 40503 + t * 31) % 997) as f32 / 997.0 - 0.5)
            .collect()
    };
    for tier in [StateTier::Host, StateTier::Cxl] {
        let mut cfg = OptimConfig::new(tier);
        cfg.chunk_bytes = PAGE;
        cfg.adam.weight_decay = 0.01;
        let mut a = OffloadedAdam::new(&w0, cfg.clone()).unwrap();
        for t in 1..=3 {
            a.step(&g(t)).unwrap();
        }
        let mut b = OffloadedAdam::new(&vec![0.0; n], cfg).unwrap();
        for k in 0..3 {
            b.write_state(k, &a.read_state(k).unwrap()).unwrap();
        }
        b.set_steps(a.steps());
        let faster = AdamParams {
            lr: 5e-3,
            ..a.adam()
        };
        a.set_adam(faster).unwrap();
        b.set_adam(faster).unwrap();
        for t in 4..=5 {
            a.step(&g(t)).unwrap();
            b.step(&g(t)).unwrap();
        }
        let bits = |x: Vec<f32>| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for k in 0..3 {
            assert_eq!(
                bits(a.read_state(k).unwrap()),
                bits(b.read_state(k).unwrap())
            );
        }
        assert_eq!(b.steps(), 5);
        assert_eq!(
            b.write_state(1, &[0.0; 3]).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            b.write_state(3, &w0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
    let mut cfg = OptimConfig::new(StateTier::Host);
    cfg.chunk_bytes = PAGE;
    cfg.importance = Some(Importance {
        fraction: 0.5,
        every: 2,
    });
    let mut c = OffloadedAdam::new(&w0, cfg).unwrap();
    c.set_importance_window(&ImportanceWindow {
        deferred_steps: 0,
        accumulated: vec![0.0; n],
        resident: vec![],
        started: false,
    })
    .unwrap();
    assert_eq!(
        a_plain_window_is_refused(&w0).kind(),
        ErrorKind::Unsupported
    );
    c.write_state(0, &w0).unwrap();
    assert_eq!(c.read_state(0).unwrap(), w0);
}

fn a_plain_window_is_refused(w0: &[f32]) -> Error {
    let mut cfg = OptimConfig::new(StateTier::Host);
    cfg.chunk_bytes = PAGE;
    let mut plain = OffloadedAdam::new(w0, cfg).unwrap();
    assert!(plain.importance_window().is_none());
    plain
        .set_importance_window(&ImportanceWindow {
            deferred_steps: 0,
            accumulated: vec![0.0; w0.len()],
            resident: vec![],
            started: false,
        })
        .unwrap_err()
}

/// Importance mode: an optimizer restored mid-window (state arrays,
/// step count and window written into a fresh one) continues bitwise
/// as the original does; weights written from outside mid-window
/// reach the resident copies; step_in_place leaves the caller's
/// weights equal to the optimizer's at every step.
#[test]
fn importance_window_restores_and_steps_in_place() {
    let chunk = PAGE / 4;
    let n = 2 * chunk + 77;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.29).sin()).collect();
    let g = |t: u64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| ((i * 2654435761 + t * 131) % 8191) as f32 / 8191.0 - 0.5)
            .collect()
    };
    let mut cfg = OptimConfig::new(StateTier::Cxl);
    cfg.chunk_bytes = PAGE;
    cfg.adam.lr = 1e-2;
    cfg.importance = Some(Importance {
        fraction: 0.1,
        every: 4,
    });
    let mut a = OffloadedAdam::new(&w0, cfg.clone()).unwrap();
    let mut mine = w0.clone();
    for t in 1..=6 {
        a.step_in_place(&g(t), &mut mine).unwrap();
        assert_eq!(mine, a.read_state(0).unwrap(), "step {t}");
    }
    // Step 6 is inside the second window (flushes at 1 and 5).
    let win = a.importance_window().unwrap();
    assert_eq!(win.deferred_steps, 1);
    assert!(win.started && !win.resident.is_empty());
    let mut b = OffloadedAdam::new(&vec![0.0; n], cfg).unwrap();
    for k in 0..3 {
        b.write_state(k, &a.read_state(k).unwrap()).unwrap();
    }
    b.set_steps(a.steps());
    b.set_importance_window(&win).unwrap();
    assert_eq!(b.importance_window().unwrap(), win);
    // Weights changed from outside mid-window, in both.
    let halved: Vec<f32> = a.read_state(0).unwrap().iter().map(|w| w * 0.5).collect();
    a.write_state(0, &halved).unwrap();
    b.write_state(0, &halved).unwrap();
    assert_eq!(a.read_state(0).unwrap(), halved);
    let bits = |x: Vec<f32>| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for t in 7..=10 {
        a.step(&g(t)).unwrap();
        b.step(&g(t)).unwrap();
        for k in 0..3 {
            assert_eq!(
                bits(a.read_state(k).unwrap()),
                bits(b.read_state(k).unwrap())
            );
        }
    }
    let mut bad = win.clone();
    bad.resident = vec![5, 3];
    assert_eq!(
        b.set_importance_window(&bad).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    bad = win;
    bad.deferred_steps = 4;
    assert_eq!(
        b.set_importance_window(&bad).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

/// A mixed-precision step is the fp32 step on the masters: bf16 (or fp16)
/// gradients widened exactly and unscaled, the masters updated in fp32,
/// the caller's parameters the masters rounded to nearest even — in plain
/// and importance mode, in the host tier and streamed from NVMe.
#[test]
fn a_mixed_precision_step_is_the_fp32_step_on_the_masters() {
    let chunk = PAGE / 4;
    let n = 3 * chunk + 77;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let grads = |t: u64| -> Vec<bf16> {
        (0..n as u64)
            .map(|i| bf16::from_f32(((i * 40503 + t * 31) % 4099) as f32 / 512.0 - 4.0))
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    for (tier, importance) in [
        (StateTier::Host, None),
        (StateTier::Nvme(dir.path().into()), None),
        (
            StateTier::Host,
            Some(Importance {
                fraction: 0.3,
                every: 2,
            }),
        ),
    ] {
        let mut cfg = OptimConfig::new(tier);
        cfg.chunk_bytes = PAGE;
        cfg.adam.lr = 1e-2;
        cfg.adam.weight_decay = 0.1;
        cfg.importance = importance;
        let mut mixed = OffloadedAdam::new(&w0, cfg.clone()).unwrap();
        let mut plain = OffloadedAdam::new(&w0, cfg).unwrap();
        let mut params: Vec<bf16> = w0.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut halves: Vec<f16> = w0.iter().map(|&x| f16::from_f32(x)).collect();
        let mut as_f16 = OffloadedAdam::new(&w0, plain.config.clone()).unwrap();
        for t in 1..=5 {
            let g = grads(t);
            // Gradients scaled by 8 (a loss scale), unscaled by the step.
            let scaled: Vec<bf16> = g.iter().map(|x| bf16::from_f32(x.to_f32() * 8.0)).collect();
            mixed.step_mixed(&scaled, 0.125, &mut params).unwrap();
            let g32: Vec<f32> = g.iter().map(|x| x.to_f32()).collect();
            plain.step(&g32).unwrap();
            as_f16.step_mixed(&g32, 1.0, &mut halves).unwrap();
        }
        let masters = plain.weights().unwrap();
        assert_eq!(mixed.weights().unwrap(), masters);
        assert_eq!(as_f16.weights().unwrap(), masters);
        for i in 0..n {
            assert_eq!(params[i], bf16::from_f32(masters[i]), "bf16 parameter {i}");
            assert_eq!(halves[i], f16::from_f32(masters[i]), "fp16 parameter {i}");
        }
    }
}

/// Bad input to a mixed-precision step is refused before it changes
/// anything.
#[test]
fn a_mixed_precision_step_refuses_a_bad_unscale_or_length() {
    let w0 = vec![0.5f32; 1000];
    let mut cfg = OptimConfig::new(StateTier::Host);
    cfg.chunk_bytes = PAGE;
    let mut a = OffloadedAdam::new(&w0, cfg).unwrap();
    let mut w = vec![bf16::from_f32(0.5); 1000];
    let g = vec![bf16::ONE; 1000];
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = a.step_mixed(&g, bad, &mut w).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }
    let e = a.step_mixed(&g[..999], 1.0, &mut w).unwrap_err();
    assert!(e.to_string().contains("999 gradients"), "{e}");
    let e = a.step_mixed(&g, 1.0, &mut w[..10]).unwrap_err();
    assert!(e.to_string().contains("10 weights out"), "{e}");
    assert_eq!(a.steps(), 0);
    assert_eq!(a.weights().unwrap(), w0);
    a.step_mixed(&g, 1.0, &mut w).unwrap();
    assert_eq!(a.steps(), 1);
}

/// An aliased step (the caller's fp32 array is the master) gives bitwise
/// the plain step's weights and moments, with the states in DRAM, CXL or
/// on NVMe (where only the moments stream); from then on the tier's
/// weights are not the truth, so reading them and the other steps are
/// refused.
#[test]
fn an_aliased_step_updates_the_callers_weights_as_the_master() {
    let chunk = PAGE / 4;
    let n = 2 * chunk + 5;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.07).sin()).collect();
    let g: Vec<f32> = (0..n).map(|i| ((i % 17) as f32 - 8.0) * 1e-2).collect();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = OptimConfig::new(StateTier::Host);
    cfg.chunk_bytes = PAGE;
    cfg.adam.weight_decay = 0.01;
    for tier in [
        StateTier::Host,
        StateTier::Cxl,
        StateTier::Nvme(dir.path().into()),
    ] {
        let mut cfg = cfg.clone();
        cfg.tier = tier.clone();
        let mut aliased = OffloadedAdam::new(&w0, cfg.clone()).unwrap();
        let mut plain = OffloadedAdam::new(&w0, cfg).unwrap();
        let mut w = w0.clone();
        // A bad call before the first aliased step changes nothing.
        assert!(aliased.step_aliased(&g[..3], 1.0, &mut w).is_err());
        assert_eq!(aliased.weights().unwrap(), w0);
        for _ in 0..4 {
            let stats = aliased.step_aliased(&g, 0.5, &mut w).unwrap();
            // The moments alone: two arrays of three chunks.
            assert_eq!(stats.bytes_read, 2 * 3 * PAGE as u64, "{tier:?}");
            let half: Vec<f32> = g.iter().map(|x| x * 0.5).collect();
            plain.step(&half).unwrap();
        }
        assert_eq!(w, plain.weights().unwrap(), "{tier:?}");
        for k in 1..3 {
            assert_eq!(aliased.read_state(k).unwrap(), plain.read_state(k).unwrap());
        }
        let e = aliased.read_state(0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(aliased.step(&g).is_err());
        assert!(aliased.step_mixed(&g, 1.0, &mut w.clone()).is_err());
    }
    // Only in plain mode.
    let mut imp = cfg;
    imp.importance = Some(Importance {
        fraction: 0.5,
        every: 2,
    });
    let mut a = OffloadedAdam::new(&w0, imp).unwrap();
    let e = a.step_aliased(&g, 1.0, &mut w0.clone()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    a.step(&g).unwrap();
}

/// Hyper-parameters a step cannot take (a beta of 1, a NaN or negative
/// rate) are refused when the optimizer is made and when they are changed,
/// and a refused change keeps the ones before: no step turns the weights
/// into NaN.
#[test]
fn hyper_parameters_a_step_cannot_take_are_refused() {
    let bad = [
        AdamParams {
            lr: f32::NAN,
            ..AdamParams::default()
        },
        AdamParams {
            lr: f32::INFINITY,
            ..AdamParams::default()
        },
        AdamParams {
            beta1: 1.0,
            ..AdamParams::default()
        },
        AdamParams {
            beta2: -0.5,
            ..AdamParams::default()
        },
        AdamParams {
            eps: -1.0,
            ..AdamParams::default()
        },
        AdamParams {
            weight_decay: f32::NAN,
            ..AdamParams::default()
        },
    ];
    let w = vec![0.5f32; 64];
    for adam in bad {
        let mut cfg = OptimConfig::new(StateTier::Host);
        cfg.adam = adam;
        let e = OffloadedAdam::new(&w, cfg).unwrap_err();
        assert_eq!(
            e.kind(),
            crate::error::ErrorKind::InvalidArgument,
            "{adam:?}: {e}"
        );
        let mut a = OffloadedAdam::new(&w, OptimConfig::new(StateTier::Host)).unwrap();
        assert!(a.set_adam(adam).is_err(), "{adam:?}");
        assert_eq!(a.adam(), AdamParams::default());
        a.step(&[0.25; 64]).unwrap();
        assert!(a.read_state(0).unwrap().iter().all(|x| x.is_finite()));
    }
}

/// A step inside an importance window whose weights cannot be read back
/// for the caller has happened all the same: the optimizer says so by
/// refusing further steps, as after any failed step (a caller retrying it
/// would apply the gradient twice).
#[test]
fn an_in_window_step_whose_weights_cannot_be_read_back_refuses_the_next() {
    let chunk = PAGE / 4;
    let n = 3 * chunk + 100;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let grads = |t: u64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| ((i * 2_654_435_761 + t * 97) % 10_007) as f32 / 10_007.0 - 0.5)
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let (rt, plan) = faulty_runtime(dir.path());
    let mut cfg = OptimConfig::new(StateTier::Nvme(dir.path().into()));
    cfg.chunk_bytes = PAGE;
    cfg.importance = Some(Importance {
        fraction: 0.25,
        every: 4,
    });
    let mut a = OffloadedAdam::on(&rt, &w0, cfg).unwrap();
    let mut mine = w0.clone();
    a.step_into(&grads(1), Some(&mut mine)).unwrap(); // a flush
    a.step_into(&grads(2), Some(&mut mine)).unwrap(); // in the window
                                                      // The second page read of the weights read back fails.
    plan.inject(IoOp::Read, 1, Fault::Errno(libc::EIO));
    assert!(a.step_into(&grads(3), Some(&mut mine)).is_err());
    let e = a.step(&grads(4)).unwrap_err();
    assert_eq!(e.kind(), crate::error::ErrorKind::Closed, "{e}");
}
