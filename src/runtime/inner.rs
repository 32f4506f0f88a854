//! The runtime put together: what every handle of a runtime shares (the
//! page tables' shared state, the engine, the balancer and the
//! reclaimer), and the threads' rounds. `Runtime`, `Buffer` and
//! `DeviceMap` hold it; nothing below them does.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::background::BalancerThread;
use super::balance_config::{BalanceReport, BalancerConfig};
use super::balancer::Balancer;
use super::hints::{settle_read_promotions, Hints};
use super::mover::Mover;
use super::reclaim::{self, Reclaimer};
use super::shared::Shared;
use crate::error::Result;
use crate::policy::PolicyKind;

/// Fields drop in order: the threads stop before the engine they submit
/// to, the engine before the tiers its moves use.
pub(crate) struct Inner {
    reclaimer: OnceLock<Reclaimer>,
    balancer_thread: Mutex<Option<BalancerThread>>,
    /// The balancer's policy state, when one was configured.
    balancer: Mutex<Option<Balancer>>,
    /// Prefetches since the balancer's last round, for its policies'
    /// `Policy::hint`, and the moves reads started for its marks.
    pub(crate) hints: Hints,
    pub(crate) mover: Mover,
    pub(crate) shared: Arc<Shared>,
    /// The balancer's policy when none is given.
    policy: PolicyKind,
}

impl Inner {
    /// Starts the engine and, with `background_eviction` and a tier below
    /// the fastest, the reclaimer.
    pub(crate) fn start(
        shared: Arc<Shared>,
        policy: PolicyKind,
        background_eviction: bool,
    ) -> Result<Arc<Self>> {
        let inner = Arc::new(Inner {
            reclaimer: OnceLock::new(),
            balancer_thread: Mutex::new(None),
            balancer: Mutex::new(None),
            hints: Hints::default(),
            mover: Mover::start(shared.clone())?,
            shared,
            policy,
        });
        if background_eviction && inner.shared.tiers.list().len() > 1 {
            let rt = Arc::downgrade(&inner);
            let r = Reclaimer::start(inner.shared.reclaim.clone(), move || {
                if let Some(rt) = rt.upgrade() {
                    rt.shared
                        .background
                        .run("background eviction", || reclaim::pass(&rt.mover));
                }
            })?;
            let _ = inner.reclaimer.set(r);
        }
        Ok(inner)
    }

    /// A balancer with `config` (a fresh policy).
    pub(crate) fn new_balancer(&self, config: BalancerConfig) -> Result<Balancer> {
        Balancer::new(&self.shared, &self.hints, config)
    }

    /// Installs `b` (or nothing) as the balancer; the old one's marks for
    /// promotion at the next read are taken back.
    pub(crate) fn replace_balancer(&self, b: Option<Balancer>) {
        let mut slot = self.balancer.lock();
        if let Some(old) = slot.as_mut() {
            old.take_back_marks(&self.mover);
        }
        *slot = b;
    }

    /// Runs the balancer's rounds in the background, every `interval`.
    pub(crate) fn start_balancer_thread(self: &Arc<Self>, interval: Duration) -> Result<()> {
        let rt: Weak<Inner> = Arc::downgrade(self);
        let thread = BalancerThread::start(interval, move |stop: &AtomicBool| {
            let Some(rt) = rt.upgrade() else {
                return false;
            };
            if stop.load(Ordering::Acquire) {
                return false;
            }
            rt.shared.background.run("the balancer", || {
                if let Some(b) = rt.balancer.lock().as_mut() {
                    b.step(&rt.mover, &rt.hints);
                }
            });
            true
        })?;
        *self.balancer_thread.lock() = Some(thread);
        Ok(())
    }

    /// Stops the background balancer; its marks are taken back and the
    /// moves reads started are waited for and counted.
    pub(crate) fn stop_balancer(&self) {
        self.balancer_thread.lock().take();
        if let Some(b) = self.balancer.lock().as_mut() {
            b.take_back_marks(&self.mover);
        }
        self.settle_read_promotions(true);
    }

    /// One balancer round on this thread (a balancer with the default
    /// configuration is made on first use).
    pub(crate) fn balance_once(&self) -> Result<BalanceReport> {
        let mut slot = self.balancer.lock();
        if slot.is_none() {
            *slot = Some(self.new_balancer(BalancerConfig {
                policy: self.policy,
                ..Default::default()
            })?);
        }
        Ok(slot
            .as_mut()
            .expect("made above")
            .step(&self.mover, &self.hints))
    }

    /// Settles the moves reads started (see `hints.rs`).
    pub(crate) fn settle_read_promotions(&self, wait: bool) {
        settle_read_promotions(&self.shared, &self.hints, wait);
    }

    /// Stops background eviction (after its round, if one runs).
    pub(crate) fn stop_reclaimer(&self) {
        if let Some(r) = self.reclaimer.get() {
            r.stop();
        }
    }
}
