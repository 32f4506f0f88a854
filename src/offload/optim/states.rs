//! The optimizer's state arrays in a runtime, and the one path a step takes
//! through them.
//!
//! **Layout.** The parameters are cut into chunks of `page / 4` elements
//! (`page` is the runtime's page size). The chunks are split into lanes of
//! consecutive chunks; a lane is three buffers — weights, first moment,
//! second moment — whose page `i` holds the lane's chunk `i`. Separate
//! buffers per array let one chunk's three pages be lent writable at once
//! ([`Buffer::view_mut`] borrows its buffer), and lanes let several chunks
//! be lent at once. Between steps the pages live in the states' home tier
//! (host, CXL or NVMe), moved by the runtime like any buffer's pages.
//!
//! **A step** updates each chunk in the host tier, on the runtime's pinned
//! pages in place:
//!
//! - home in the host tier: every lane's pages are pinned there at once
//!   (a page the runtime had moved away is brought back first). The CPU
//!   takes every chunk in one batch, its threads sharing them out; a GPU
//!   takes one chunk of every lane per batch, one pipeline of batches.
//! - home in CXL or NVMe: the chunks stream through the host tier in
//!   groups. While group k updates, prefetch tickets bring groups k+1 …
//!   k+`ahead` into the host tier and the groups updated before k go back
//!   home (prefetches to the home tier), at most `behind` of them in
//!   flight; the runtime's engine runs the reads and the writes on their
//!   own lanes. A group the prefetch could not bring (the host tier full)
//!   is brought by the pin itself.
//!
//! A failure part-way leaves every page whole in the runtime, in one tier
//! or another (the engine copies, then commits): chunks updated before it
//! hold their new state, the others their old one.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::error::{Error, ErrorKind, Result};
use crate::runtime::{Buffer, Placement, Runtime, Ticket, ViewMut};
use crate::tier::Tier;

/// Where chunks are updated: the host tier, which every runtime has.
const WORK: Tier = Tier::Host;

/// Bytes of one array a streamed group aims at (one prefetch each).
const GROUP_BYTES: usize = 4 << 20;

/// A step's batch update: the chunks it is given, in the host tier.
pub(super) type BatchUpdate<'f, T> =
    dyn Fn(Vec<(usize, [&mut [f32]; 3], &mut T)>) -> Result<()> + Sync + 'f;

/// Consecutive chunks and their three state buffers.
struct Lane {
    /// Its first chunk: page `i` of each buffer is chunk `first + i`.
    first: usize,
    /// Its chunks.
    len: usize,
    /// Weights, first moment, second moment.
    arrays: [Buffer; 3],
}

/// How a streamed step overlaps its moves with the update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Window {
    /// Chunks per group (one prefetch per array and group).
    pub(super) group: usize,
    /// Groups read ahead of the one updating.
    pub(super) ahead: usize,
    /// Groups on their way home at most.
    pub(super) behind: usize,
}

impl Window {
    /// The window for chunks of `page` bytes, lanes of up to `lane` chunks,
    /// using at most half of `host_pages`.
    pub(super) fn fit(page: usize, lane: usize, host_pages: usize) -> Self {
        let mut w = Window {
            group: (GROUP_BYTES / page).clamp(1, lane.max(1)),
            ahead: 2,
            behind: 2,
        };
        while w.host_pages() > host_pages / 2 {
            if w.group > 1 {
                w.group = w.group.div_ceil(2);
            } else if w.ahead > 1 || w.behind > 1 {
                (w.ahead, w.behind) = (1, 1);
            } else {
                break;
            }
        }
        w
    }

    /// Host pages the window's groups hold at most.
    pub(super) fn host_pages(&self) -> usize {
        3 * self.group * (self.ahead + self.behind + 1)
    }
}

/// The state arrays in a runtime; see the module docs.
pub(super) struct States {
    rt: Runtime,
    lanes: Vec<Lane>,
    home: Tier,
    page: usize,
    window: Window,
}

fn f32s(page: Option<&mut [u8]>) -> Result<&mut [f32]> {
    let page = page.ok_or_else(|| Error::new(ErrorKind::Io, "a state page was not lent"))?;
    bytemuck::try_cast_slice_mut(page)
        .map_err(|e| Error::new(ErrorKind::Io, format!("a state page is not f32s: {e}")))
}

