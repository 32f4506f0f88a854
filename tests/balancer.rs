//! The balancer: hot pages are promoted into device memory, one-pass scans
//! do not push them out, the rate limit holds, and the background thread
//! does the same as explicit rounds.

use std::time::{Duration, Instant};

use strata::device::DeviceChoice;
use strata::policy::PolicyKind;
use strata::runtime::{BalancerConfig, Placement};
use strata::{ErrorKind, Runtime, Tier};

const PAGE: usize = 16 << 10;

fn runtime() -> Runtime {
    runtime_with_device(8)
}

/// A simulated device of `pages` pages over 64 of DRAM, background
/// eviction off.
fn runtime_with_device(pages: u64) -> Runtime {
    Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, pages * PAGE as u64)
        .host(64 * PAGE as u64)
        .background_eviction(false)
        .build()
        .unwrap()
}

/// No device: 8 pages of DRAM, 16 of emulated CXL, `nvme_pages` of NVMe in
/// `dir`, background eviction off.
fn dram_cxl_nvme(dir: &std::path::Path, nvme_pages: u64) -> Runtime {
    use strata::tier::{CxlConfig, CxlMode, NvmeConfig};
    Runtime::builder()
        .page_size(PAGE)
        .host(8 * PAGE as u64)
        .cxl(CxlConfig::new(CxlMode::Emulated, 16 * PAGE as u64, PAGE))
        .nvme(NvmeConfig::new(dir, nvme_pages * PAGE as u64, PAGE))
        .background_eviction(false)
        .build()
        .unwrap()
}

/// No device: `dram_pages` of DRAM over 64 pages of NVMe in `dir`,
/// background eviction off.
fn dram_nvme(dir: &std::path::Path, dram_pages: u64) -> Runtime {
    use strata::tier::NvmeConfig;
    Runtime::builder()
        .page_size(PAGE)
        .host(dram_pages * PAGE as u64)
        .nvme(NvmeConfig::new(dir, 64 * PAGE as u64, PAGE))
        .background_eviction(false)
        .build()
        .unwrap()
}

fn touch(b: &strata::Buffer, pages: impl Iterator<Item = usize>, times: usize) {
    let mut out = [0u8; 8];
    for p in pages {
        for _ in 0..times {
            b.read((p * PAGE) as u64, &mut out).unwrap();
        }
    }
}

fn on_device(b: &strata::Buffer, pages: std::ops::Range<usize>) -> usize {
    pages
        .filter(|&p| b.tier_of(p).unwrap() == Some(Tier::Device))
        .count()
}

