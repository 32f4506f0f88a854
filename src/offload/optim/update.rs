//! Where the element-wise update runs ([`Updater`]): the CPU (a loop the
//! compiler vectorizes, the chunks of a batch over rayon's threads) or a
//! GPU (`kernels/adam.cu` through `device::cuda_adam`, the chunks of a
//! batch in one pipeline of tiles). Both apply [`crate::adam`]'s update
//! in the same order of operations, so they give bitwise the same state;
//! the state path that hands them chunks is the same for both.
#![forbid(unsafe_code)]

use rayon::prelude::*;

use super::window::{Resident, StepPlan};
use super::Updater;
use crate::adam::{adam_update, StepScalars};
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
/// resident set; its new weights in the caller's array (empty unless
/// asked).
pub(super) struct Outcome<'a> {
    /// The chunk's gradient accumulators (importance mode; else empty).
    pub(super) acc: &'a mut [f32],
    pub(super) chosen: Option<Resident>,
    pub(super) weights_out: &'a mut [f32],
}

/// One chunk of a batch: its index, its weights and moments (in the
/// runtime's pages) and what its update leaves.
pub(super) type ChunkWork<'s, 'o, 'x> = (usize, [&'s mut [f32]; 3], &'x mut Outcome<'o>);

/// A step's update of a batch of chunks.
pub(super) struct StepUpdate<'a> {
    pub(super) s: StepScalars,
    pub(super) plan: StepPlan,
    pub(super) grads: &'a [f32],
    /// The resident sets of the window that ends (a flush), per chunk.
    pub(super) old: &'a [Resident],
}

impl StepUpdate<'_> {
    /// Updates the chunks of `batch`: each one's gradient (this step's, or
    /// a flush's), the update, then its next resident set and its new
    /// weights copied out while they are in cache.
    pub(super) fn run(
        &self,
        gpu: Option<&mut Gpu>,
        batch: Vec<ChunkWork<'_, '_, '_>>,
    ) -> Result<()> {
        let (plan, grads, s) = (&self.plan, self.grads, &self.s);
        let finish = |c: usize, [w, m, v]: [&mut [f32]; 3], out: &mut Outcome<'_>| {
            out.chosen = plan.choose(c, grads, w, m, v);
            let n = out.weights_out.len();
            out.weights_out.copy_from_slice(&w[..n]);
        };
        let Some(gpu) = gpu else {
            // One pass per chunk, the chunks over the CPU's threads.
            batch.into_par_iter().for_each(|(c, [w, m, v], out)| {
                let g = plan.gradient(
                    c,
                    grads,
                    [&mut *w, &mut *m, &mut *v],
                    out.acc,
                    self.old.get(c),
                );
                let n = g.len();
                adam_update(&mut w[..n], &mut m[..n], &mut v[..n], &g, s);
                finish(c, [w, m, v], out);
            });
            return Ok(());
        };
        // The GPU takes the whole batch in one pipeline.
        let mut batch = batch;
        let gs: Vec<_> = batch
            .iter_mut()
            .map(|(c, [w, m, v], out)| {
                plan.gradient(
                    *c,
                    grads,
                    [&mut **w, &mut **m, &mut **v],
                    out.acc,
                    self.old.get(*c),
                )
            })
            .collect();
        let arrays = batch
            .iter_mut()
            .zip(&gs)
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
        for (c, state, out) in batch {
            finish(c, state, out);
        }
        Ok(())
    }
}