impl States {
    /// Lays `weights` out as the master weights (moments zero) in buffers
    /// of `rt`, placed in `home`: `lanes` lanes when updated in place.
    pub(super) fn lay_out(rt: Runtime, home: Tier, weights: &[f32], lanes: usize) -> Result<Self> {
        let page = rt.page_size();
        let chunk = page / 4;
        let chunks = weights.len().div_ceil(chunk);
        let lanes = if home == WORK {
            lanes.clamp(1, chunks)
        } else {
            1
        };
        let per = chunks.div_ceil(lanes);
        let zeros = vec![0u8; page];
        let mut out = Vec::with_capacity(lanes);
        for first in (0..chunks).step_by(per) {
            let len = per.min(chunks - first);
            let bytes = (len * page) as u64;
            let alloc = || rt.alloc_with(bytes, Placement::Prefer(home));
            let arrays = [alloc()?, alloc()?, alloc()?];
            let end = ((first + len) * chunk).min(weights.len());
            // A short last page is padded with zeros by the runtime.
            arrays[0].write_as(0, &weights[first * chunk..end])?;
            for a in &arrays[1..] {
                for p in 0..len {
                    a.write((p * page) as u64, &zeros)?;
                }
            }
            // Where `home` was full the pages went to the fastest tier with
            // room: down to `home` or below with them.
            for a in &arrays {
                a.evict(0..bytes, home)?;
            }
            out.push(Lane { first, len, arrays });
        }
        let host_pages = host_pages(&rt);
        let longest = out.iter().map(|l| l.len).max().unwrap_or(1);
        Ok(Self {
            window: Window::fit(page, longest, host_pages),
            rt,
            lanes: out,
            home,
            page,
        })
    }

    /// How a streamed step overlaps its moves with the update.
    #[cfg(test)]
    pub(super) fn window(&self) -> Window {
        self.window
    }

    /// The runtime the states live in.
    pub(super) fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// Where the states live between steps.
    pub(super) fn home(&self) -> Tier {
        self.home
    }

    /// Updates every chunk once, `update` given batches of chunks in the
    /// host tier with each chunk's entry of `per_chunk`: with `across`, in
    /// place a batch takes one chunk of every lane (an updater that keeps
    /// one pipeline of batches, a GPU); without, one batch holds every
    /// chunk, which the CPU's threads share out. With `skip_weights` (the
    /// caller's array is the master) a streamed step moves only the
    /// moments, and the update gets an empty weights slice. Returns the
    /// time spent waiting for pages to arrive and leave.
    pub(super) fn step<T: Send>(
        &mut self,
        per_chunk: &mut [T],
        across: bool,
        skip_weights: bool,
        update: &BatchUpdate<'_, T>,
    ) -> Result<Duration> {
        if self.home == WORK {
            self.in_place(per_chunk, across, update)
        } else {
            self.streamed(per_chunk, skip_weights, update)
        }
    }

