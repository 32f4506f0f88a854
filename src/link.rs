//! Links between tiers: a bandwidth/latency model, a throttle that paces
//! transfers to a model (emulated CXL), and counters of what crossed a link
//! (bytes, operations, wall time, modelled time).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A bandwidth and latency model for a link.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    /// Sustained bandwidth, bytes per second.
    pub bandwidth: f64,
    /// Latency added to every transfer, nanoseconds.
    pub latency_ns: u64,
}

impl LinkModel {
    /// Checks the model is usable: at least 1 MB/s (a slower "link" would
    /// spin for seconds per page) and at most 1 ms of latency.
    pub fn check(&self) -> Result<()> {
        if !self.bandwidth.is_finite() {
            return Err(Error::invalid(format!(
                "link bandwidth {} bytes/s is not a finite number",
                self.bandwidth
            )));
        }
        if self.bandwidth < 1e6 {
            return Err(Error::invalid(format!(
                "link bandwidth {} bytes/s is below 1 MB/s",
                self.bandwidth
            )));
        }
        if self.latency_ns > 1_000_000 {
            return Err(Error::invalid(format!(
                "link latency {} ns is above 1 ms",
                self.latency_ns
            )));
        }
        Ok(())
    }

    /// Modelled time of one transfer of `bytes`.
    pub fn time(&self, bytes: usize) -> Duration {
        Duration::from_nanos(
            ((bytes as f64 / self.bandwidth * 1e9) as u64).saturating_add(self.latency_ns),
        )
    }
}

/// What crossed a link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LinkStats {
    /// Bytes transferred.
    pub bytes: u64,
    /// Transfers.
    pub ops: u64,
    /// Wall time spent in transfers, seconds.
    pub wall_seconds: f64,
    /// Time the link model assigns to them, seconds (0 for real links).
    pub modelled_seconds: f64,
}

/// Thread-safe counters behind [`LinkStats`].
#[derive(Debug, Default)]
pub struct LinkCounter {
    bytes: AtomicU64,
    ops: AtomicU64,
    wall_ns: AtomicU64,
    modelled_ns: AtomicU64,
}

impl LinkCounter {
    /// Records one transfer.
    pub fn record(&self, bytes: usize, wall: Duration, modelled: Duration) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.wall_ns
            .fetch_add(wall.as_nanos() as u64, Ordering::Relaxed);
        self.modelled_ns
            .fetch_add(modelled.as_nanos() as u64, Ordering::Relaxed);
    }

    /// A snapshot.
    pub fn stats(&self) -> LinkStats {
        LinkStats {
            bytes: self.bytes.load(Ordering::Relaxed),
            ops: self.ops.load(Ordering::Relaxed),
            wall_seconds: self.wall_ns.load(Ordering::Relaxed) as f64 / 1e9,
            modelled_seconds: self.modelled_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

/// Paces transfers on an emulated link: each transfer reserves
/// `bytes / bandwidth` on a shared timeline (so concurrent transfers share
/// the cap) and completes `latency` after its reservation ends.
#[derive(Debug)]
pub struct Throttle {
    model: LinkModel,
    epoch: Instant,
    /// Nanoseconds since `epoch` at which the link is next free.
    next_free_ns: AtomicU64,
    /// Total modelled transfer time, nanoseconds.
    modelled_ns: AtomicU64,
}

impl Throttle {
    /// A throttle for `model`; an error for a model that
    /// [`LinkModel::check`] refuses (a zero or NaN bandwidth would pace a
    /// transfer forever).
    pub fn new(model: LinkModel) -> Result<Self> {
        model.check()?;
        Ok(Self {
            model,
            epoch: Instant::now(),
            next_free_ns: AtomicU64::new(0),
            modelled_ns: AtomicU64::new(0),
        })
    }

    /// The link model.
    pub fn model(&self) -> LinkModel {
        self.model
    }

    /// Total modelled time of all transfers so far (bandwidth share plus
    /// latency of each).
    pub fn modelled(&self) -> Duration {
        Duration::from_nanos(self.modelled_ns.load(Ordering::Relaxed))
    }

    /// Runs `copy` (which moves `bytes`) and returns once the modelled link
    /// would have delivered it.
    pub fn transfer<T>(&self, bytes: usize, copy: impl FnOnce() -> T) -> T {
        // Saturating: a wrapped sum would silently turn pacing off.
        let duration_ns = (bytes as f64 / self.model.bandwidth * 1e9) as u64;
        let now = self.epoch.elapsed().as_nanos() as u64;
        let mut start = now;
        let _ = self
            .next_free_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |free| {
                start = free.max(now);
                Some(start.saturating_add(duration_ns))
            });
        let cost = duration_ns.saturating_add(self.model.latency_ns);
        self.modelled_ns.fetch_add(cost, Ordering::Relaxed);
        let result = copy();
        let done = Duration::from_nanos(start.saturating_add(cost));
        // Spin rather than sleep: the delays are micro- to nanoseconds,
        // far below the scheduler's sleep granularity.
        while self.epoch.elapsed() < done {
            std::hint::spin_loop();
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_time_and_bounds() {
        let m = LinkModel {
            bandwidth: 25e9,
            latency_ns: 5_000,
        };
        assert_eq!(m.time(25_000), Duration::from_nanos(6_000));
        assert!(m.check().is_ok());
        assert!(LinkModel {
            bandwidth: 0.0,
            ..m
        }
        .check()
        .is_err());
        assert!(LinkModel {
            latency_ns: u64::MAX,
            ..m
        }
        .check()
        .is_err());
    }

    #[test]
    fn a_throttle_refuses_a_model_that_would_pace_forever() {
        for bandwidth in [0.0, f64::NAN, -1.0] {
            let e = Throttle::new(LinkModel {
                bandwidth,
                latency_ns: 0,
            })
            .unwrap_err();
            assert!(e.message().contains("bandwidth"), "{e}");
        }
        let t = Throttle::new(LinkModel {
            bandwidth: 1e9,
            latency_ns: 0,
        })
        .unwrap();
        assert_eq!(t.transfer(1000, || 7), 7);
        assert_eq!(t.modelled(), Duration::from_nanos(1000));
    }

    #[test]
    fn counters_add_up() {
        let c = LinkCounter::default();
        c.record(100, Duration::from_micros(1), Duration::from_micros(3));
        c.record(50, Duration::from_micros(1), Duration::from_micros(3));
        let s = c.stats();
        assert_eq!((s.bytes, s.ops), (150, 2));
        assert!((s.modelled_seconds - 6e-6).abs() < 1e-12);
    }
}
