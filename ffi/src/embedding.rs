//! The tiered embedding table (`strata::offload::embedding`): rows of a
//! table in a buffer of a runtime, pooled gathers in `nn.EmbeddingBag`'s
//! form, and the fused SGD and row-wise Adagrad updates.
#![allow(non_camel_case_types)]

use std::ffi::c_int;

use strata::offload::embedding::{
    Bags, EmbeddingError, EmbeddingTable, Lookups, Pooling, RowCacheOptions, TableOptions,
};
use strata::Placement;

use crate::cast::{self, SetOpt};
use crate::enums::{self, strata_policy, strata_tier};
use crate::handle::Handles;
use crate::objects::{self, Handle};
use crate::status::{boundary, Fail, R, STRATA_OK};

/// A tiered embedding table. Opaque; made by `strata_embedding_create`,
/// `strata_embedding_create_in` or `strata_embedding_create_cached`, ended
/// by `strata_embedding_free`.
pub struct strata_embedding {
    _opaque: [u8; 0],
}

pub(crate) static EMBEDDINGS: Handles<EmbeddingTable> = Handles::new(10, "embedding table");

impl Handle for strata_embedding {
    type Obj = EmbeddingTable;
    fn table() -> &'static Handles<EmbeddingTable> {
        &EMBEDDINGS
    }
}

impl From<EmbeddingError> for Fail {
    fn from(e: EmbeddingError) -> Self {
        Fail::from(strata::Error::from(e))
    }
}

/// How a bag's rows are combined (`STRATA_POOLING_*`).
pub type strata_pooling = i32;
/// The (weighted) sum of the bag's rows.
pub const STRATA_POOLING_SUM: strata_pooling = 0;
/// The (weighted) sum divided by the number of rows pooled.
pub const STRATA_POOLING_MEAN: strata_pooling = 1;

/// The bags of one gather (`strata_embedding_forward`), in
/// `torch.nn.EmbeddingBag`'s form.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct strata_bags {
    /// Row indices of all bags, one after another (NULL when
    /// `num_indices` is 0).
    pub indices: *const i64,
    /// Indices at `indices`.
    pub num_indices: usize,
    /// Bag `b` is `indices[offsets[b]]` up to `indices[offsets[b + 1]]`:
    /// one entry more than the bags, from 0 to `num_indices`, never
    /// decreasing (an empty bag pools to zeros).
    pub offsets: *const i64,
    /// Entries at `offsets` (the bags plus one).
    pub num_offsets: usize,
    /// One weight per index, multiplying its row; NULL for none.
    pub weights: *const f32,
    /// `STRATA_POOLING_SUM` or `STRATA_POOLING_MEAN`.
    pub pooling: strata_pooling,
    /// Indices equal to this are left out (of a mean's count too); a
    /// negative value leaves none out.
    pub padding_idx: i64,
}

/// Lookups of a gather, or of a table since it was made or its stats were
/// reset (`strata_embedding_forward`, `strata_embedding_get_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct strata_embedding_stats {
    /// Row lookups (padding included).
    pub lookups: u64,
    /// Those whose row was in the runtime's fastest tier when gathered
    /// (the row cache's hits among them).
    pub fast_hits: u64,
    /// Those served from the table's row cache (0 without one).
    pub cache_hits: u64,
    /// Missed rows the row cache took in.
    pub cache_fills: u64,
}

impl From<Lookups> for strata_embedding_stats {
    fn from(l: Lookups) -> Self {
        Self {
            lookups: l.lookups,
            fast_hits: l.fast_hits,
            cache_hits: l.cache_hits,
            cache_fills: l.cache_fills,
        }
    }
}

fn create(
    rt: *const objects::strata_runtime,
    rows: u64,
    dim: usize,
    placement: Placement,
    threads: usize,
    row_cache: Option<RowCacheOptions>,
    out: cast::Out<*mut strata_embedding>,
) -> R {
    let runtime = objects::get(rt)?;
    let options = TableOptions {
        placement,
        threads,
        row_cache,
    };
    let table = EmbeddingTable::with_options(&runtime.rt, rows, dim, options)?;
    // Not a runtime's child: owner 0 is never swept.
    let bits = EMBEDDINGS.insert(table, 0)?;
    out.set(objects::ptr(bits));
    Ok(STRATA_OK)
}