    /// Home in the host tier: every lane pinned there, its chunks updated
    /// in place.
    fn in_place<T: Send>(
        &mut self,
        per_chunk: &mut [T],
        across: bool,
        update: &BatchUpdate<'_, T>,
    ) -> Result<Duration> {
        let page = self.page;
        let meta: Vec<(usize, usize)> = self.lanes.iter().map(|l| (l.first, l.len)).collect();
        let mut extras: Vec<&mut [T]> = Vec::with_capacity(meta.len());
        let per_chunk_len = per_chunk.len();
        let mut rest = per_chunk;
        for &(_, len) in &meta {
            let (mine, more) = rest.split_at_mut(len);
            extras.push(mine);
            rest = more;
        }
        // Nanoseconds the pins took, summed over the lanes.
        let pinning = std::sync::atomic::AtomicU64::new(0);
        let waited = || Duration::from_nanos(pinning.load(std::sync::atomic::Ordering::Relaxed));
        let mut views: Vec<[ViewMut<'_>; 3]> = self
            .lanes
            .par_iter_mut()
            .map(|lane| pin_lane(lane, page, &pinning))
            .collect::<Result<_>>()?;
        if !across {
            // The CPU: every chunk in one batch, spread over the threads.
            let mut batch = Vec::with_capacity(per_chunk_len);
            for ((lane, x), &(first, len)) in views.iter_mut().zip(extras).zip(&meta) {
                let [w, m, v] = lane.each_mut().map(ViewMut::pages_mut);
                if w.len() != len || m.len() != len || v.len() != len {
                    return Err(Error::new(ErrorKind::Io, "a state page was not lent"));
                }
                let pages = w.into_iter().zip(m).zip(v).zip(x.iter_mut());
                for (i, ((((_, w), (_, m)), (_, v)), x)) in pages.enumerate() {
                    batch.push((
                        first + i,
                        [f32s(Some(w))?, f32s(Some(m))?, f32s(Some(v))?],
                        x,
                    ));
                }
            }
            update(batch)?;
        } else {
            // A GPU: one chunk of every lane per call.
            let rounds = meta.iter().map(|m| m.1).max().unwrap_or(0);
            for i in 0..rounds {
                let mut batch = Vec::with_capacity(views.len());
                for ((lane, x), &(first, len)) in views.iter_mut().zip(extras.iter_mut()).zip(&meta)
                {
                    if i < len {
                        let [w, m, v] = lane;
                        let state = [
                            f32s(w.page_mut(i))?,
                            f32s(m.page_mut(i))?,
                            f32s(v.page_mut(i))?,
                        ];
                        batch.push((first + i, state, &mut x[i]));
                    }
                }
                update(batch)?;
            }
        }
        drop(views);
        Ok(waited())
    }

    /// Home in CXL or NVMe: the chunks stream through the host tier in
    /// groups, reads ahead and write-backs behind the update.
    fn streamed<T: Send>(
        &mut self,
        per_chunk: &mut [T],
        skip_weights: bool,
        update: &BatchUpdate<'_, T>,
    ) -> Result<Duration> {
        let Window {
            group,
            ahead,
            behind,
        } = self.window;
        let groups: Vec<(usize, Range<usize>)> = self
            .lanes
            .iter()
            .enumerate()
            .flat_map(|(l, lane)| {
                (0..lane.len)
                    .step_by(group)
                    .map(move |p| (l, p..(p + group).min(lane.len)))
            })
            .collect();
        let mut waited = Duration::ZERO;
        let mut reads: VecDeque<Vec<Ticket>> = VecDeque::new();
        let mut writes: VecDeque<Vec<Ticket>> = VecDeque::new();
        let mut next = 0;
        let mut run = || -> Result<()> {
            for (k, (l, pages)) in groups.iter().enumerate() {
                while next < groups.len() && next <= k + ahead {
                    reads.push_back(self.move_group(&groups[next], WORK, skip_weights));
                    next += 1;
                }
                let t = Instant::now();
                // Every ticket of the group is waited for, also after one
                // failed: a move left running would hold its pages past
                // the step's return.
                let mut failed = Ok(());
                for ticket in reads.pop_front().expect("read ahead") {
                    match ticket.wait() {
                        // The pins below bring what did not fit.
                        Err(e) if e.kind() != ErrorKind::OutOfCapacity => {
                            failed = failed.and(Err(e));
                        }
                        _ => {}
                    }
                }
                failed?;
                let bytes = (pages.start * self.page) as u64..(pages.end * self.page) as u64;
                let lane = &mut self.lanes[*l];
                let first = lane.first;
                let [w, m, v] = &mut lane.arrays;
                let mut w = match skip_weights {
                    true => None,
                    false => Some(w.view_mut(bytes.clone(), WORK)?),
                };
                let mut views = [m.view_mut(bytes.clone(), WORK)?, v.view_mut(bytes, WORK)?];
                waited += t.elapsed();
                for p in pages.clone() {
                    let [m, v] = &mut views;
                    let mut none = [0f32; 0];
                    let state = [
                        match &mut w {
                            Some(w) => f32s(w.page_mut(p))?,
                            None => &mut none[..],
                        },
                        f32s(m.page_mut(p))?,
                        f32s(v.page_mut(p))?,
                    ];
                    update(vec![(first + p, state, &mut per_chunk[first + p])])?;
                }
                drop(views);
                drop(w);
                writes.push_back(self.move_group(&groups[k], self.home, skip_weights));
                while writes.len() > behind {
                    waited += wait_all(writes.pop_front().expect("in flight"))?;
                }
            }
            while let Some(w) = writes.pop_front() {
                waited += wait_all(w)?;
            }
            Ok(())
        };
        let r = run();
        // Every move the step started has ended when it returns, also
        // after a failure (the pages are then whole where they landed).
        for t in reads.into_iter().chain(writes).flatten() {
            let _ = t.wait();
        }
        r.map(|()| waited)
    }

    /// Starts moving one group's pages (the three arrays, or the moments
    /// alone with `skip_weights`) into `tier`.
    fn move_group(
        &self,
        (l, pages): &(usize, Range<usize>),
        tier: Tier,
        skip_weights: bool,
    ) -> Vec<Ticket> {
        let bytes = (pages.start * self.page) as u64..(pages.end * self.page) as u64;
        self.lanes[*l]
            .arrays
            .iter()
            .skip(usize::from(skip_weights))
            .map(|a| a.prefetch(bytes.clone(), tier))
            .collect()
    }

    /// Reads state `which` (0 weights, 1 first moment, 2 second moment)
    /// into `out`, one value per parameter.
    pub(super) fn read(&self, which: usize, out: &mut [f32]) -> Result<()> {
        let chunk = self.page / 4;
        for lane in &self.lanes {
            let end = ((lane.first + lane.len) * chunk).min(out.len());
            lane.arrays[which].read_as(0, &mut out[lane.first * chunk..end])?;
        }
        Ok(())
    }

    /// Overwrites state `which` with `values`, one per parameter.
    pub(super) fn write(&self, which: usize, values: &[f32]) -> Result<()> {
        let chunk = self.page / 4;
        for lane in &self.lanes {
            let end = ((lane.first + lane.len) * chunk).min(values.len());
            lane.arrays[which].write_as(0, &values[lane.first * chunk..end])?;
        }
        Ok(())
    }
}

/// Pins every page of `lane` in the host tier, lent writable; adds the
/// nanoseconds it took to `pinning`.
fn pin_lane<'l>(
    lane: &'l mut Lane,
    page: usize,
    pinning: &std::sync::atomic::AtomicU64,
) -> Result<[ViewMut<'l>; 3]> {
    let t = Instant::now();
    let bytes = 0..(lane.len * page) as u64;
    let [w, m, v] = &mut lane.arrays;
    let views = [
        w.view_mut(bytes.clone(), WORK)?,
        m.view_mut(bytes.clone(), WORK)?,
        v.view_mut(bytes, WORK)?,
    ];
    let ns = t.elapsed().as_nanos() as u64;
    pinning.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    Ok(views)
}

