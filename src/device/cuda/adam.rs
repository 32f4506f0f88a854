//! The offloaded Adam's update on a GPU: `kernels/adam.cu`, compiled with
//! NVRTC once per process. Semantics (bit for bit) are those of the CPU
//! update in [`crate::offload::optim`].
//!
//! The pipeline: the chunks of a call are cut into tiles of [`TILE`]
//! elements; two staging sets (pinned host memory, device memory, a
//! stream, an event) take turns. For tile k on set k mod 2 the host first
//! waits for tile k−2's results on that set and copies them into their
//! chunk, then copies tile k's inputs into the pinned buffers and queues
//! the uploads, the kernel and the downloads on the set's stream. So tile
//! k+1's upload overlaps tile k's kernel and tile k−1's download, and the
//! host's copies overlap both. Every tile's results are in its chunk when
//! [`CudaAdam::update`] returns, before the caller writes the chunk back.

use std::sync::OnceLock;

use super::context::Context;
use super::errors::no_device;
use super::memory::{DeviceBuffer, PinnedBuffer};
use super::module::{Kernel, LaunchConfig};
use super::nvrtc::{self, Ptx};
use super::stream::{Event, Stream};

use crate::adam::StepScalars;
use crate::error::{Error, ErrorKind, Result};

const SOURCE: &str = include_str!("../../../kernels/adam.cu");

/// The kernels loaded from `adam.cu` (checked against its PTX by
/// `tests/kernels.rs`).
pub const ENTRY_POINTS: &[&str] = &["strata_adam"];

/// Elements per tile (256 KiB per state array): the unit of the
/// double-buffered pipeline.
pub const TILE: usize = 64 << 10;

/// Staged arrays per set: weights, m, v, gradients.
const ARRAYS: usize = 4;
const W: usize = 0;
const M: usize = 1;
const V: usize = 2;
const G: usize = 3;
/// What a tile uploads, and what it downloads.
const UP: [usize; 4] = [W, M, V, G];
const DOWN: [usize; 3] = [W, M, V];

/// One chunk's state and gradients, all of the same length.
#[derive(Debug)]
pub struct Chunk<'a> {
    /// Master weights.
    pub w: &'a mut [f32],
    /// First moment.
    pub m: &'a mut [f32],
    /// Second moment.
    pub v: &'a mut [f32],
    /// Gradients.
    pub g: &'a [f32],
}

impl<'a> Chunk<'a> {
    fn check(&self) -> Result<()> {
        let n = self.w.len();
        if self.m.len() != n || self.v.len() != n || self.g.len() != n {
            return Err(Error::invalid(
                "a chunk's weights, moments and gradients differ in length",
            ));
        }
        Ok(())
    }

    /// Cuts the chunk into tiles of at most [`TILE`] elements.
    fn tiles(self, out: &mut Vec<Chunk<'a>>) {
        let Chunk {
            mut w,
            mut m,
            mut v,
            mut g,
        } = self;
        while w.len() > TILE {
            let (w0, w1) = w.split_at_mut(TILE);
            let (m0, m1) = m.split_at_mut(TILE);
            let (v0, v1) = v.split_at_mut(TILE);
            let (g0, g1) = g.split_at(TILE);
            out.push(Chunk {
                w: w0,
                m: m0,
                v: v0,
                g: g0,
            });
            (w, m, v, g) = (w1, m1, v1, g1);
        }
        if !w.is_empty() {
            out.push(Chunk { w, m, v, g });
        }
    }
}

/// The PTX of `adam.cu`, compiled on first use.
fn ptx() -> Result<Ptx> {
    static PTX: OnceLock<String> = OnceLock::new();
    if let Some(src) = PTX.get() {
        return Ok(Ptx::from_src(src.clone()));
    }
    let src = nvrtc::compile("adam.cu", SOURCE)?.to_src();
    Ok(Ptx::from_src(PTX.get_or_init(|| src).clone()))
}

/// One staging set: `ARRAYS × TILE` floats of pinned host memory and of
/// device memory, the stream its work runs on, and an event recorded after
/// its last download.
struct Set {
    stream: Stream,
    done: Event,
    host: PinnedBuffer<f32>,
    dev: DeviceBuffer<f32>,
}