/// Creates an embedding table of `rows` rows of `dim` floats in a buffer
/// of `rt` (row `r` at byte `r * dim * 4`; pages go to the fastest tier
/// with room when first written, rows read as zeros before) and stores its
/// handle in `*out`; free it with `strata_embedding_free`. `threads`
/// (1–1024) worker threads read pages and apply updates: the NVMe reads a
/// gather keeps in flight. The table keeps the runtime alive until it is
/// freed; `strata_runtime_destroy` does not free it. Thread-safe: every
/// call on a table may run from several threads at once (updates of the
/// same rows at once leave either's result).
///
/// # Safety
/// `out` is NULL or points to a writable `strata_embedding *`.
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_create(
    rt: *const objects::strata_runtime,
    rows: u64,
    dim: usize,
    threads: usize,
    out: *mut *mut strata_embedding,
) -> c_int {
    boundary("strata_embedding_create", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(out, "out") }?;
        create(rt, rows, dim, Placement::Fastest, threads, None, out)
    })
}

/// As `strata_embedding_create`, but the rows' pages go to `preferred`
/// while it has room (then to the fastest tier with room). The tier must
/// be configured.
///
/// # Safety
/// `out` is NULL or points to a writable `strata_embedding *`.
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_create_in(
    rt: *const objects::strata_runtime,
    rows: u64,
    dim: usize,
    preferred: strata_tier,
    threads: usize,
    out: *mut *mut strata_embedding,
) -> c_int {
    boundary("strata_embedding_create_in", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(out, "out") }?;
        let placement = Placement::Prefer(enums::tier(preferred)?);
        create(rt, rows, dim, placement, threads, None, out)
    })
}

/// As `strata_embedding_create_in`, with a row cache of `cache_rows` rows
/// (1 to 2^32 − 1) under `policy` (`STRATA_POLICY_*`; one that needs the
/// future, Belady or lookahead, is refused): the rows a gather reads most
/// are kept at their own granularity in the fastest memory tier — the
/// simulated device's, or host memory on a runtime without a device — in
/// whole pages held for the table's life, while the table's pages stay
/// where the runtime places them (`preferred` first). A missed row is
/// filled by its own read; rows written reach the table and the cached
/// copies, an update of a cached row stays in the cache until the row
/// leaves it (a write-back cache: reads and gathers see it at once). A
/// row must fit in a page; a CUDA device is refused
/// with `STRATA_ERR_UNSUPPORTED` (the cache's kernel is not built), a
/// tier without room for the slots with `STRATA_ERR_OUT_OF_CAPACITY`.
/// `strata_embedding_stats` counts the cache's hits and fills.
///
/// # Safety
/// `out` is NULL or points to a writable `strata_embedding *`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn strata_embedding_create_cached(
    rt: *const objects::strata_runtime,
    rows: u64,
    dim: usize,
    preferred: strata_tier,
    threads: usize,
    cache_rows: usize,
    policy: strata_policy,
    out: *mut *mut strata_embedding,
) -> c_int {
    boundary("strata_embedding_create_cached", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(out, "out") }?;
        let placement = Placement::Prefer(enums::tier(preferred)?);
        let row_cache = RowCacheOptions {
            rows: cache_rows,
            policy: enums::policy(policy)?,
        };
        create(rt, rows, dim, placement, threads, Some(row_cache), out)
    })
}

/// Ends an embedding table: its handle is dead at once, its rows' pages
/// are freed once calls running on it end. NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_embedding_free(emb: *mut strata_embedding) -> c_int {
    boundary("strata_embedding_free", || {
        drop(objects::remove(emb)?);
        Ok(STRATA_OK)
    })
}

/// Stores the table's rows in `*rows` and floats per row in `*dim` (either
/// may be NULL). Thread-safe.
///
/// # Safety
/// `rows` and `dim` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_shape(
    emb: *const strata_embedding,
    rows: *mut u64,
    dim: *mut usize,
) -> c_int {
    boundary("strata_embedding_shape", || {
        // SAFETY: NULL or writable (this function's contract).
        let (r, d) = unsafe { (cast::out_opt(rows, "rows")?, cast::out_opt(dim, "dim")?) };
        let (n, k) = objects::with(emb, |t| (t.rows(), t.dim()))?;
        r.set(n);
        d.set(k);
        Ok(STRATA_OK)
    })
}

/// Writes the `len` floats at `data` (a whole number of rows) as rows
/// `start`, `start + 1`, …; rows outside the table are
/// `STRATA_ERR_INVALID_ARGUMENT` and nothing is written. Thread-safe.
///
/// # Safety
/// `data` points to `len` readable floats that no one writes during the
/// call (NULL when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_write_rows(
    emb: *const strata_embedding,
    start: i64,
    data: *const f32,
    len: usize,
) -> c_int {
    boundary("strata_embedding_write_rows", || {
        // SAFETY: as this function's contract states.
        let src = unsafe { cast::slice(data, len, "data") }?;
        let t = objects::get(emb)?;
        // Memory strata lent out (a pin's addresses) as the source goes
        // through a copy (EmbeddingTable::write_rows).
        t.write_rows(start, src)?;
        Ok(STRATA_OK)
    })
}

