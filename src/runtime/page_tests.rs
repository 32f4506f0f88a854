//! The page-state machine's tests: each transition, and loom models of
//! the races between writes, moves, pins and clean copies.

use super::*;

fn freed(tier: Tier, slot: u32) -> Freed<u32> {
    Freed {
        old: Some((tier, slot)),
        clean: None,
    }
}

fn resident(tier: Tier, slot: u32) -> Entry<u32> {
    Entry {
        loc: Resident { tier, slot },
        ..Entry::default()
    }
}

#[test]
fn a_write_after_the_copy_abandons_the_move() {
    let mut e = resident(Tier::Host, 1);
    let b = e.begin_move(Tier::Nvme, |_| true).unwrap();
    assert_eq!(e.note_write(), None);
    assert_eq!(e.commit(b, Tier::Nvme, 2, false), Err(2));
    assert_eq!(
        e.loc,
        Resident {
            tier: Tier::Host,
            slot: 1
        }
    );
}

#[test]
fn a_pinned_page_neither_begins_nor_commits_a_move() {
    let mut e = resident(Tier::Host, 1);
    let b = e.begin_move(Tier::Device, |_| true).unwrap();
    assert_eq!(e.pin(true), (true, None));
    assert!(e.begin_move(Tier::Device, |_| true).is_none());
    assert_eq!(e.commit(b, Tier::Device, 2, false), Err(2));
    // Unpinned again, the copy taken before the pin still does not commit.
    assert!(e.unpin());
    assert_eq!(e.commit(b, Tier::Device, 3, false), Err(3));
    let b = e.begin_move(Tier::Device, |_| true).unwrap();
    assert_eq!(
        e.commit(b, Tier::Device, 4, false),
        Ok(freed(Tier::Host, 1))
    );
    assert_eq!(
        e.loc,
        Resident {
            tier: Tier::Device,
            slot: 4
        }
    );
}

#[test]
fn a_move_begins_only_from_a_wanted_other_tier() {
    let e = resident(Tier::Host, 1);
    assert!(e.begin_move(Tier::Host, |_| true).is_none());
    assert!(e.begin_move(Tier::Nvme, |t| t == Tier::Cxl).is_none());
    assert!(Entry::<u32>::default()
        .begin_move(Tier::Host, |_| true)
        .is_none());
}

#[test]
fn a_read_in_flight_reads_as_lost_until_put_back_or_committed() {
    let mut e = resident(Tier::Nvme, 7);
    let (b, slot) = e.take_for_read().unwrap();
    assert_eq!(e.loc, Lost);
    assert!(e.slot().is_none());
    e.put_back(b, slot);
    let (b, slot) = e.take_for_read().unwrap();
    e.put_back(b, slot);
    assert_eq!(e.commit(b, Tier::Host, 8, false), Ok(freed(Tier::Nvme, 7)));
    assert_eq!(e.tier(), Some(Tier::Host));
}

#[test]
fn a_read_only_mapping_stops_moves_begun_before_it_and_keeps_the_clean_copy() {
    let mut e = resident(Tier::Host, 1);
    let b = e.begin_move(Tier::Device, |_| true).unwrap();
    assert_eq!(e.commit(b, Tier::Device, 2, true).map(|f| f.old), Ok(None));
    assert_eq!(
        e.clean,
        Some((Tier::Host, 1)),
        "the promotion kept its old slot"
    );
    let b = e.begin_move(Tier::Host, |_| true).unwrap();
    e.note_mapped();
    assert_eq!(
        e.commit(b, Tier::Host, 3, false),
        Err(3),
        "copied before the mapping"
    );
    assert_eq!(
        e.clean,
        Some((Tier::Host, 1)),
        "kernels do not write: still clean"
    );
    assert_eq!(e.drop_to_clean(Tier::Host), Some((Tier::Device, 2)));
}

