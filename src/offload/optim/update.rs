//! Where the element-wise update runs ([`Updater`]): the CPU (a loop the
//! compiler vectorizes, the chunks of a batch over rayon's threads) or a
//! GPU (`kernels/adam.cu` through `device::cuda_adam`, the chunks of a
//! batch in one pipeline of tiles). Both apply [`crate::adam`]'s update
//! in the same order of operations, so they give bitwise the same state;
//! the state path that hands them chunks is the same for both.
#![forbid(unsafe_code)]

use std::borrow::Cow;

use rayon::prelude::*;

use super::precision::Element;
use super::window::{Resident, StepPlan};
use super::Updater;
use crate::adam::{adam_update, adam_update_into, adam_update_with, StepScalars};
use crate::error::Result;

#[cfg(feature = "cuda")]
pub(super) type Gpu = crate::device::cuda_adam::CudaAdam;

/// Without the `cuda` feature there is never a GPU updater.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub(super) enum Gpu {}

/// The GPU `updater` asks for, opened (`None` for the CPU).
pub(super) fn open_gpu(updater: Updater) -> Result<Option<Gpu>> {
    match updater {
        Updater::Cpu => Ok(None),
        #[cfg(feature = "cuda")]
        Updater::Cuda => Ok(Some(Gpu::new(0)?)),
        #[cfg(not(feature = "cuda"))]
        Updater::Cuda => Err(crate::error::Error::new(
            crate::error::ErrorKind::NoDevice,
            "no CUDA device: strata was built without the cuda feature",
        )),
    }
}

/// The GPU's description ("GPU 0 (name)").
pub(super) fn describe(gpu: &Gpu) -> String {
    #[cfg(feature = "cuda")]
    {
        gpu.description()
    }
    #[cfg(not(feature = "cuda"))]
    {
        match *gpu {}
    }
}

/// Equal-length state arrays and their gradients.
pub(super) struct Arrays<'a> {
    pub(super) w: &'a mut [f32],
    pub(super) m: &'a mut [f32],
    pub(super) v: &'a mut [f32],
    pub(super) g: &'a [f32],
}

/// Updates every set of `arrays`, on the GPU if there is one.
pub(super) fn update_arrays(
    gpu: Option<&mut Gpu>,
    s: &StepScalars,
    arrays: Vec<Arrays<'_>>,
) -> Result<()> {
    match gpu {
        #[cfg(feature = "cuda")]
        Some(gpu) => gpu.update(
            s,
            arrays
                .into_iter()
                .map(|a| crate::device::cuda_adam::Chunk {
                    w: a.w,
                    m: a.m,
                    v: a.v,
                    g: a.g,
                })
                .collect(),
        ),
        #[cfg(not(feature = "cuda"))]
        Some(gpu) => match *gpu {},
        None => {
            arrays
                .into_par_iter()
                .for_each(|a| adam_update(a.w, a.m, a.v, a.g, s));
            Ok(())
        }
    }
}

/// What one chunk's update leaves besides its state: on a flush its next
/// resident set; its new weights in the caller's array, in the caller's
/// element type (empty unless asked).
pub(super) struct Outcome<'a, W> {
    /// The chunk's gradient accumulators (importance mode; else empty).
    pub(super) acc: &'a mut [f32],
    pub(super) chosen: Option<Resident>,
    pub(super) weights_out: &'a mut [W],
}

/// One chunk of a batch: its index, its weights and moments (in the
/// runtime's pages) and what its update leaves.
pub(super) type ChunkWork<'s, 'o, 'x, W> = (usize, [&'s mut [f32]; 3], &'x mut Outcome<'o, W>);