#[test]
fn hot_pages_are_promoted_and_scans_do_not_evict_them() {
    let rt = runtime();
    let b = rt
        .alloc_with(48 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    b.write(0, &vec![3; 48 * PAGE]).unwrap();
    assert_eq!(on_device(&b, 0..48), 0);
    rt.balance_once().unwrap(); // the writes, folded
    for _ in 0..4 {
        touch(&b, 0..4, 10);
        rt.balance_once().unwrap();
    }
    assert_eq!(on_device(&b, 0..4), 4, "the hot set is on the device");
    let promoted = rt.stats().promotions;
    assert!(promoted >= 4);
    // The engine ran the moves at balance priority: their CPU time is
    // counted, and is no more than the lanes' wall time running them.
    let s = rt.stats();
    let balance = s.engine.iter().find(|p| p.priority == "balance").unwrap();
    assert!(balance.batches >= 1, "{balance:?}");
    assert!(
        balance.cpu_seconds > 0.0 && balance.cpu_seconds <= balance.busy_seconds + 1e-6,
        "{balance:?}"
    );
    // One-pass scans over the rest, while the hot set stays hot.
    for round in 0..5 {
        touch(&b, 0..4, 10);
        touch(&b, 8 + round * 8..16 + round * 8, 1);
        rt.balance_once().unwrap();
    }
    assert_eq!(on_device(&b, 0..4), 4, "scans did not push the hot set out");
    let s = rt.stats();
    assert!(
        s.tiers[0].used_pages as f64 <= 8.0 * 0.95,
        "the high watermark holds: {:?}",
        s.tiers
    );
    // Nothing lost on the way.
    let mut all = vec![0; 48 * PAGE];
    b.read(0, &mut all).unwrap();
    assert!(all.iter().all(|&x| x == 3));
}

#[test]
fn the_rate_limit_defers_promotions() {
    let rt = runtime();
    let b = rt
        .alloc_with(16 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    b.write(0, &vec![1; 16 * PAGE]).unwrap();
    let start = Instant::now();
    rt.start_balancer(
        // Rounds only when asked; one page a second.
        BalancerConfig::default()
            .with_interval(Duration::from_secs(3600))
            .with_rate_limit(Some(PAGE as u64)),
    )
    .unwrap();
    touch(&b, 0..6, 10);
    let r = rt.balance_once().unwrap();
    // The budget is a page a second of the time since the balancer
    // started: at most one page, and one more for each second a loaded
    // machine took to get here.
    let afforded = 1 + start.elapsed().as_secs();
    assert!(r.promotions <= afforded, "{r:?}, {afforded} afforded");
    assert!(r.promotions + r.deferred >= 6, "{r:?}");
    if afforded == 1 {
        assert!(r.deferred >= 5, "{r:?}");
    }
    rt.stop_balancer();
}

#[test]
fn the_background_balancer_promotes_what_is_hot() {
    let rt = runtime();
    let b = rt
        .alloc_with(16 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    b.write(0, &vec![1; 16 * PAGE]).unwrap();
    rt.start_balancer(
        BalancerConfig::default()
            .with_interval(Duration::from_millis(5))
            .with_policy(PolicyKind::Lfu),
    )
    .unwrap();
    // Bounded wait for the background rounds.
    for _ in 0..400 {
        touch(&b, 2..5, 5);
        if on_device(&b, 2..5) == 3 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    rt.stop_balancer();
    assert_eq!(on_device(&b, 2..5), 3, "{:?}", rt.stats());
}

#[test]
fn bad_configurations_are_refused() {
    let rt = runtime();
    let e = rt
        .start_balancer(BalancerConfig::default().with_policy(PolicyKind::Belady))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = rt
        .start_balancer(BalancerConfig::default().with_decay(0.0))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let host_only = Runtime::builder().page_size(PAGE).build().unwrap();
    assert_eq!(
        host_only.balance_once().unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

/// Without a device tier DRAM is the fastest tier: the balancer promotes
/// hot pages into it from CXL and NVMe and makes room by demoting the
/// cold, as it does for device memory (what TPP and Memtis do for CXL in
/// the kernel).
#[test]
fn without_a_device_dram_is_the_tier_balanced() {
    let dir = tempfile::tempdir().unwrap();
    let rt = dram_cxl_nvme(dir.path(), 64);
    let b = rt.alloc(40 * PAGE as u64).unwrap();
    b.write(0, &vec![5; 40 * PAGE]).unwrap();
    // The first pages filled DRAM, then CXL; the hot set is in NVMe.
    let hot = 32..36;
    assert!(hot
        .clone()
        .all(|p| b.tier_of(p).unwrap() == Some(Tier::Nvme)));
    rt.balance_once().unwrap(); // the writes, folded
    for _ in 0..4 {
        touch(&b, hot.clone(), 10);
        rt.balance_once().unwrap();
    }
    let in_dram = hot
        .clone()
        .filter(|&p| b.tier_of(p).unwrap() == Some(Tier::Host))
        .count();
    assert_eq!(in_dram, 4, "the hot set is in DRAM");
    let s = rt.stats();
    assert!(s.promotions >= 4 && s.demotions >= 1, "{s:?}");
    assert!(s.tiers[0].used_pages as f64 <= 8.0 * 0.95, "{:?}", s.tiers);
    let mut all = vec![0; 40 * PAGE];
    b.read(0, &mut all).unwrap();
    assert!(all.iter().all(|&x| x == 5));
    assert_eq!(rt.check().map_err(|e| e.to_string()), Ok(()));
}

#[test]
fn counted_touches_weigh_as_reads() {
    // A caller that reads a page once for many uses (a batch of embedding
    // lookups) reports the rest with `touch`: the balancer promotes those
    // pages over pages read more often than once but fewer times in all.
    let rt = runtime();
    let b = rt
        .alloc_with(48 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    b.write(0, &vec![5; 48 * PAGE]).unwrap();
    rt.balance_once().unwrap();
    for _ in 0..4 {
        touch(&b, 10..16, 1);
        for p in 10..16 {
            b.touch(p, 19).unwrap();
        }
        touch(&b, 20..40, 3);
        rt.balance_once().unwrap();
    }
    assert_eq!(
        on_device(&b, 10..16),
        6,
        "the pages touched most are on the device"
    );
    assert_eq!(
        b.touch(48, 1).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

/// DRAM, CXL and NVMe: the hot set goes into DRAM, the warm set — more
/// than DRAM holds, read less often — comes up from NVMe into CXL (the
/// second level's job: nothing promoted NVMe pages into CXL before), and
/// the cold pages CXL held at the start go down to NVMe to make room.
#[test]
fn every_adjacent_pair_is_balanced() {
    let dir = tempfile::tempdir().unwrap();
    let rt = dram_cxl_nvme(dir.path(), 128);
    let b = rt.alloc(64 * PAGE as u64).unwrap();
    let content: Vec<u8> = (0..64 * PAGE).map(|i| (i / PAGE) as u8).collect();
    b.write(0, &content).unwrap();
    // Pages 0..8 filled DRAM, 8..24 CXL; the rest are in NVMe.
    let (hot, warm) = (40..44, 44..56);
    assert!(hot
        .clone()
        .chain(warm.clone())
        .all(|p| b.tier_of(p).unwrap() == Some(Tier::Nvme)));
    rt.configure_balancer(BalancerConfig::default().with_lower_levels(true))
        .unwrap();
    rt.balance_once().unwrap(); // the writes, folded
    let mut below = 0;
    for _ in 0..6 {
        touch(&b, hot.clone(), 20);
        touch(&b, warm.clone(), 2);
        below += rt.balance_once().unwrap().promotions_below;
    }
    let count = |r: std::ops::Range<usize>, t: Tier| {
        r.filter(|&p| b.tier_of(p).unwrap() == Some(t)).count()
    };
    assert_eq!(count(hot.clone(), Tier::Host), 4, "the hot set is in DRAM");
    // DRAM's policy holds the hot set and the warm pages that fit beside
    // it (7 slots below the high watermark); the rest came up into CXL.
    let (warm_dram, warm_cxl) = (
        count(warm.clone(), Tier::Host),
        count(warm.clone(), Tier::Cxl),
    );
    assert_eq!(
        warm_dram + warm_cxl,
        12,
        "the warm set left NVMe: {warm_dram} in DRAM, {warm_cxl} in CXL"
    );
    assert!(
        warm_cxl >= 8,
        "the warm set came up into CXL: {warm_cxl} of 12"
    );
    assert!(
        below >= warm_cxl as u64,
        "promotions into CXL counted: {below}"
    );
    let s = rt.stats();
    for t in &s.tiers {
        let cap = (t.used_pages + t.free_pages) as f64;
        assert!(
            t.tier == Tier::Nvme || t.used_pages as f64 <= cap * 0.95,
            "{:?}",
            s.tiers
        );
    }
    let mut all = vec![0; 64 * PAGE];
    b.read(0, &mut all).unwrap();
    assert_eq!(all, content, "every page reads as written after the moves");
    assert_eq!(rt.check().map_err(|e| e.to_string()), Ok(()));
}

/// A link's rate limit holds the balancer's moves over it.
#[test]
fn a_link_rate_limit_defers_moves_over_that_link() {
    let dir = tempfile::tempdir().unwrap();
    let rt = dram_cxl_nvme(dir.path(), 128);
    let b = rt.alloc(64 * PAGE as u64).unwrap();
    b.write(0, &vec![1; 64 * PAGE]).unwrap();
    // A page a second over NVMe→DRAM and NVMe→CXL: after 1.1 s the
    // budgets afford one page each (they top up over 4 intervals at most).
    let config = BalancerConfig::default()
        .with_lower_levels(true)
        .with_interval(Duration::from_secs(1))
        .with_link_rate_limit(Tier::Nvme, Tier::Host, Some(PAGE as u64))
        .with_link_rate_limit(Tier::Nvme, Tier::Cxl, Some(PAGE as u64));
    rt.configure_balancer(config).unwrap();
    let before = Instant::now();
    rt.balance_once().unwrap();
    let after = Instant::now();
    std::thread::sleep(Duration::from_millis(1100));
    touch(&b, 44..56, 2);
    let r = rt.balance_once().unwrap();
    // The budgets top up between the two rounds' starts: more than 1.1 s,
    // and less than the time from before the first to after the second,
    // which a loaded machine may stretch past 2 s (a page a second each).
    let most = before.elapsed().as_secs().min(4);
    assert!(after.elapsed() >= Duration::from_millis(1100));
    // Into DRAM the page is marked for its next read (the default), which
    // the limit bounds as it bounds a move.
    let (into_dram, below) = (r.promotions + r.marked, r.promotions_below);
    if most == 1 {
        assert_eq!((into_dram, below), (1, 1), "{r:?}");
        assert!(r.deferred >= 10, "{r:?}");
    } else {
        assert!(
            (1..=most).contains(&into_dram) && (1..=most).contains(&below),
            "{r:?}, at most {most} a link"
        );
    }
    // Unlimited, the same round promotes them all.
    rt.configure_balancer(BalancerConfig::default().with_lower_levels(true))
        .unwrap();
    rt.balance_once().unwrap();
    touch(&b, 44..56, 2);
    let r = rt.balance_once().unwrap();
    assert!(r.promotions + r.marked + r.promotions_below >= 10, "{r:?}");
}

/// Promotions from NVMe into DRAM wait for the page's next read (the
/// default, DRAM right over NVMe): a round marks the hot pages and moves
/// nothing from disk; the next read of a marked page is answered from NVMe
/// and starts its move; a page the policy lets go before it is read again
/// never moves. In the background instead (asked for, or with CXL between
/// DRAM and NVMe), the same round moves the pages itself.
#[test]
fn promotions_from_nvme_wait_for_the_next_read() {
    for (on_read, cxl) in [(true, false), (false, false), (true, true)] {
        let dir = tempfile::tempdir().unwrap();
        let rt = if cxl {
            dram_cxl_nvme(dir.path(), 64)
        } else {
            dram_nvme(dir.path(), 24)
        };
        let b = rt.alloc(40 * PAGE as u64).unwrap();
        let content: Vec<u8> = (0..40 * PAGE).map(|i| (i / PAGE) as u8 ^ 0x5a).collect();
        b.write(0, &content).unwrap();
        rt.configure_balancer(BalancerConfig::default().with_promote_on_read(on_read))
            .unwrap();
        rt.balance_once().unwrap(); // the writes, folded
        let hot = 32..36;
        touch(&b, hot.clone(), 10);
        let r = rt.balance_once().unwrap();
        let in_dram = |r: std::ops::Range<usize>| {
            r.filter(|&p| b.tier_of(p).unwrap() == Some(Tier::Host))
                .count()
        };
        if !on_read || cxl {
            assert_eq!((r.promotions, r.marked), (4, 0), "{r:?}");
            assert_eq!(in_dram(hot.clone()), 4);
            continue;
        }
        assert_eq!((r.promotions, r.marked), (0, 4), "{r:?}");
        assert_eq!(in_dram(hot.clone()), 0, "marked, not moved");
        // Reads of three of them: right bytes, and their moves start.
        let mut out = vec![0u8; 100];
        for p in 32..35 {
            b.read((p * PAGE + 7) as u64, &mut out).unwrap();
            assert_eq!(out, content[p * PAGE + 7..p * PAGE + 107]);
        }
        // The next round waits for those moves, and counts them.
        let r = rt.balance_once().unwrap();
        assert_eq!(in_dram(32..35), 3, "{r:?}");
        assert_eq!(rt.stats().promotions_on_read, 3);
        // A whole-page read of a marked page moves it first, then reads it
        // from DRAM.
        touch(&b, 28..30, 30);
        let r = rt.balance_once().unwrap();
        assert!(r.marked >= 2, "{r:?}");
        let mut page = vec![0u8; PAGE];
        b.read((28 * PAGE) as u64, &mut page).unwrap();
        assert_eq!(page, content[28 * PAGE..29 * PAGE]);
        assert_eq!(
            b.tier_of(28).unwrap(),
            Some(Tier::Host),
            "moved before the read"
        );
        assert_eq!(rt.stats().promotions_on_read, 4);
        // Stopping the balancer takes its other marks back: page 29 stays.
        rt.stop_balancer();
        b.read((29 * PAGE) as u64, &mut page).unwrap();
        rt.balance_once().unwrap();
        assert_eq!(b.tier_of(29).unwrap(), Some(Tier::Nvme));
        assert_eq!(rt.stats().promotions_on_read, 4);
        assert_eq!(b.tier_of(35).unwrap(), Some(Tier::Nvme), "never read again");
        // Cold now, and the policy takes in a new hot set: page 35's mark
        // is taken back once the policy lets it go, so reading it later
        // moves nothing.
        for _ in 0..6 {
            touch(&b, 0..23, 20);
            rt.balance_once().unwrap();
            touch(&b, 0..23, 20);
        }
        rt.balance_once().unwrap();
        let before = rt.stats().promotions_on_read;
        b.read((35 * PAGE) as u64, &mut out).unwrap();
        rt.balance_once().unwrap();
        assert_eq!(
            (rt.stats().promotions_on_read, b.tier_of(35).unwrap()),
            (before, Some(Tier::Nvme)),
            "a page the policy let go is not promoted by a later read"
        );
        let mut all = vec![0; 40 * PAGE];
        b.read(0, &mut all).unwrap();
        assert_eq!(all, content);
        assert_eq!(rt.check().map_err(|e| e.to_string()), Ok(()));
    }
}

/// A prefetch reaches the balancer's policy as a hint (`Policy::hint`): the
/// lookahead policy holds a prefetched page until its use, so a round that
/// needs room in the device tier evicts one of the policy's own pages
/// rather than the prefetched one; without the hint the prefetched page,
/// a stranger to the policy, is the first to go.
#[test]
fn prefetches_reach_the_policy_as_hints() {
    let run = |policy: PolicyKind| {
        let rt = runtime();
        let b = rt
            .alloc_with(16 * PAGE as u64, Placement::Prefer(Tier::Host))
            .unwrap();
        b.write(0, &vec![1; 16 * PAGE]).unwrap();
        rt.configure_balancer(BalancerConfig::default().with_policy(policy))
            .unwrap();
        rt.balance_once().unwrap(); // the writes, folded
                                    // The device holds 8 pages, the policy 7 (the high watermark).
        for _ in 0..2 {
            touch(&b, 0..6, 10);
            rt.balance_once().unwrap();
        }
        assert_eq!(on_device(&b, 0..6), 6);
        b.prefetch((10 * PAGE) as u64..(11 * PAGE) as u64, Tier::Device)
            .wait()
            .unwrap();
        // Two new hot pages: the policy needs one slot beyond its seven.
        touch(&b, 0..6, 10);
        touch(&b, 6..8, 10);
        rt.balance_once().unwrap();
        b.tier_of(10).unwrap() == Some(Tier::Device)
    };
    assert!(run(PolicyKind::Lookahead), "the hinted page stayed");
    assert!(
        !run(PolicyKind::Lru),
        "without hints it is the first to leave"
    );
}

/// A page the policy lets go that has a clean copy below stays in DRAM
/// while the tier has room: its reads stay hits and its later demotion
/// writes nothing. One written since its promotion leaves in the round,
/// its write-back in the background. Marks not read yet hold no room.
#[test]
fn a_clean_page_the_policy_lets_go_stays_until_its_room_is_needed() {
    for dirty in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        // 8 pages of DRAM: the LRU policy holds 7 (the high watermark).
        let rt = dram_nvme(dir.path(), 8);
        let b = rt.alloc(24 * PAGE as u64).unwrap();
        let content: Vec<u8> = (0..24 * PAGE).map(|i| (i / PAGE) as u8 ^ 0x3c).collect();
        b.write(0, &content).unwrap();
        rt.configure_balancer(BalancerConfig::default().with_policy(PolicyKind::Lru))
            .unwrap();
        rt.balance_once().unwrap(); // the writes, folded
        b.evict(0..b.len(), Tier::Nvme).unwrap();
        let in_dram = |r: std::ops::Range<usize>| {
            r.filter(|&p| b.tier_of(p).unwrap() == Some(Tier::Host))
                .count()
        };
        // Pages 0..4 hot: marked, then read, and so moved in.
        touch(&b, 0..4, 10);
        assert_eq!(rt.balance_once().unwrap().marked, 4);
        touch(&b, 0..4, 1);
        rt.balance_once().unwrap();
        assert_eq!(in_dram(0..4), 4);
        // 4..7 hot next (the policy holds 0..7, its 7 pages); the dirty
        // run rewrites 0..4 first, so they have no clean copy left.
        if dirty {
            b.write(0, &content[..4 * PAGE]).unwrap();
        }
        touch(&b, 4..7, 10);
        assert_eq!(rt.balance_once().unwrap().marked, 3);
        // 7..10 hot: the LRU policy takes them in and lets 0..3 go. Room
        // is not short (4 pages used, 3 marks), so the clean ones stay.
        let written = rt.nvme_stats().map(|s| s.bytes_written).unwrap_or(0);
        touch(&b, 7..10, 10);
        let r = rt.balance_once().unwrap();
        assert_eq!(r.marked, 3, "{r:?}");
        if dirty {
            assert_eq!((r.demotions, in_dram(0..4)), (3, 1), "{r:?}");
            assert!(rt.nvme_stats().unwrap().bytes_written >= written + 3 * PAGE as u64);
        } else {
            assert_eq!((r.demotions, in_dram(0..4)), (0, 4), "{r:?}");
        }
        // The marked pages read: their moves make room through the engine
        // (a move at prefetch priority gets one turn of the clock hand; one
        // that finds none is read in place, and the policy, which holds the
        // page, marks it again). Within a few rounds of use all six are in.
        for _ in 0..3 {
            touch(&b, 4..10, 1);
            rt.balance_once().unwrap();
            if in_dram(4..10) == 6 {
                break;
            }
            touch(&b, 4..10, 10);
            rt.balance_once().unwrap();
        }
        assert_eq!(in_dram(4..10), 6);
        if !dirty {
            assert_eq!(
                rt.nvme_stats().unwrap().bytes_written,
                written,
                "clean pages leave with no write"
            );
        }
        let mut all = vec![0; 24 * PAGE];
        b.read(0, &mut all).unwrap();
        assert_eq!(all, content);
        assert_eq!(rt.check().map_err(|e| e.to_string()), Ok(()));
    }
}

/// A buffer's number is reused once 2^16 others have been freed after it:
/// a buffer that gets the number of one the balancer judged starts afresh
/// (its promotions judged on their own, none of the old buffer's pages
/// held or marked for it).
#[test]
fn a_buffer_with_a_reused_number_is_judged_afresh() {
    let rt = runtime();
    rt.configure_balancer(BalancerConfig::default()).unwrap();
    let a = rt
        .alloc_with(2 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    a.write(0, &vec![1u8; 2 * PAGE]).unwrap();
    // Promotions that leave without an access: unpaid.
    for _ in 0..20 {
        a.prefetch(0..PAGE as u64, Tier::Device).wait().unwrap();
        a.evict(0..PAGE as u64, Tier::Host).unwrap();
    }
    assert!(rt.stats().promotions_unpaid >= 20);
    rt.balance_once().unwrap();
    drop(a);
    // The others come and go between two rounds; the next takes a's number.
    for _ in 0..(1usize << 16) - 1 {
        drop(rt.alloc(PAGE as u64).unwrap());
    }
    let b = rt
        .alloc_with(PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    b.write(0, &[2u8; PAGE]).unwrap();
    touch(&b, 0..1, 10);
    let r = rt.balance_once().unwrap();
    assert_eq!(r.held_back, 0, "b judged by a's promotions: {r:?}");
    assert_eq!(on_device(&b, 0..1), 1, "{r:?}");
    let mut out = vec![0u8; PAGE];
    b.read(0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 2));
}

/// A page the balancer marked for promotion into DRAM moves at its next
/// read even when DRAM filled up in between: the read makes room for it,
/// as a pin would, and the mark is not lost.
#[test]
fn a_marked_page_read_after_dram_filled_still_moves() {
    let dir = tempfile::tempdir().unwrap();
    let rt = dram_nvme(dir.path(), 4);
    rt.configure_balancer(BalancerConfig::default()).unwrap();
    let a = rt
        .alloc_with(3 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    a.write(0, &vec![1u8; 3 * PAGE]).unwrap();
    let b = rt
        .alloc_with(PAGE as u64, Placement::Prefer(Tier::Nvme))
        .unwrap();
    b.write(0, &vec![2u8; PAGE]).unwrap();
    b.touch(0, 10).unwrap();
    let r = rt.balance_once().unwrap();
    assert_eq!(
        (r.marked, b.tier_of(0).unwrap()),
        (1, Some(Tier::Nvme)),
        "{r:?}"
    );
    // Other first writes fill DRAM before the marked page is read.
    let c = rt
        .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    let mut i = 0;
    while rt.stats().tiers[0].free_pages > 0 {
        c.write((i * PAGE) as u64, &vec![3u8; PAGE]).unwrap();
        i += 1;
    }
    let mut whole = vec![0u8; PAGE];
    b.read(0, &mut whole).unwrap();
    assert!(whole.iter().all(|&x| x == 2));
    assert_eq!(b.tier_of(0).unwrap(), Some(Tier::Host));
    assert_eq!(rt.stats().promotions_on_read, 1);
    // Everything else still reads as written.
    let mut back = vec![0u8; 3 * PAGE];
    a.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&x| x == 1));
    let mut back = vec![0u8; i * PAGE];
    c.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&x| x == 3));
}

/// Balancing below the fastest tier takes the room a tier's clean copies
/// hold (copies of pages promoted above it) before it demotes a page that
/// lives there: dropping a copy costs no I/O and loses nothing.
#[test]
fn lower_levels_take_clean_copies_before_demoting_residents() {
    use strata::tier::NvmeConfig;
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::builder()
        .page_size(PAGE)
        .device(DeviceChoice::Sim, 4 * PAGE as u64)
        .host(8 * PAGE as u64)
        .nvme(NvmeConfig::new(dir.path(), 64 * PAGE as u64, PAGE))
        .background_eviction(false)
        .build()
        .unwrap();
    // x takes 6 of DRAM's 8 pages; 2 then go up into device memory, each
    // keeping its DRAM slot as a clean copy.
    let x = rt
        .alloc_with(6 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    x.write(0, &vec![1u8; 6 * PAGE]).unwrap();
    x.prefetch(0..2 * PAGE as u64, Tier::Device).wait().unwrap();
    let s = rt.stats();
    assert_eq!(on_device(&x, 0..2), 2);
    assert_eq!((s.tiers[1].used_pages, s.tiers[1].clean_copies), (6, 2));
    let y = rt
        .alloc_with(4 * PAGE as u64, Placement::Prefer(Tier::Nvme))
        .unwrap();
    y.write(0, &vec![2u8; 4 * PAGE]).unwrap();
    rt.configure_balancer(
        BalancerConfig::default()
            .with_lower_levels(true)
            .with_promote_on_read(false),
    )
    .unwrap();
    // x's device pages hottest (they stay), y's next.
    touch(&x, 0..2, 30);
    touch(&y, 0..4, 10);
    let r = rt.balance_once().unwrap();
    // The copies' room took y's pages the device did not (the device
    // takes one: the other would displace a hotter page of x): none left
    // on NVMe.
    assert!(r.promotions >= 1 && r.promotions_below >= 1, "{r:?}");
    assert!(
        (0..4).all(|p| y.tier_of(p).unwrap() != Some(Tier::Nvme)),
        "{r:?}"
    );
    // x's pages that live in DRAM stayed there: the room was the copies'.
    let in_host = (2..6)
        .filter(|&p| x.tier_of(p).unwrap() == Some(Tier::Host))
        .count();
    assert_eq!(in_host, 4, "{r:?}");
    let mut back = vec![0u8; 6 * PAGE];
    x.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 1));
    let mut back = vec![0u8; 4 * PAGE];
    y.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 2));
}

/// A promotion into a full device tier displaces a page the policy does
/// not hold (one with a clean copy below, which leaves for free) only where
/// it outscores that page: a swap of equally hot pages moves data for no
/// hits and is not made; pages clearly hotter than the residents still
/// come in.
#[test]
fn equally_hot_pages_are_not_swapped() {
    let rt = runtime();
    let a = rt
        .alloc_with(7 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    a.write(0, &vec![1; 7 * PAGE]).unwrap();
    let b = rt
        .alloc_with(7 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    b.write(0, &vec![2; 7 * PAGE]).unwrap();
    // a fills the device's room (7 of 8 pages under the high watermark),
    // each page keeping its DRAM copy.
    a.prefetch(0..7 * PAGE as u64, Tier::Device).wait().unwrap();
    rt.balance_once().unwrap(); // the writes, folded
    assert_eq!(on_device(&a, 0..7), 7);
    let promoted = rt.stats().promotions;
    // Both read alike, round after round: the policy holds some of b in
    // place of a, but no move would earn a hit.
    for _ in 0..4 {
        touch(&a, 0..7, 10);
        touch(&b, 0..7, 10);
        rt.balance_once().unwrap();
    }
    let s = rt.stats();
    assert_eq!(s.promotions, promoted, "equals were swapped: {:?}", s.tiers);
    assert_eq!(on_device(&a, 0..7), 7);
    // b alone is read now: its pages outscore a's and come in.
    for _ in 0..4 {
        touch(&b, 0..7, 10);
        rt.balance_once().unwrap();
    }
    assert!(on_device(&b, 0..7) >= 4, "{:?}", rt.stats().tiers);
    let mut back = vec![0; 7 * PAGE];
    a.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&x| x == 1));
    b.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&x| x == 2));
}

#[test]
fn a_round_with_everything_in_place_replays_nothing_and_resumes_when_a_page_is_below() {
    let rt = runtime();
    let b = rt
        .alloc_with(6 * PAGE as u64, Placement::Prefer(Tier::Host))
        .unwrap();
    b.write(0, &vec![5; 6 * PAGE]).unwrap();
    b.prefetch(0..6 * PAGE as u64, Tier::Device).wait().unwrap();
    rt.balance_once().unwrap(); // the writes, folded
    assert_eq!(on_device(&b, 0..6), 6);
    // Every page on the device (its DRAM copies clean), room to spare:
    // no decision could move a page, and the policy is not consulted.
    touch(&b, 0..6, 10);
    let r = rt.balance_once().unwrap();
    assert_eq!((r.replayed, r.promotions, r.demotions), (0, 0, 0), "{r:?}");
    // A page below (not a clean copy) brings the policy back in; once it
    // is up, rounds skip again.
    b.evict(5 * PAGE as u64..6 * PAGE as u64, Tier::Host)
        .unwrap();
    b.write(5 * PAGE as u64, &[6; 8]).unwrap(); // read back below
    assert_eq!(b.tier_of(5).unwrap(), Some(Tier::Host));
    touch(&b, 0..6, 10);
    let r = rt.balance_once().unwrap();
    assert_eq!((r.replayed, r.promotions), (6, 1), "{r:?}");
    assert_eq!(on_device(&b, 0..6), 6, "{:?}", rt.stats().tiers);
    touch(&b, 0..6, 10);
    assert_eq!(rt.balance_once().unwrap().replayed, 0);
    let mut back = vec![0; PAGE];
    b.read(5 * PAGE as u64, &mut back).unwrap();
    assert_eq!(&back[..8], &[6; 8]);
    assert!(back[8..].iter().all(|&x| x == 5));
}

/// A prefetch that completes the device's set is still told to the
/// policy: the round that takes its hint replays, though every page is
/// then on the device; and a prefetch cancelled after its pages came is
/// a hint like any other.
#[test]
fn prefetches_are_hints_when_everything_is_in_place_and_when_cancelled_late() {
    let run = |policy: PolicyKind, cancel_late: bool| {
        let rt = runtime_with_device(16);
        let b = rt
            .alloc_with(12 * PAGE as u64, Placement::Prefer(Tier::Host))
            .unwrap();
        b.write(0, &vec![1; 12 * PAGE]).unwrap();
        rt.configure_balancer(BalancerConfig::default().with_policy(policy))
            .unwrap();
        rt.balance_once().unwrap(); // the writes, folded: all on the device
        assert_eq!(on_device(&b, 0..12), 12);
        b.evict((11 * PAGE) as u64..(12 * PAGE) as u64, Tier::Host)
            .unwrap();
        touch(&b, 0..11, 10);
        rt.balance_once().unwrap();
        assert_eq!(b.tier_of(11).unwrap(), Some(Tier::Host));
        let t = b.prefetch((11 * PAGE) as u64..(12 * PAGE) as u64, Tier::Device);
        t.clone().wait().unwrap();
        if cancel_late {
            assert_eq!(b.cancel(&t), 0, "nothing left to drop");
        }
        // Every page on the device now, but the hint is news to the policy.
        rt.balance_once().unwrap();
        // Six new hot pages: the policy makes room among b's.
        let c = rt
            .alloc_with(6 * PAGE as u64, Placement::Prefer(Tier::Host))
            .unwrap();
        c.write(0, &vec![2; 6 * PAGE]).unwrap();
        touch(&b, 0..11, 10);
        touch(&c, 0..6, 10);
        rt.balance_once().unwrap();
        b.tier_of(11).unwrap() == Some(Tier::Device)
    };
    assert!(run(PolicyKind::Lookahead, false), "the hinted page stayed");
    assert!(
        run(PolicyKind::Lookahead, true),
        "a late cancel is still a hint"
    );
    assert!(
        !run(PolicyKind::Lru, false),
        "without hints it is the first to leave"
    );
}

/// A round replays at most `repeat` accesses per touched page: one beyond
/// the limit (a round costing billions of policy accesses for a page at
/// the counters' ceiling) or none at all is refused, and the builder
/// clamps.
#[test]
fn a_balancer_repeat_out_of_range_is_refused() {
    let rt = runtime();
    for repeat in [0, strata::runtime::REPEAT_LIMIT + 1, u32::MAX] {
        let mut c = BalancerConfig::default();
        c.repeat = repeat;
        let err = rt.configure_balancer(c).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{repeat}: {err}");
        assert!(err.message().contains("repeat"), "{err}");
    }
    let c = BalancerConfig::default().with_repeat(u32::MAX);
    assert_eq!(c.repeat, strata::runtime::REPEAT_LIMIT);
    rt.configure_balancer(c).unwrap();
    assert_eq!(BalancerConfig::default().with_repeat(0).repeat, 1);
}