#[test]
fn a_promotion_mark_is_taken_once_and_cleared_by_moves() {
    let mut e = resident(Tier::Nvme, 1);
    assert!(!e.mark_promotion(Tier::Host, |t| t == Tier::Cxl));
    assert!(e.mark_promotion(Tier::Host, |t| t == Tier::Nvme));
    assert_eq!(e.take_promotion(), Some(Tier::Host));
    assert_eq!(e.take_promotion(), None, "taken once");
    // A pinned page keeps no mark a read would act on.
    assert!(e.mark_promotion(Tier::Host, |_| true));
    let _ = e.pin(true);
    assert_eq!(e.take_promotion(), None);
    e.unpin();
    // A committed move clears it, and so does freeing the page.
    assert!(e.mark_promotion(Tier::Host, |_| true));
    let b = e.begin_move(Tier::Cxl, |_| true).unwrap();
    assert_eq!(e.commit(b, Tier::Cxl, 2, false), Ok(freed(Tier::Nvme, 1)));
    assert_eq!(e.promote_on_read, None);
    assert!(e.mark_promotion(Tier::Host, |_| true));
    let _ = e.clear();
    assert_eq!(e.promote_on_read, None);
    assert!(!e.mark_promotion(Tier::Host, |_| true), "nothing to move");
}

/// A page and the contents of the slots it may use (0: free). The
/// fresh slot of a move is its mover's alone until the commit, so the
/// model writes it there; only the page lock is shared.
struct Model {
    entry: Entry<u32>,
    slots: [u32; 4],
}

/// Frees `slot` in the model: it must hold something.
fn free_slot(m: &mut Model, slot: u32) {
    assert_ne!(m.slots[slot as usize], 0, "double free");
    m.slots[slot as usize] = 0;
}

/// A mover that copies the page under its lock and commits after
/// taking the lock again (as a demotion to NVMe does, with the write in
/// between), into slot `fresh` of `dst`; with `keep`, a promotion keeps
/// the old slot as the clean copy.
fn spawn_mover(
    page: &loom::sync::Arc<loom::sync::Mutex<Model>>,
    dst: Tier,
    fresh: u32,
    keep: bool,
) -> loom::thread::JoinHandle<()> {
    let page = page.clone();
    loom::thread::spawn(move || {
        let (begun, content) = {
            let m = page.lock().unwrap();
            let Some(b) = m.entry.begin_move(dst, |_| true) else {
                return;
            };
            (b, m.slots[*m.entry.slot().unwrap() as usize])
        };
        let mut m = page.lock().unwrap();
        m.slots[fresh as usize] = content;
        match m.entry.commit(begun, dst, fresh, keep) {
            Ok(freed) => {
                for (_, s) in freed.into_slots() {
                    free_slot(&mut m, s);
                }
            }
            Err(fresh) => free_slot(&mut m, fresh),
        }
    })
}

fn spawn_writer(
    page: &loom::sync::Arc<loom::sync::Mutex<Model>>,
    value: u32,
) -> loom::thread::JoinHandle<()> {
    let page = page.clone();
    loom::thread::spawn(move || {
        let mut m = page.lock().unwrap();
        let s = *m.entry.slot().unwrap() as usize;
        m.slots[s] = value;
        if let Some((_, clean)) = m.entry.note_write() {
            free_slot(&mut m, clean);
        }
    })
}

/// After every thread ended: the page holds `value` in a slot of its
/// own (and in its clean copy, if it kept one), and every other slot
/// was freed.
fn check_end(page: &loom::sync::Mutex<Model>, value: u32) {
    let m = page.lock().unwrap();
    let own = *m.entry.slot().expect("a committed page is never lost") as usize;
    assert_eq!(m.slots[own], value, "the write was lost");
    let clean = m.entry.clean.as_ref().map(|(_, s)| *s as usize);
    if let Some(c) = clean {
        assert_eq!(m.slots[c], value, "the clean copy is stale");
    }
    for (i, &c) in m.slots.iter().enumerate() {
        assert!(i == own || Some(i) == clean || c == 0, "slot {i} leaked");
    }
}

/// What a model that must fail panicked with: the check it was meant to
/// trip, not some other failure (an unwrap, loom's own limits).
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => p
            .downcast::<&'static str>()
            .map(|s| s.to_string())
            .unwrap_or_else(|_| "a panic without a message".into()),
    }
}