/// A step's update of a batch of chunks: the caller's gradients in their
/// own element type `G`, widened to fp32 (times `unscale`) chunk by chunk.
pub(super) struct StepUpdate<'a, G> {
    pub(super) s: StepScalars,
    pub(super) plan: StepPlan,
    pub(super) grads: &'a [G],
    pub(super) unscale: f32,
    /// The caller's weights are the master weights (an fp32 parameter
    /// over which the tier keeps only the moments): each chunk updates
    /// them in place instead of the tier's copy.
    pub(super) alias: bool,
    /// The resident sets of the window that ends (a flush), per chunk.
    pub(super) old: &'a [Resident],
}

impl<G: Element> StepUpdate<'_, G> {
    /// Updates the chunks of `batch`: each one's gradient (this step's, or
    /// a flush's), the update, then its next resident set and its new
    /// weights copied out while they are in cache.
    pub(super) fn run<W: Element>(
        &self,
        gpu: Option<&mut Gpu>,
        batch: Vec<ChunkWork<'_, '_, '_, W>>,
    ) -> Result<()> {
        let (plan, s) = (&self.plan, &self.s);
        let this_step = |c: usize| G::widen(&self.grads[plan.range(c)], self.unscale);
        let finish = |g: &[f32], [w, m, v]: [&mut [f32]; 3], out: &mut Outcome<'_, W>| {
            out.chosen = plan.choose(g, w, m, v);
            let n = out.weights_out.len();
            W::narrow(&w[..n], out.weights_out);
        };
        let Some(gpu) = gpu else {
            // One pass per chunk, the chunks over the CPU's threads.
            batch.into_par_iter().for_each(|(c, [w, m, v], out)| {
                if plan.flush.is_none() && (self.alias || (G::IN_LOOP && W::IN_LOOP)) {
                    // A plain step: the gradients widened as the update
                    // reads them.
                    let g = &self.grads[plan.range(c)];
                    let u = self.unscale;
                    if self.alias {
                        // The caller's fp32 weights are the master: one
                        // pass, no copy (the tier's weights stay as laid out).
                        let w = W::as_f32_mut(out.weights_out)
                            .expect("an aliased step has fp32 weights");
                        if u == 1.0 {
                            adam_update_with(w, m, v, g, G::to_f32, s);
                        } else {
                            adam_update_with(w, m, v, g, |x| x.to_f32() * u, s);
                        }
                        return;
                    }
                    // The parameter rounded from its master in the same pass.
                    let o = &mut *out.weights_out;
                    if u == 1.0 {
                        adam_update_into(w, m, v, g, G::to_f32, o, W::from_f32, s);
                    } else {
                        adam_update_into(w, m, v, g, |x| x.to_f32() * u, o, W::from_f32, s);
                    }
                    return;
                }
                let g = this_step(c);
                let eff = plan.gradient(
                    Cow::Borrowed(&g[..]),
                    [&mut *w, &mut *m, &mut *v],
                    out.acc,
                    self.old.get(c),
                );
                let n = eff.len();
                adam_update(&mut w[..n], &mut m[..n], &mut v[..n], &eff, s);
                finish(&g, [w, m, v], out);
            });
            return Ok(());
        };
        // The GPU takes the whole batch in one pipeline.
        let mut batch = batch;
        let gs: Vec<_> = batch.iter().map(|(c, _, _)| this_step(*c)).collect();
        let effs: Vec<_> = batch
            .iter_mut()
            .zip(&gs)
            .map(|((c, [w, m, v], out), g)| {
                plan.gradient(
                    Cow::Borrowed(&g[..]),
                    [&mut **w, &mut **m, &mut **v],
                    out.acc,
                    self.old.get(*c),
                )
            })
            .collect();
        let arrays = batch
            .iter_mut()
            .zip(&effs)
            .map(|((_, [w, m, v], _), g)| {
                let n = g.len();
                Arrays {
                    w: &mut w[..n],
                    m: &mut m[..n],
                    v: &mut v[..n],
                    g,
                }
            })
            .collect();
        update_arrays(Some(gpu), s, arrays)?;
        for ((_, state, out), g) in batch.into_iter().zip(&gs) {
            finish(g, state, out);
        }
        Ok(())
    }
}