/// Reads the rows of the `n` indices at `indices` into `out` (`out_len`
/// floats: `n * dim`). Not counted in the table's stats. An index outside
/// the table or a wrong `out_len` is `STRATA_ERR_INVALID_ARGUMENT`, with
/// `out` untouched. Thread-safe.
///
/// # Safety
/// `indices` points to `n` readable `int64_t`s, `out` to `out_len`
/// writable floats that no one else uses during the call (NULL for a
/// length of 0).
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_read_rows(
    emb: *const strata_embedding,
    indices: *const i64,
    n: usize,
    out: *mut f32,
    out_len: usize,
) -> c_int {
    boundary("strata_embedding_read_rows", || {
        cast::disjoint(
            &[cast::region(out, out_len, "out")],
            &[cast::region(indices, n, "indices")],
        )?;
        // SAFETY: as this function's contract states (the two apart:
        // checked above).
        let (idx, dst) = unsafe {
            (
                cast::slice(indices, n, "indices")?,
                cast::slice_mut(out, out_len, "out")?,
            )
        };
        objects::get(emb)?.read_rows(idx, dst)?;
        Ok(STRATA_OK)
    })
}

/// The library's bags from the C struct.
///
/// # Safety
/// The struct's pointers are as `strata_bags` documents.
unsafe fn bags<'a>(b: &strata_bags) -> R<Bags<'a>> {
    let pooling = match b.pooling {
        STRATA_POOLING_SUM => Pooling::Sum,
        STRATA_POOLING_MEAN => Pooling::Mean,
        p => {
            return Err(Fail::invalid(format!(
                "unknown pooling {p} (use STRATA_POOLING_SUM or _MEAN)"
            )))
        }
    };
    // SAFETY: forwarded from the caller.
    let (indices, offsets) = unsafe {
        (
            cast::slice(b.indices, b.num_indices, "bags->indices")?,
            cast::slice(b.offsets, b.num_offsets, "bags->offsets")?,
        )
    };
    let mut bags = Bags::new(indices, offsets)
        .pooling(pooling)
        .padding_idx((b.padding_idx >= 0).then_some(b.padding_idx));
    if !b.weights.is_null() {
        // SAFETY: forwarded from the caller: `num_indices` readable floats.
        bags = bags.weights(unsafe { cast::slice(b.weights, b.num_indices, "bags->weights") }?);
    }
    Ok(bags)
}

/// Pools the bags `*bags` into `out` (`out_len` floats: one row of `dim`
/// per bag), reading each row from wherever its page lives (NVMe pages,
/// and memory pages that enough lookups share, read whole once, in
/// parallel on the table's threads); stores the call's lookups in
/// `*stats` if not NULL (they also add to the table's). An index outside
/// the table, malformed offsets, a bad pooling or a wrong `out_len` is
/// `STRATA_ERR_INVALID_ARGUMENT`, refused before anything is read:
/// `out` and the stats are untouched. Thread-safe.
///
/// # Safety
/// `bags` points to a readable `strata_bags` whose arrays are readable
/// for their lengths (`weights` NULL or `num_indices` floats) and
/// unchanged during the call; `out` points to `out_len` writable floats
/// no one else uses during the call; `stats` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_forward(
    emb: *const strata_embedding,
    bags: *const strata_bags,
    out: *mut f32,
    out_len: usize,
    stats: *mut strata_embedding_stats,
) -> c_int {
    boundary("strata_embedding_forward", || {
        // SAFETY: as this function's contract states.
        let b = unsafe { cast::read_in(bags, "bags") }?;
        cast::disjoint(
            &[
                cast::region(out, out_len, "out"),
                cast::region(stats, 1, "stats"),
            ],
            &[
                cast::region(b.indices, b.num_indices, "bags->indices"),
                cast::region(b.offsets, b.num_offsets, "bags->offsets"),
                cast::region(b.weights, b.num_indices, "bags->weights"),
            ],
        )?;
        // SAFETY: as this function's contract states (the output apart
        // from the inputs: checked above).
        let (b, dst, stats) = unsafe {
            (
                self::bags(&b)?,
                cast::slice_mut(out, out_len, "out")?,
                cast::out_opt(stats, "stats")?,
            )
        };
        let l = objects::get(emb)?.gather(&b, dst)?;
        stats.set(l.into());
        Ok(STRATA_OK)
    })
}