fn start(page: Entry<u32>) -> loom::sync::Arc<loom::sync::Mutex<Model>> {
    let mut slots = [0; 4];
    slots[*page.slot().unwrap() as usize] = 1;
    loom::sync::Arc::new(loom::sync::Mutex::new(Model { entry: page, slots }))
}

/// The protocol under every interleaving loom explores: a writer, a
/// mover and a pinner race on one page. The page ends holding the
/// write, every slot but its own is freed exactly once, and a pin sees
/// its slot unchanged until it ends.
#[test]
fn loom_writes_win_pins_hold_commits_keep_the_page() {
    loom::model(|| {
        let page = start(resident(Tier::Host, 0));
        let writer = spawn_writer(&page, 2);
        let mover = spawn_mover(&page, Tier::Nvme, 1, false);
        let pinner = {
            let page = page.clone();
            loom::thread::spawn(move || {
                let held = {
                    let mut m = page.lock().unwrap();
                    let _ = m.entry.pin(true);
                    *m.entry.slot().unwrap()
                };
                let mut m = page.lock().unwrap();
                assert_eq!(*m.entry.slot().unwrap(), held, "a pinned page moved");
                m.entry.unpin();
            })
        };
        writer.join().unwrap();
        mover.join().unwrap();
        pinner.join().unwrap();
        check_end(&page, 2);
    });
}

/// Two movers to different tiers and a writer: at most one copy
/// commits per version, the other is abandoned, the write is never
/// lost.
#[test]
fn loom_racing_moves_commit_at_most_once_per_copy() {
    loom::model(|| {
        let page = start(resident(Tier::Host, 0));
        let a = spawn_mover(&page, Tier::Cxl, 1, false);
        let b = spawn_mover(&page, Tier::Nvme, 2, false);
        let w = spawn_writer(&page, 5);
        a.join().unwrap();
        b.join().unwrap();
        w.join().unwrap();
        check_end(&page, 5);
    });
}

/// A model that must fail: a commit that ignores the version (the
/// bug the version exists for) loses the racing write in some
/// interleaving, and loom finds it.
#[test]
fn loom_finds_the_lost_write_of_a_commit_without_the_version_check() {
    let found = std::panic::catch_unwind(|| {
        loom::model(|| {
            let page = start(resident(Tier::Host, 0));
            let writer = spawn_writer(&page, 2);
            let mover = {
                let page = page.clone();
                loom::thread::spawn(move || {
                    let (mut begun, content) = {
                        let m = page.lock().unwrap();
                        let b = m.entry.begin_move(Tier::Nvme, |_| true).unwrap();
                        (b, m.slots[*m.entry.slot().unwrap() as usize])
                    };
                    let mut m = page.lock().unwrap();
                    m.slots[1] = content;
                    // The bug: commit whatever the page's version now.
                    begun.version = m.entry.version;
                    let freed = m.entry.commit(begun, Tier::Nvme, 1, false).unwrap();
                    for (_, s) in freed.into_slots() {
                        m.slots[s as usize] = 0;
                    }
                })
            };
            writer.join().unwrap();
            mover.join().unwrap();
            check_end(&page, 2);
        })
    });
    let message =
        panic_message(found.expect_err("loom explored no interleaving that loses the write"));
    assert!(message.contains("the write was lost"), "{message}");
}

