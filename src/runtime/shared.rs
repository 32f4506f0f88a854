//! What every page table of a runtime shares, and nothing above it: the
//! typed tiers, the books, background-work bookkeeping, trace recording and
//! the settings the access paths read. The engine, the reclaimer, the
//! balancer and `Runtime` are built on top and are not reachable from here,
//! so a page table (and a move running on one) only ever calls down.
#![forbid(unsafe_code)]

use std::sync::Arc;

use super::accounting::{Accounting, Counters};
use super::background::{Background, Wake};
use super::record::{TraceHost, TraceSink};
use super::tiers::{Tiers, Watermarks};
use crate::error::{Error, Result};
use crate::tier::{PageStore, Slot, Tier};

pub(crate) struct Shared {
    pub(crate) page_size: usize,
    pub(crate) tiers: Tiers,
    pub(crate) acct: Accounting,
    pub(crate) background: Background,
    /// Trace recording (off unless a recorder runs).
    pub(crate) trace: TraceSink,
    /// Access counting: 1 in 2^k, or off.
    pub(crate) sample_shift: Option<u32>,
    pub(crate) watermarks: Watermarks,
    /// Wakes background eviction (armed once it runs).
    pub(crate) reclaim: Arc<Wake>,
}

impl TraceHost for Shared {
    fn sink(&self) -> &TraceSink {
        &self.trace
    }
}

impl Shared {
    pub(crate) fn new(
        tiers: Tiers,
        sample_shift: Option<u32>,
        watermarks: Watermarks,
        page_size: usize,
    ) -> Self {
        Self {
            page_size,
            acct: Accounting::new(tiers.total_pages()),
            tiers,
            background: Background::default(),
            trace: TraceSink::default(),
            sample_shift,
            watermarks,
            reclaim: Arc::default(),
        }
    }

    /// The store of `tier`, if configured.
    #[inline]
    pub(crate) fn store(&self, tier: Tier) -> Option<&dyn PageStore> {
        self.tiers.get(tier)
    }

    pub(crate) fn page_size(&self) -> usize {
        self.page_size
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.acct.counters
    }

    pub(crate) fn capacity_report(&self) -> String {
        self.tiers.capacity_report()
    }

    /// Gives `slot` back to `tier`'s store. A store refuses only a slot
    /// that is not its own, which the page table never holds: should it
    /// happen, it is counted (`Stats::failed_frees`) and the first kept for
    /// `Runtime::check`, and the slot is never used again.
    pub(crate) fn free(&self, tier: Tier, slot: Slot) {
        let refused = match self.store(tier) {
            Some(store) => store.free(slot).err(),
            None => Some(Error::invalid(format!("the {tier} tier is not configured"))),
        };
        if let Some(e) = refused {
            Counters::add(&self.acct.counters.failed_frees, 1);
            self.background
                .keep(e.context(format!("giving a slot back to the {tier} tier")));
        }
    }

    /// A page landed in `tier`: wakes background eviction if the tier is
    /// above its high watermark.
    #[inline]
    pub(crate) fn filled(&self, tier: Tier) {
        if self.reclaim.armed() && self.tiers.above_high(tier, &self.watermarks) {
            self.reclaim.wake();
        }
    }

    /// Reserves the second slot of a move; see [`Accounting::reserve_move`].
    pub(crate) fn reserve_move(&self) -> Result<()> {
        self.acct.reserve_move(|| self.capacity_report())
    }

    /// Gives back move reservations.
    pub(crate) fn release_moves(&self, pages: u64) {
        self.acct.release_moves(pages);
    }

    /// A CUDA launch's access counts could not be read back.
    pub(crate) fn note_lost_counts(&self) {
        Counters::add(&self.acct.counters.lost_counts, 1);
    }

    /// `n` pages' data (and their slots) were lost to I/O errors.
    pub(crate) fn note_lost_pages(&self, n: u64) {
        Counters::add(&self.acct.counters.lost_pages, n);
    }

    /// Background work (`what`) failed; see [`Background::note`].
    pub(crate) fn note_background(&self, what: &str, e: Error) {
        self.background.note(what, e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceChoice;
    use crate::tier::HostConfig;

    fn shared() -> Shared {
        let page = 64 << 10;
        let tiers = Tiers::open(
            page,
            crate::runtime::tiers::DeviceSpec::new(DeviceChoice::Sim, 0),
            HostConfig::new(1 << 20, page),
            None,
            None,
            None,
        )
        .unwrap();
        Shared::new(tiers, Some(0), Watermarks::default(), page)
    }

    #[test]
    fn a_refused_free_is_counted_and_kept_for_the_next_check() {
        let (a, b) = (shared(), shared());
        let slot = a.store(Tier::Host).unwrap().alloc().unwrap();
        // A slot of another store: refused, counted, the first kept.
        b.free(Tier::Host, slot);
        let slot = a.store(Tier::Host).unwrap().alloc().unwrap();
        b.free(Tier::Nvme, slot);
        assert_eq!(Counters::get(&b.counters().failed_frees), 2);
        let kept = b.background.take().expect("the first refusal is kept");
        assert!(kept.message().contains("host tier"), "{}", kept.message());
        assert!(b.background.take().is_none(), "taken once");
        // Not a background failure, and a good free counts nothing.
        assert_eq!(b.background.count(), 0);
        let slot = a.store(Tier::Host).unwrap().alloc().unwrap();
        a.free(Tier::Host, slot);
        assert_eq!(Counters::get(&a.counters().failed_frees), 0);
        assert!(a.background.take().is_none());
    }
}