/// Waits for every ticket; the time it took.
fn wait_all(tickets: Vec<Ticket>) -> Result<Duration> {
    let t = Instant::now();
    let mut first = Ok(());
    for ticket in tickets {
        if let Err(e) = ticket.wait() {
            first = first.and(Err(e));
        }
    }
    first.map(|()| t.elapsed())
}

/// The host tier's pages (free and used).
fn host_pages(rt: &Runtime) -> usize {
    rt.stats()
        .tiers
        .iter()
        .find(|t| t.tier == Tier::Host)
        .map_or(0, |t| (t.used_pages + t.free_pages) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::fault::Fault;
    use crate::io::IoOp;
    use crate::tier::{CxlConfig, CxlMode};

    const PAGE: usize = 4096;

    fn weights(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32 * 0.25).collect()
    }

    /// Every page of the states is in a tier of the runtime (clean copies
    /// beside them aside), none pinned.
    fn whole(rt: &Runtime, pages: u32) {
        let s = rt.stats();
        let held = |t: &crate::runtime::TierStats| u64::from(t.used_pages) - t.clean_copies;
        assert_eq!(s.tiers.iter().map(held).sum::<u64>(), u64::from(pages));
        assert!(s.tiers.iter().all(|t| t.pinned_pages == 0), "{:?}", s.tiers);
    }

    /// Adds 1 to every element of the chunks an update is given.
    fn add_one(batch: Vec<(usize, [&mut [f32]; 3], &mut ())>) -> Result<()> {
        for (_, [w, _, _], ()) in batch {
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(())
    }

    /// An update that fails part-way through a streamed step leaves every
    /// page in the runtime, unpinned, and the chunks before it updated;
    /// the next step goes through.
    #[test]
    fn a_failed_update_leaves_every_page_in_the_runtime() {
        let rt = Runtime::builder()
            .page_size(PAGE)
            .host(16 * PAGE as u64)
            .cxl(CxlConfig::new(CxlMode::Emulated, 32 * PAGE as u64, PAGE))
            .background_eviction(false)
            .build()
            .unwrap();
        let n = 8 * PAGE / 4;
        let w0 = weights(n);
        let mut st = States::lay_out(rt.clone(), Tier::Cxl, &w0, 4).unwrap();
        assert_eq!(
            st.window().group,
            1,
            "the host tier takes one chunk per group"
        );
        let mut per_chunk = vec![(); 8];
        let seen = std::sync::atomic::AtomicUsize::new(0);
        let r = st.step(&mut per_chunk, false, false, &|batch| {
            if batch.iter().any(|(c, _, _)| *c == 5) {
                return Err(Error::invalid("injected"));
            }
            seen.fetch_add(batch.len(), std::sync::atomic::Ordering::Relaxed);
            add_one(batch)
        });
        assert!(r.is_err());
        assert_eq!(seen.into_inner(), 5);
        whole(&rt, 24);
        let mut back = vec![0f32; n];
        st.read(0, &mut back).unwrap();
        let cut = 5 * PAGE / 4;
        assert!(back[..cut].iter().zip(&w0).all(|(b, w)| *b == w + 1.0));
        assert_eq!(back[cut..], w0[cut..]);
        st.step(&mut per_chunk, false, false, &add_one).unwrap();
        st.read(0, &mut back).unwrap();
        assert!(back[cut..]
            .iter()
            .zip(&w0[cut..])
            .all(|(b, w)| *b == w + 1.0));
        whole(&rt, 24);
    }

    /// A step whose read of one array fails returns only once the reads of
    /// the group's other arrays have ended: no move outlives it.
    #[test]
    fn a_failed_read_returns_after_the_group_s_other_reads() {
        let dir = tempfile::tempdir().unwrap();
        let (rt, plan) = super::super::tests::faulty_runtime(dir.path());
        let w0 = weights(PAGE / 4);
        let mut st = States::lay_out(rt.clone(), Tier::Nvme, &w0, 4).unwrap();
        // One group: three reads, one per array, on two workers. The first
        // fails at once, the others are slow.
        plan.inject(IoOp::Read, 0, Fault::Errno(libc::EIO));
        for skip in 1..3 {
            plan.inject(IoOp::Read, skip, Fault::Delay(Duration::from_millis(200)));
        }
        let e = st.step(&mut [()], false, false, &add_one).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        whole(&rt, 3);
        assert_eq!(plan.injected(), 3);
        let mut back = vec![0f32; w0.len()];
        st.read(0, &mut back).unwrap();
        assert_eq!(back, w0);
        st.step(&mut [()], false, false, &add_one).unwrap();
        whole(&rt, 3);
    }

    /// A read from NVMe that fails leaves every page in the runtime,
    /// unpinned and as it was; the next step goes through.
    #[test]
    fn a_failed_read_leaves_every_page_in_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let (rt, plan) = super::super::tests::faulty_runtime(dir.path());
        let n = 6 * PAGE / 4 + 10;
        let w0 = weights(n);
        let mut st = States::lay_out(rt.clone(), Tier::Nvme, &w0, 4).unwrap();
        let mut per_chunk = vec![(); 7];
        plan.inject(IoOp::Read, 4, Fault::Errno(libc::EIO));
        assert!(st.step(&mut per_chunk, false, false, &add_one).is_err());
        assert_eq!(plan.injected(), 1);
        whole(&rt, 21);
        let mut back = vec![0f32; n];
        st.read(0, &mut back).unwrap();
        // The failed read's group was not updated; the ones before it were.
        let updated = back
            .iter()
            .zip(&w0)
            .filter(|(b, w)| **b == **w + 1.0)
            .count();
        let kept = back.iter().zip(&w0).filter(|(b, w)| b == w).count();
        assert_eq!(updated + kept, n);
        assert!(kept > 0);
        st.step(&mut per_chunk, false, false, &add_one).unwrap();
        whole(&rt, 21);
        st.read(0, &mut back).unwrap();
        assert!(back.iter().zip(&w0).all(|(b, w)| *b >= w + 1.0));
    }
}