#[test]
fn a_promotion_keeps_its_clean_copy_until_a_write_or_a_demotion_back() {
    let mut e = resident(Tier::Nvme, 1);
    let b = e.begin_move(Tier::Host, |_| true).unwrap();
    // Kept: nothing to free, the NVMe slot is the clean copy.
    assert_eq!(
        e.commit(b, Tier::Host, 2, true),
        Ok(Freed {
            old: None,
            clean: None
        })
    );
    assert_eq!(e.clean, Some((Tier::Nvme, 1)));
    // Further up, the copy in the slowest tier stays, the host slot goes.
    let b = e.begin_move(Tier::Device, |_| true).unwrap();
    assert_eq!(e.commit(b, Tier::Device, 3, true), Ok(freed(Tier::Host, 2)));
    assert_eq!(e.clean, Some((Tier::Nvme, 1)));
    // Back down with no copy: the device slot comes back to be freed.
    assert_eq!(e.drop_to_clean(Tier::Host), None, "no clean copy in host");
    let v = e.version;
    assert_eq!(e.drop_to_clean(Tier::Nvme), Some((Tier::Device, 3)));
    assert_eq!(
        e.loc,
        Resident {
            tier: Tier::Nvme,
            slot: 1
        }
    );
    assert_ne!(
        e.version, v,
        "a demotion is a move: copies begun before it do not commit"
    );
    assert_eq!(e.clean, None);
    // A write drops the copy before it can be served.
    let b = e.begin_move(Tier::Host, |_| true).unwrap();
    let _ = e.commit(b, Tier::Host, 4, true).unwrap();
    assert_eq!(e.note_write(), Some((Tier::Nvme, 1)));
    assert_eq!(e.drop_to_clean(Tier::Nvme), None);
    // A read-only pin keeps the copy, a writable one drops it, and a
    // pinned page never drops to its copy.
    let mut e = resident(Tier::Nvme, 1);
    let b = e.begin_move(Tier::Host, |_| true).unwrap();
    let _ = e.commit(b, Tier::Host, 2, true).unwrap();
    assert_eq!(e.pin(false), (true, None));
    assert_eq!(e.drop_to_clean(Tier::Nvme), None, "pinned");
    assert_eq!(e.pin(true), (false, Some((Tier::Nvme, 1))));
    // Freeing the page gives back both slots.
    let mut e = resident(Tier::Cxl, 1);
    let b = e.begin_move(Tier::Host, |_| true).unwrap();
    let _ = e.commit(b, Tier::Host, 2, true).unwrap();
    let slots: Vec<_> = e.clear().into_slots().collect();
    assert_eq!(slots, vec![(Tier::Host, 2), (Tier::Cxl, 1)]);
    // A move below the copy drops it: it would be slower than the page.
    let mut e = resident(Tier::Cxl, 1);
    let b = e.begin_move(Tier::Host, |_| true).unwrap();
    let _ = e.commit(b, Tier::Host, 2, true).unwrap();
    let b = e.begin_move(Tier::Nvme, |_| true).unwrap();
    assert_eq!(
        e.commit(b, Tier::Nvme, 3, true),
        Ok(Freed {
            old: Some((Tier::Host, 2)),
            clean: Some((Tier::Cxl, 1))
        })
    );
}

/// A thread that demotes the page back to its clean copy (no copy) and
/// frees the slot it left.
fn spawn_clean_demoter(
    page: &loom::sync::Arc<loom::sync::Mutex<Model>>,
) -> loom::thread::JoinHandle<()> {
    let page = page.clone();
    loom::thread::spawn(move || {
        let mut m = page.lock().unwrap();
        if let Some((_, old)) = m.entry.drop_to_clean(Tier::Nvme) {
            free_slot(&mut m, old);
        }
    })
}

/// A thread that takes the clean copy for its tier's room.
fn spawn_room_maker(
    page: &loom::sync::Arc<loom::sync::Mutex<Model>>,
) -> loom::thread::JoinHandle<()> {
    let page = page.clone();
    loom::thread::spawn(move || {
        let mut m = page.lock().unwrap();
        if let Some((_, clean)) = m.entry.take_clean() {
            free_slot(&mut m, clean);
        }
    })
}

/// Clean copies under every interleaving: a promotion that keeps its
/// NVMe copy, a write and a demotion back to the copy race. The page
/// ends holding the write (a stale copy is never served after it), and
/// every slot but the page's own and its clean copy is freed once.
#[test]
fn loom_a_stale_clean_copy_is_never_served_after_a_write() {
    loom::model(|| {
        let page = start(resident(Tier::Nvme, 0));
        let mover = spawn_mover(&page, Tier::Host, 1, true);
        let writer = spawn_writer(&page, 2);
        let demoter = spawn_clean_demoter(&page);
        mover.join().unwrap();
        writer.join().unwrap();
        demoter.join().unwrap();
        check_end(&page, 2);
    });
}