impl Set {
    fn new(ctx: &Context) -> Result<Self> {
        Ok(Self {
            stream: ctx.stream()?,
            done: ctx.event()?,
            // Not write-combined: the host reads the results back.
            host: PinnedBuffer::new(ctx, ARRAYS * TILE)?,
            dev: DeviceBuffer::alloc(ctx, ARRAYS * TILE)?,
        })
    }

    /// Stages `tile`'s inputs and queues its uploads, kernel and downloads.
    ///
    /// # Safety
    /// The set's previous work has completed (its results were taken by
    /// [`finish`](Self::finish), or the stream was synchronized).
    unsafe fn submit(&mut self, tile: &Chunk<'_>, s: &StepScalars, k: &Kernels) -> Result<()> {
        let n = tile.w.len();
        debug_assert!(n <= TILE);
        let dev: [u64; ARRAYS] =
            std::array::from_fn(|a| self.dev.device_address() + (a * TILE * 4) as u64);
        let (stream, buffer) = (&self.stream, &self.dev);
        // No copy touches the staging memory: this function's contract.
        let h = &mut self.host[..];
        h[W * TILE..W * TILE + n].copy_from_slice(tile.w);
        h[M * TILE..M * TILE + n].copy_from_slice(tile.m);
        h[V * TILE..V * TILE + n].copy_from_slice(tile.v);
        h[G * TILE..G * TILE + n].copy_from_slice(tile.g);
        for a in UP {
            let src = &h[a * TILE..a * TILE + n];
            // SAFETY: `src` is pinned and stays allocated and untouched by
            // the host until the set's event completes (the contract of
            // `submit`: the next host access comes after `finish` or a
            // synchronize); the destination is this set's alone.
            unsafe { stream.upload_async(src, buffer, a * TILE)? };
        }
        let (w, m, v, g) = (dev[W], dev[M], dev[V], dev[G]);
        let n32 = n as u32;
        let p = &s.p;
        let cfg = LaunchConfig::for_num_elems(n32);
        let mut b = stream.launch(&k.plain);
        b.arg(&w).arg(&m).arg(&v).arg(&g).arg(&n32);
        b.arg(&p.beta1).arg(&p.beta2).arg(&p.eps);
        b.arg(&s.step_size).arg(&s.bc2_rsqrt).arg(&s.decay);
        // SAFETY: the arguments match strata_adam's signature; the four
        // arrays hold `n` floats each in this set's device memory, which
        // lives as long as the set (whose drop waits for its stream), and
        // the kernel touches no element at or past `n`.
        unsafe { b.launch(cfg)? };
        for a in DOWN {
            let dst = &mut h[a * TILE..a * TILE + n];
            // SAFETY: as for the uploads; the host reads `dst` only after
            // the event recorded below has completed.
            unsafe { stream.download_async(buffer, a * TILE, dst)? };
        }
        self.done.record(stream)
    }

    /// Waits for `tile`'s results and copies them into it.
    fn finish(&mut self, tile: Chunk<'_>) -> Result<()> {
        // The event recorded after this set's last download has completed
        // on return, so no copy touches the staging memory.
        self.done.synchronize()?;
        let n = tile.w.len();
        let h = &self.host[..];
        tile.w.copy_from_slice(&h[W * TILE..W * TILE + n]);
        tile.m.copy_from_slice(&h[M * TILE..M * TILE + n]);
        tile.v.copy_from_slice(&h[V * TILE..V * TILE + n]);
        Ok(())
    }

    /// Waits for everything queued on the set (after a failure).
    fn quiesce(&self) {
        self.stream.synchronize_quietly();
    }
}

impl Drop for Set {
    fn drop(&mut self) {
        // The staging memory and device memory free themselves after this:
        // nothing may still copy into them.
        self.quiesce();
    }
}

struct Kernels {
    plain: Kernel,
}

/// The Adam update on GPU `ordinal`: the kernels and two staging sets.
pub struct CudaAdam {
    kernels: Kernels,
    sets: [Set; 2],
    name: String,
}

