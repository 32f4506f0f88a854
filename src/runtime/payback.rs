//! A buffer's payback: whether the pages promoted into the fastest tier
//! (by anyone: the balancer, a prefetch, a pin, a read that takes a mark,
//! a launch's staging) were accessed there before they left. When most of a
//! buffer's recent promotions did not pay (under 40% of at least
//! [`PAYBACK_WINDOW`] settled), its pages are promoted only once they show
//! reuse across rounds; above 60% (or after [`PAYBACK_PROBE`] rounds with
//! too few promotions to tell) the buffer is promoted freely again.
#![forbid(unsafe_code)]

/// Promotions settled (left the fastest tier) before a buffer's payback
/// is judged.
pub(crate) const PAYBACK_WINDOW: u64 = 16;
/// Rounds a buffer held to reused pages waits, with too few promotions
/// settling to judge, before it is promoted freely again (a probe).
pub(crate) const PAYBACK_PROBE: u32 = 32;

/// A buffer's recent payback: promotions settled since its last
/// judgement, and the judgement.
#[derive(Debug, Default)]
pub(crate) struct Payback {
    /// The buffer's counts at the last round.
    seen: (u64, u64),
    /// Settled since the last judgement: paid, unpaid.
    window: (u64, u64),
    /// Only pages showing reuse are promoted.
    pub(crate) strict: bool,
    /// Rounds strict without a judgement.
    quiet: u32,
}

impl Payback {
    /// A buffer's payback as a balancer first sees it: what settled
    /// before (under another balancer, an earlier trial) is not judged.
    pub(crate) fn starting_at(paid: u64, unpaid: u64) -> Self {
        Self {
            seen: (paid, unpaid),
            ..Self::default()
        }
    }

    /// Takes in the buffer's counts now and judges when enough settled.
    /// (The counts only grow; counts below the last seen, which a buffer
    /// of another number would give, count as nothing settled.)
    pub(crate) fn update(&mut self, paid: u64, unpaid: u64) {
        let (dp, du) = (
            paid.saturating_sub(self.seen.0),
            unpaid.saturating_sub(self.seen.1),
        );
        self.seen = (paid, unpaid);
        self.window.0 += dp;
        self.window.1 += du;
        let settled = self.window.0 + self.window.1;
        if settled >= PAYBACK_WINDOW {
            let ratio = self.window.0 as f64 / settled as f64;
            if ratio < 0.4 {
                self.strict = true;
            } else if ratio > 0.6 {
                self.strict = false;
            }
            self.window = (0, 0);
            self.quiet = 0;
        } else if self.strict {
            self.quiet += 1;
            if self.quiet >= PAYBACK_PROBE {
                self.strict = false;
                self.quiet = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Payback, PAYBACK_PROBE, PAYBACK_WINDOW};

    #[test]
    fn what_settled_before_is_not_judged() {
        let mut g = Payback::starting_at(0, 1000);
        g.update(0, 1000);
        assert!(!g.strict, "a thousand unpaid before it: no judgement");
        g.update(0, 1000 + PAYBACK_WINDOW);
        assert!(g.strict, "its own unpaid are judged");
    }

    #[test]
    fn a_buffer_whose_promotions_do_not_pay_is_held_to_reused_pages_until_they_do() {
        let mut g = Payback::default();
        // Too few settled to judge: free.
        g.update(1, 2);
        assert!(!g.strict);
        // A window of mostly unpaid promotions: strict.
        g.update(1, 2 + PAYBACK_WINDOW);
        assert!(g.strict);
        // In between 40% and 60%: the judgement stands.
        g.update(
            1 + PAYBACK_WINDOW / 2,
            2 + PAYBACK_WINDOW + PAYBACK_WINDOW / 2,
        );
        assert!(g.strict);
        // Paying again: free.
        g.update(
            1 + 2 * PAYBACK_WINDOW,
            2 + PAYBACK_WINDOW + PAYBACK_WINDOW / 2,
        );
        assert!(!g.strict);
        // Strict, then quiet for the probe's rounds: free again to look.
        let (p, u) = g.seen;
        g.update(p, u + PAYBACK_WINDOW);
        assert!(g.strict);
        for _ in 0..PAYBACK_PROBE - 1 {
            g.update(p, u + PAYBACK_WINDOW);
        }
        assert!(g.strict);
        g.update(p, u + PAYBACK_WINDOW);
        assert!(!g.strict, "probed");
    }
}