/// A read-only launch maps the page (its version moves, its clean copy
/// stays) while a promotion that keeps its copy and a demotion back to
/// the copy race: the page and its copy hold the page's bytes, a move
/// copied before the mapping is abandoned, and nothing leaks.
#[test]
fn loom_a_read_only_mapping_keeps_a_clean_copy_that_is_still_right() {
    loom::model(|| {
        let page = start(resident(Tier::Nvme, 0));
        let mover = spawn_mover(&page, Tier::Host, 1, true);
        let mapper = {
            let page = page.clone();
            loom::thread::spawn(move || page.lock().unwrap().entry.note_mapped())
        };
        let demoter = spawn_clean_demoter(&page);
        mover.join().unwrap();
        mapper.join().unwrap();
        demoter.join().unwrap();
        check_end(&page, 1);
    });
}

/// The NVMe tier takes the copy for room while the page is promoted
/// and demoted back to it: whichever comes first, the page is never
/// lost and no slot leaks or is freed twice.
#[test]
fn loom_a_page_whose_clean_copy_was_dropped_is_never_lost() {
    loom::model(|| {
        let page = start(resident(Tier::Nvme, 0));
        let mover = spawn_mover(&page, Tier::Host, 1, true);
        let demoter = spawn_clean_demoter(&page);
        let room = spawn_room_maker(&page);
        mover.join().unwrap();
        demoter.join().unwrap();
        room.join().unwrap();
        check_end(&page, 1);
    });
}

/// A model that must fail: a write that keeps the clean copy (the bug
/// `note_write` exists for) lets a demotion serve the stale copy in
/// some interleaving, and loom finds it.
#[test]
fn loom_finds_the_stale_copy_of_a_write_that_keeps_it() {
    let found = std::panic::catch_unwind(|| {
        loom::model(|| {
            let page = start(resident(Tier::Nvme, 0));
            let mover = spawn_mover(&page, Tier::Host, 1, true);
            let writer = {
                let page = page.clone();
                loom::thread::spawn(move || {
                    let mut m = page.lock().unwrap();
                    let s = *m.entry.slot().unwrap() as usize;
                    m.slots[s] = 2;
                    // The bug: the version moves, the copy stays.
                    m.entry.version = m.entry.version.wrapping_add(1);
                })
            };
            let demoter = spawn_clean_demoter(&page);
            mover.join().unwrap();
            writer.join().unwrap();
            demoter.join().unwrap();
            check_end(&page, 2);
        })
    });
    let message =
        panic_message(found.expect_err("loom explored no interleaving that serves the stale copy"));
    // Served after the write, the stale copy is what the page ends holding
    // (the write lost), or what its kept copy holds.
    assert!(
        message.contains("the write was lost") || message.contains("the clean copy is stale"),
        "{message}"
    );
}

#[test]
fn a_page_shows_where_its_last_lock_holder_left_it() {
    let page: Page<u32> = Page::default();
    assert_eq!(page.seen(), Zero);
    {
        let mut e = page.lock();
        e.loc = Resident {
            tier: Tier::Nvme,
            slot: 7,
        };
        // Not yet: the lock is held.
        assert_eq!(page.seen(), Zero);
    }
    assert_eq!(page.seen_tier(), Some(Tier::Nvme));
    // A read in flight holds the lock with the slot taken: the page shows
    // where it was until the move commits and lets go.
    let mut e = page.lock();
    let (begun, slot) = e.take_for_read().unwrap();
    assert_eq!(page.seen_tier(), Some(Tier::Nvme));
    e.put_back(begun, slot);
    let begun = e.begin_move(Tier::Host, |_| true).unwrap();
    assert_eq!(
        e.commit(begun, Tier::Host, 8, false),
        Ok(freed(Tier::Nvme, 7))
    );
    assert_eq!(page.seen_tier(), Some(Tier::Nvme));
    drop(e);
    assert_eq!(page.seen_tier(), Some(Tier::Host));
    // Every tier round-trips, and a page left lost shows as lost.
    for tier in Tier::ALL {
        page.lock().loc = Resident { tier, slot: 1 };
        assert_eq!(page.seen_tier(), Some(tier));
    }
    page.lock().loc = Lost;
    assert_eq!(page.seen(), Lost);
    let _ = page.lock().clear();
    assert_eq!(page.seen(), Zero);
}