impl std::fmt::Debug for CudaAdam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaAdam({})", self.description())
    }
}

impl CudaAdam {
    /// Opens GPU `ordinal` and compiles the kernels (NVRTC). `NoDevice`
    /// ("no CUDA device: …") without a driver, a GPU or NVRTC.
    pub fn new(ordinal: usize) -> Result<Self> {
        let none = |e: Error| match e.kind() {
            ErrorKind::NoDevice => no_device(format!("no CUDA device: {e}")),
            _ => e,
        };
        let ctx = Context::open(ordinal).map_err(none)?;
        let ptx = ptx().map_err(none)?;
        let module = ctx.module("adam.cu", || Ok(ptx))?;
        let kernels = Kernels {
            plain: module.kernel(ENTRY_POINTS[0])?,
        };
        let sets = [Set::new(&ctx)?, Set::new(&ctx)?];
        Ok(Self {
            name: format!("GPU {ordinal} ({})", ctx.name()),
            kernels,
            sets,
        })
    }

    /// "GPU 0 (name)".
    pub fn description(&self) -> String {
        self.name.clone()
    }

    /// Updates `chunks` in place with the step's scalars; every result is
    /// in its chunk on return. After an error some tiles may be updated
    /// and others not.
    pub fn update(&mut self, s: &StepScalars, chunks: Vec<Chunk<'_>>) -> Result<()> {
        let mut tiles = Vec::new();
        for c in chunks {
            c.check()?;
            c.tiles(&mut tiles);
        }
        let (sets, kernels) = (&mut self.sets, &self.kernels);
        let mut pending: [Option<Chunk<'_>>; 2] = [None, None];
        let r = (|| -> Result<()> {
            for (k, tile) in tiles.into_iter().enumerate() {
                let i = k % 2;
                if let Some(done) = pending[i].take() {
                    sets[i].finish(done)?;
                }
                // SAFETY: the set's previous tile was finished just above
                // (its event completed), or it has run nothing since the
                // last call, which ended with every set finished or
                // quiesced.
                unsafe { sets[i].submit(&tile, s, kernels)? };
                pending[i] = Some(tile);
            }
            for i in [0, 1] {
                if let Some(done) = pending[i].take() {
                    sets[i].finish(done)?;
                }
            }
            Ok(())
        })();
        if r.is_err() {
            // Nothing may still be copying into the staging memory when
            // the next call writes it.
            for set in sets.iter() {
                set.quiesce();
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_the_chunk_in_order() {
        let n = 2 * TILE + 5;
        let (mut w, mut m, mut v) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let g: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let chunk = Chunk {
            w: &mut w,
            m: &mut m,
            v: &mut v,
            g: &g,
        };
        chunk.check().unwrap();
        let mut tiles = Vec::new();
        chunk.tiles(&mut tiles);
        assert_eq!(
            tiles.iter().map(|t| t.w.len()).collect::<Vec<_>>(),
            [TILE, TILE, 5]
        );
        for (k, t) in tiles.iter_mut().enumerate() {
            t.check().unwrap();
            assert_eq!(t.g[0], (k * TILE) as f32);
            t.w.fill(k as f32 + 1.0);
            t.v.fill(k as f32 + 2.0);
        }
        drop(tiles);
        assert_eq!((w[0], w[TILE], w[n - 1]), (1.0, 2.0, 3.0));
        assert_eq!((v[0], v[TILE], v[n - 1]), (2.0, 3.0, 4.0));
        let mut none = Vec::new();
        let (mut e1, mut e2, mut e3) = (vec![], vec![], vec![]);
        Chunk {
            w: &mut e1,
            m: &mut e2,
            v: &mut e3,
            g: &[],
        }
        .tiles(&mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn unequal_lengths_are_refused() {
        let (mut w, mut m, mut v) = (vec![0f32; 4], vec![0f32; 4], vec![0f32; 3]);
        let c = Chunk {
            w: &mut w,
            m: &mut m,
            v: &mut v,
            g: &[0.0; 4],
        };
        assert_eq!(c.check().unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}