/// The rows and gradients of a fused update.
///
/// # Safety
/// As the update functions' contracts state.
unsafe fn update_args<'a>(
    rows: *const i64,
    n: usize,
    grads: *const f32,
    grads_len: usize,
) -> R<(&'a [i64], &'a [f32])> {
    // SAFETY: forwarded from the caller.
    unsafe {
        Ok((
            cast::slice(rows, n, "rows")?,
            cast::slice(grads, grads_len, "grads")?,
        ))
    }
}

/// SGD on the `n` distinct rows at `rows` with their gradients at `grads`
/// (`grads_len` floats: `n * dim`, row by row): `w -= lr * g`, written
/// back in place. A row outside the table or repeated, a wrong
/// `grads_len` or a non-finite `lr` is `STRATA_ERR_INVALID_ARGUMENT`, and
/// no row changes. Thread-safe.
///
/// # Safety
/// `rows` points to `n` readable `int64_t`s and `grads` to `grads_len`
/// readable floats, unchanged during the call (NULL for a length of 0).
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_sgd(
    emb: *const strata_embedding,
    rows: *const i64,
    n: usize,
    grads: *const f32,
    grads_len: usize,
    lr: f32,
) -> c_int {
    boundary("strata_embedding_sgd", || {
        // SAFETY: as this function's contract states.
        let (r, g) = unsafe { update_args(rows, n, grads, grads_len) }?;
        objects::get(emb)?.sgd(r, g, lr)?;
        Ok(STRATA_OK)
    })
}

/// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD) on the `n` distinct
/// rows at `rows` with gradients at `grads` (as `strata_embedding_sgd`);
/// `state` holds one accumulator per table row (`state_len` = the rows;
/// start from zeros), updated in place with the rows:
/// `state[r] += mean(g * g); w -= lr / (sqrt(state[r]) + eps) * g`. Bad
/// input (as for SGD, a wrong `state_len`, a negative or non-finite `eps`)
/// is `STRATA_ERR_INVALID_ARGUMENT`, and neither rows nor state change.
/// Thread-safe, but two calls at once must not share `state`.
///
/// # Safety
/// As `strata_embedding_sgd`; `state` points to `state_len` writable
/// floats no one else uses during the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn strata_embedding_rowwise_adagrad(
    emb: *const strata_embedding,
    rows: *const i64,
    n: usize,
    grads: *const f32,
    grads_len: usize,
    state: *mut f32,
    state_len: usize,
    lr: f32,
    eps: f32,
) -> c_int {
    boundary("strata_embedding_rowwise_adagrad", || {
        cast::disjoint(
            &[cast::region(state, state_len, "state")],
            &[
                cast::region(rows, n, "rows"),
                cast::region(grads, grads_len, "grads"),
            ],
        )?;
        // SAFETY: as this function's contract states (the state apart from
        // the inputs: checked above).
        let (r, g, st) = unsafe {
            let (r, g) = update_args(rows, n, grads, grads_len)?;
            (r, g, cast::slice_mut(state, state_len, "state")?)
        };
        objects::get(emb)?.rowwise_adagrad(r, g, st, lr, eps)?;
        Ok(STRATA_OK)
    })
}

/// Stores in `*tier` the tier of the page row `row` starts in
/// (`STRATA_TIER_NONE` while it was never written). Thread-safe.
///
/// # Safety
/// `tier` is NULL or points to a writable `strata_tier`.
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_tier_of_row(
    emb: *const strata_embedding,
    row: i64,
    tier: *mut strata_tier,
) -> c_int {
    boundary("strata_embedding_tier_of_row", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(tier, "tier") }?;
        let t = objects::get(emb)?.tier_of_row(row)?;
        out.set(enums::tier_code(t));
        Ok(STRATA_OK)
    })
}

/// Stores the table's lookups since it was made or
/// `strata_embedding_reset_stats` last ran in `*stats`. Thread-safe.
///
/// # Safety
/// `stats` is NULL or points to a writable `strata_embedding_stats`.
#[no_mangle]
pub unsafe extern "C" fn strata_embedding_get_stats(
    emb: *const strata_embedding,
    stats: *mut strata_embedding_stats,
) -> c_int {
    boundary("strata_embedding_get_stats", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(stats, "stats") }?;
        out.set(objects::with(emb, |t| t.stats())?.into());
        Ok(STRATA_OK)
    })
}

/// Sets the table's stats back to zero. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_embedding_reset_stats(emb: *const strata_embedding) -> c_int {
    boundary("strata_embedding_reset_stats", || {
        objects::with(emb, |t| t.reset_stats())?;
        Ok(STRATA_OK)
    })
}
