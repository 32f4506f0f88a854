//! The access-counter harvest on a GPU: `kernels/hotness.cu`, compiled
//! with NVRTC on first use and cached per context. Semantics (and the
//! shared test vectors) are those of [`crate::hotness`].

use super::context::Context;
use super::memory::DeviceBuffer;
use super::module::{Kernel, LaunchConfig};
use super::nvrtc;
use super::stream::Stream;
use crate::error::{Error, Result};
use crate::hotness::{Harvest, HarvestParams};

const SOURCE: &str = include_str!("../../../kernels/hotness.cu");

/// The kernels loaded from `hotness.cu` (checked against its PTX by
/// `tests/kernels.rs`).
pub const ENTRY_POINTS: &[&str] = &["strata_fold", "strata_histogram", "strata_collect"];

/// The harvest kernels of one context, and the stream they run on.
pub struct CudaHotness {
    stream: Stream,
    fold: Kernel,
    histogram: Kernel,
    collect: Kernel,
}

impl CudaHotness {
    /// The harvest kernels for `ctx` (the module compiled and loaded the
    /// first time, cached by the context), on a new stream.
    pub fn for_context(ctx: &Context) -> Result<Self> {
        let module = ctx.module("hotness.cu", || nvrtc::compile("hotness.cu", SOURCE))?;
        Ok(Self {
            stream: ctx.stream()?,
            fold: module.kernel("strata_fold")?,
            histogram: module.kernel("strata_histogram")?,
            collect: module.kernel("strata_collect")?,
        })
    }

    /// The stream the kernels run on (for uploads in tests and callers).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Folds `counts` into `scores` (clearing the counts) and returns the
    /// lists; `resident[p]` is nonzero for pages in device memory.
    pub fn harvest(
        &self,
        counts: &mut DeviceBuffer<u32>,
        scores: &mut DeviceBuffer<f32>,
        resident: &DeviceBuffer<u8>,
        params: HarvestParams,
    ) -> Result<Harvest> {
        params.check()?;
        let n = counts.len();
        if n == 0 {
            return Ok(Harvest::default());
        }
        if scores.len() != n || resident.len() != n {
            return Err(Error::invalid(
                "counts, scores and residency differ in length",
            ));
        }
        if n as u64 > u32::MAX as u64 {
            return Err(Error::invalid("a harvest covers at most 2^32 pages"));
        }
        let s = &self.stream;
        let mut hot = s.alloc_zeros::<u64>(n)?;
        let mut cold = s.alloc_zeros::<u64>(n)?;
        let n64 = n as u64;
        let scale = (1u64 << params.shift) as f32;
        let cfg = LaunchConfig::for_num_elems(n as u32);
        let mut fold = s.launch(&self.fold);
        fold.arg(counts)
            .arg(scores)
            .arg(resident)
            .arg(&n64)
            .arg(&params.decay)
            .arg(&scale)
            .arg(&mut hot)
            .arg(&mut cold);
        // SAFETY: the argument list matches strata_fold's signature; every
        // buffer holds `n` elements and the grid covers `n` threads.
        unsafe { fold.launch(cfg)? };
        Ok(Harvest {
            hot: self
                .select(&hot, params.k)?
                .into_iter()
                .map(|k| (page_of(k), f32::from_bits((k >> 32) as u32)))
                .collect(),
            cold: self
                .select(&cold, params.k)?
                .into_iter()
                .map(|k| (page_of(k), f32::from_bits(!(k >> 32) as u32)))
                .collect(),
        })
    }

    /// The `k` largest nonzero keys, largest first.
    fn select(&self, keys: &DeviceBuffer<u64>, k: usize) -> Result<Vec<u64>> {
        // No more than the keys there are (n fits u32: checked by harvest).
        let k = k.min(keys.len());
        if k == 0 {
            return Ok(Vec::new());
        }
        let s = &self.stream;
        let n = keys.len() as u64;
        let (mut prefix, mut mask, mut remaining) = (0u64, 0u64, k as u64);
        let mut threshold = 1u64; // fewer than k candidates: all of them
        let mut hist = s.alloc_zeros::<u32>(256)?;
        for digit in (0..8u32).rev() {
            let shift = digit * 8;
            s.memset_zeros(&mut hist)?;
            let mut b = s.launch(&self.histogram);
            b.arg(keys)
                .arg(&n)
                .arg(&prefix)
                .arg(&mask)
                .arg(&shift)
                .arg(&mut hist);
            let cfg = LaunchConfig {
                grid_dim: (((n as u32).div_ceil(256)).clamp(1, 1024), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches strata_histogram's signature; `hist` has 256
            // entries, the kernel strides over all `n` keys.
            unsafe { b.launch(cfg)? };
            let h: Vec<u32> = s.clone_dtoh(&hist)?;
            if digit == 7 && h.iter().map(|&c| c as u64).sum::<u64>() <= remaining {
                break;
            }
            let mut above = 0u64;
            let mut chosen = 0u64;
            for d in (0..256usize).rev() {
                if above + h[d] as u64 >= remaining {
                    chosen = d as u64;
                    break;
                }
                above += h[d] as u64;
            }
            remaining -= above;
            prefix |= chosen << shift;
            mask |= 0xFFu64 << shift;
            threshold = prefix;
        }
        let capacity = k as u32;
        let mut out = s.alloc_zeros::<u64>(k)?;
        let mut count = s.alloc_zeros::<u32>(1)?;
        let mut b = s.launch(&self.collect);
        b.arg(keys)
            .arg(&n)
            .arg(&threshold)
            .arg(&mut out)
            .arg(&capacity)
            .arg(&mut count);
        // SAFETY: matches strata_collect's signature; `out` holds `capacity`
        // keys and the kernel writes no more.
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32))? };
        let found = s.clone_dtoh(&count)?[0];
        let mut keys = s.clone_dtoh(&out)?;
        keys.truncate((found as usize).min(k));
        keys.sort_unstable_by(|a, b| b.cmp(a));
        Ok(keys)
    }
}

fn page_of(key: u64) -> u64 {
    0xFFFF_FFFF - (key & 0xFFFF_FFFF)
}
