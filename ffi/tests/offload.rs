//! The offloaded optimizer through the C ABI matches the Rust one bit for
//! bit, on host and NVMe states, and refuses bad input.

mod common;

use std::ptr::null_mut;

use common::*;
use strata::offload::optim::{OffloadedAdam, OptimConfig, StateTier};
use strata_ffi::*;

fn config() -> strata_optim_config {
    let mut c = std::mem::MaybeUninit::<strata_optim_config>::uninit();
    // SAFETY: a writable config.
    let status = unsafe { strata_optim_config_init(c.as_mut_ptr()) };
    assert_eq!(status, STRATA_OK);
    // SAFETY: filled by strata_optim_config_init.
    unsafe { c.assume_init() }
}

#[test]
fn steps_match_the_rust_optimizer() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    let n = 3000usize;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    for tier in [STRATA_TIER_HOST, STRATA_TIER_NVME] {
        let mut c = config();
        c.tier = tier;
        c.nvme_path = path.as_ptr();
        c.chunk_bytes = 4096;
        let mut opt = null_mut();
        // SAFETY: readable weights and config, a writable handle.
        let s = unsafe { strata_optim_create(w0.as_ptr(), n, &c, &mut opt) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        let mut reference = OffloadedAdam::new(
            &w0,
            OptimConfig {
                chunk_bytes: 4096,
                ..OptimConfig::new(StateTier::Host)
            },
        )
        .unwrap();
        for step in 0..3 {
            let g: Vec<f32> = (0..n).map(|i| ((i + step) as f32 * 0.11).cos()).collect();
            let mut stats = strata_step_stats::default();
            // SAFETY: readable gradients, a writable stats struct.
            let s = unsafe { strata_optim_step(opt, g.as_ptr(), n, &mut stats) };
            assert_eq!(s, STRATA_OK, "{}", last_error());
            assert!(stats.bytes_read > 0 && stats.bytes_written > 0);
            reference.step(&g).unwrap();
        }
        let mut w = vec![0f32; n];
        // SAFETY: n writable floats.
        let status = unsafe { strata_optim_weights(opt, w.as_mut_ptr(), n) };
        assert_eq!(status, STRATA_OK);
        let want = reference.weights().unwrap();
        assert!(
            w.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "tier {tier}"
        );
        // SAFETY: a short buffer is refused before anything is written.
        let short = unsafe { strata_optim_weights(opt, w.as_mut_ptr(), n - 1) };
        fails(short, STRATA_ERR_INVALID_ARGUMENT, "weights");
        assert_eq!(strata_optim_free(opt), STRATA_OK);
        fails(
            strata_optim_free(opt),
            STRATA_ERR_INVALID_HANDLE,
            "optimizer",
        );
    }
    assert_eq!(strata_optim_free(null_mut()), STRATA_OK);
    let mut c = config();
    c.tier = 42;
    let mut opt = null_mut();
    // SAFETY: as above.
    let s = unsafe { strata_optim_create(w0.as_ptr(), n, &c, &mut opt) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "state tier");
    c.tier = STRATA_TIER_NVME;
    c.nvme_path = std::ptr::null();
    // SAFETY: as above.
    let s = unsafe { strata_optim_create(w0.as_ptr(), n, &c, &mut opt) };
    fails(s, STRATA_ERR_NULL_POINTER, "nvme_path");
    c = config();
    c.updater = 7;
    // SAFETY: as above.
    let s = unsafe { strata_optim_create(w0.as_ptr(), n, &c, &mut opt) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "updater");
    c.updater = STRATA_UPDATE_CUDA;
    // SAFETY: as above.
    let s = unsafe { strata_optim_create(w0.as_ptr(), n, &c, &mut opt) };
    if s == STRATA_OK {
        // A GPU (and libstrata built with the cuda feature).
        assert_eq!(strata_optim_free(opt), STRATA_OK);
    } else {
        fails(s, STRATA_ERR_NO_DEVICE, "no CUDA device");
    }
}

#[test]
fn the_expert_cache_through_the_c_abi() {
    let mut c = std::mem::MaybeUninit::<strata_moe_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(unsafe { strata_moe_config_init(c.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: filled above.
    let mut c = unsafe { c.assume_init() };
    c.device_slots = 2;
    c.slot_bytes = 64 << 10;
    c.host_bytes = 1 << 20;
    let mut moe = null_mut();
    // SAFETY: a readable config and a writable handle.
    let status = unsafe { strata_moe_create(&c, &mut moe) };
    assert_eq!(status, STRATA_OK, "{}", last_error());
    let weights: Vec<Vec<u8>> = (0..4u8).map(|e| vec![e + 1; 64 << 10]).collect();
    for (e, w) in weights.iter().enumerate() {
        // SAFETY: readable weights.
        let s = unsafe { strata_moe_register(moe, 0, e as u32, w.as_ptr().cast(), w.len()) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
    }
    let mut addresses = [0u64; 4];
    let mut n = 0usize;
    let mut pin = null_mut();
    // SAFETY: 4 writable addresses, writable n and handle.
    let s = unsafe { strata_moe_fetch(moe, 0, 1, addresses.as_mut_ptr(), 4, &mut n, &mut pin) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert_eq!(n, 1);
    // SAFETY: on the simulated device a device address is host memory; the
    // pin keeps the expert there, unchanged, until released.
    let bytes = unsafe { std::slice::from_raw_parts(addresses[0] as *const u8, 64 << 10) };
    assert!(bytes == weights[1].as_slice());
    let w = &weights[0];
    // SAFETY: readable weights; refused while an expert is pinned.
    let s = unsafe { strata_moe_register(moe, 1, 0, w.as_ptr().cast(), w.len()) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "pinned");
    assert_eq!(strata_moe_release(pin), STRATA_OK);
    // The fetched expert needs no read now; one still in host memory does
    // (this cache moves host experts into its slots).
    let ready = |e: u32| {
        let mut r = 7u32;
        // SAFETY: a writable flag.
        let s = unsafe { strata_moe_is_ready(moe, 0, e, &mut r) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        r
    };
    assert_eq!((ready(1), ready(2)), (1, 0));
    let mut started = 0usize;
    // SAFETY: 2 readable expert ids, a writable count.
    let s = unsafe { strata_moe_prefetch(moe, 0, [2u32, 3].as_ptr(), 2, &mut started) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert!(started >= 1);
    assert_eq!(ready(2) + ready(3), 1 + u32::from(started == 2));
    let mut r = 0u32;
    // SAFETY: a writable flag; the expert was never registered.
    fails(
        unsafe { strata_moe_is_ready(moe, 0, 9, &mut r) },
        STRATA_ERR_NOT_FOUND,
        "9",
    );
    // SAFETY: NULL is refused before anything is read.
    fails(
        unsafe { strata_moe_is_ready(moe, 0, 1, null_mut()) },
        STRATA_ERR_NULL_POINTER,
        "ready",
    );
    let mut stats = strata_moe_stats::default();
    // SAFETY: a writable stats struct.
    assert_eq!(unsafe { strata_moe_get_stats(moe, &mut stats) }, STRATA_OK);
    assert_eq!((stats.fetches, stats.stall_modelled), (1, 1));
    assert_eq!(stats.prefetches as usize, started);
    // Layer 0's router picked 2: the guess of 3, if still on its way, is
    // dropped now; 2 stays.
    let mut dropped = usize::MAX;
    // SAFETY: one readable expert id, a writable count.
    let s =
        unsafe { strata_moe_cancel_prefetches_except(moe, 0, [2u32].as_ptr(), 1, &mut dropped) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert!(dropped <= 1);
    // SAFETY: no ids (a NULL array of 0), a NULL count.
    let s = unsafe { strata_moe_cancel_prefetches_except(moe, 7, std::ptr::null(), 0, null_mut()) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    // Layer 0 has run: whatever of its prefetches has not finished is
    // cancelled, and the counters agree.
    let mut cancelled = usize::MAX;
    // SAFETY: a writable count.
    let s = unsafe { strata_moe_cancel_prefetches(moe, 0, &mut cancelled) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert!(dropped + cancelled <= started);
    // SAFETY: a writable stats struct.
    assert_eq!(unsafe { strata_moe_get_stats(moe, &mut stats) }, STRATA_OK);
    assert_eq!(stats.prefetches_cancelled as usize, dropped + cancelled);
    assert!(stats.late_prefetch_hits <= stats.hits);
    // SAFETY: a NULL count is allowed.
    let s = unsafe { strata_moe_cancel_prefetches(moe, 0, std::ptr::null_mut()) };
    assert_eq!(s, STRATA_OK);
    // SAFETY: as above, for an expert never registered.
    let s = unsafe { strata_moe_fetch(moe, 5, 5, addresses.as_mut_ptr(), 4, &mut n, &mut pin) };
    assert!(s < 0);
    assert_eq!(strata_moe_free(moe), STRATA_OK);
    fails(
        strata_moe_free(moe),
        STRATA_ERR_INVALID_HANDLE,
        "expert cache",
    );
}

/// An expert cache made on a runtime the caller also allocates from: the
/// experts share its host tier, a fetch pins them in its device tier, and
/// a runtime without a device tier is refused with a status.
#[test]
fn the_expert_cache_on_a_shared_runtime_through_the_c_abi() {
    let rt = create(&common::config(
        4,
        32,
        0,
        &c_path(std::path::Path::new("/")),
    ));
    let mut c = std::mem::MaybeUninit::<strata_moe_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(unsafe { strata_moe_config_init(c.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: filled above.
    let mut c = unsafe { c.assume_init() };
    c.device_slots = 2;
    c.slot_bytes = 64 << 10;
    let mut moe = null_mut();
    // SAFETY: a live runtime, a readable config, a writable handle.
    let s = unsafe { strata_moe_create_on(rt, &c, &mut moe) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let mine = alloc(rt, 64 << 10);
    assert_eq!(write(mine, 0, &[9u8; 64 << 10]), STRATA_OK);
    let w = vec![5u8; 64 << 10];
    // SAFETY: readable weights.
    let s = unsafe { strata_moe_register(moe, 0, 0, w.as_ptr().cast(), w.len()) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let st = stats(rt);
    let host = &st["tiers"][1];
    assert_eq!(host["tier"], "host");
    assert!(host["used_pages"].as_u64().unwrap() >= 1, "{st}");
    let (mut addresses, mut n, mut pin) = ([0u64; 1], 0usize, null_mut());
    // SAFETY: a writable address, count and handle.
    let s = unsafe { strata_moe_fetch(moe, 0, 0, addresses.as_mut_ptr(), 1, &mut n, &mut pin) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    // SAFETY: a simulated device address is host memory, kept by the pin.
    let bytes = unsafe { std::slice::from_raw_parts(addresses[0] as *const u8, 64 << 10) };
    assert!(bytes == w.as_slice());
    assert_eq!(strata_moe_release(pin), STRATA_OK);
    let mut back = vec![0u8; 64 << 10];
    assert_eq!(read(mine, 0, &mut back), STRATA_OK);
    assert!(back.iter().all(|&b| b == 9));
    assert_eq!(strata_moe_free(moe), STRATA_OK);
    assert_eq!(strata_buffer_free(mine), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);

    // No device tier.
    let rt = create(&common::config(
        0,
        32,
        0,
        &c_path(std::path::Path::new("/")),
    ));
    let mut moe = null_mut();
    // SAFETY: as above.
    let s = unsafe { strata_moe_create_on(rt, &c, &mut moe) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "device tier");
    assert!(moe.is_null());
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

/// The optimizer on a runtime the caller shares, through the C ABI: the
/// same weights as the Rust optimizer's, its states in the runtime's NVMe
/// tier (the config's path is not read), bad settings refused by status.
#[test]
fn the_optimizer_on_a_shared_runtime_through_the_c_abi() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    let rt = create(&common::config(0, 32, 256, &path));
    let n = 3000usize;
    let w0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.29).sin()).collect();
    let mut c = config();
    c.tier = STRATA_TIER_NVME;
    c.nvme_path = std::ptr::null();
    c.chunk_bytes = PAGE as usize;
    let mut opt = null_mut();
    // SAFETY: a live runtime, readable weights and config, a writable handle.
    let s = unsafe { strata_optim_create_on(rt, w0.as_ptr(), n, &c, &mut opt) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let mut reference = OffloadedAdam::new(
        &w0,
        OptimConfig {
            chunk_bytes: PAGE as usize,
            ..OptimConfig::new(StateTier::Host)
        },
    )
    .unwrap();
    for step in 0..3 {
        let g: Vec<f32> = (0..n).map(|i| ((i + step) as f32 * 0.13).cos()).collect();
        // SAFETY: readable gradients; no stats.
        let s = unsafe { strata_optim_step(opt, g.as_ptr(), n, null_mut()) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        reference.step(&g).unwrap();
    }
    let mut w = vec![0f32; n];
    // SAFETY: n writable floats.
    let s = unsafe { strata_optim_weights(opt, w.as_mut_ptr(), n) };
    assert_eq!(s, STRATA_OK);
    let want = reference.weights().unwrap();
    assert!(w.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    let st = stats(rt);
    assert!(st["tiers"][1]["used_pages"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(strata_optim_free(opt), STRATA_OK);
    // A chunk other than the runtime's page size; a tier it lacks.
    c.chunk_bytes = 2 * PAGE as usize;
    // SAFETY: as above.
    let s = unsafe { strata_optim_create_on(rt, w0.as_ptr(), n, &c, &mut opt) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "page size");
    c.chunk_bytes = PAGE as usize;
    c.tier = STRATA_TIER_CXL;
    // SAFETY: as above.
    let s = unsafe { strata_optim_create_on(rt, w0.as_ptr(), n, &c, &mut opt) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "cxl");
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

/// `strata_moe_read_ahead`: the reads of experts about to be fetched
/// start, and their fetches count as misses (`reads_ahead`), not hits.
#[test]
fn reads_ahead_are_misses_in_the_stats() {
    let mut c = std::mem::MaybeUninit::<strata_moe_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(unsafe { strata_moe_config_init(c.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: filled above.
    let mut c = unsafe { c.assume_init() };
    c.device_slots = 2;
    c.slot_bytes = 64 << 10;
    c.host_bytes = 1 << 20;
    let mut moe = null_mut();
    // SAFETY: a readable config and a writable handle.
    assert_eq!(unsafe { strata_moe_create(&c, &mut moe) }, STRATA_OK);
    for e in 0..4u32 {
        let w = vec![e as u8 + 1; 64 << 10];
        // SAFETY: readable weights.
        let s = unsafe { strata_moe_register(moe, 0, e, w.as_ptr().cast(), w.len()) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
    }
    let mut started = 9usize;
    // SAFETY: two readable ids, a writable count.
    let s = unsafe { strata_moe_read_ahead(moe, 0, [1u32, 2].as_ptr(), 2, &mut started) };
    assert_eq!((s, started), (STRATA_OK, 2), "{}", last_error());
    for e in [1u32, 2] {
        let mut addresses = [0u64; 4];
        let mut n = 0usize;
        let mut pin = null_mut();
        // SAFETY: 4 writable addresses, writable n and handle.
        let s = unsafe { strata_moe_fetch(moe, 0, e, addresses.as_mut_ptr(), 4, &mut n, &mut pin) };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        // SAFETY: on the simulated device a device address is host memory,
        // held by the pin.
        let bytes = unsafe { std::slice::from_raw_parts(addresses[0] as *const u8, 64 << 10) };
        assert!(bytes.iter().all(|&b| b == e as u8 + 1));
        assert_eq!(strata_moe_release(pin), STRATA_OK);
    }
    let mut stats = strata_moe_stats::default();
    // SAFETY: a writable stats struct.
    let s = unsafe { strata_moe_get_stats(moe, &mut stats) };
    assert_eq!(s, STRATA_OK);
    assert_eq!((stats.fetches, stats.hits, stats.reads_ahead), (2, 0, 2));
    // A resident expert is skipped (NULL `started` is allowed); an expert
    // never registered is refused.
    // SAFETY: one readable id.
    let s = unsafe { strata_moe_read_ahead(moe, 0, [1u32].as_ptr(), 1, null_mut()) };
    assert_eq!(s, STRATA_OK);
    // SAFETY: as above.
    let s = unsafe { strata_moe_read_ahead(moe, 0, [99u32].as_ptr(), 1, null_mut()) };
    assert_ne!(s, STRATA_OK);
    assert_eq!(strata_moe_free(moe), STRATA_OK);
}

#[test]
fn offload_configs_of_another_layout_are_refused_before_more_is_read() {
    let w = [1.0f32; 16];
    // The version init writes is the struct's size in this layout.
    let c = config();
    assert_eq!(c.version, STRATA_OPTIM_CONFIG_VERSION);
    assert_eq!(
        std::mem::size_of::<strata_optim_config>(),
        STRATA_OPTIM_CONFIG_VERSION as usize
    );
    let mut m = std::mem::MaybeUninit::<strata_moe_config>::uninit();
    // SAFETY: a writable config.
    assert_eq!(unsafe { strata_moe_config_init(m.as_mut_ptr()) }, STRATA_OK);
    // SAFETY: filled above.
    let m = unsafe { m.assume_init() };
    assert_eq!(m.version, STRATA_MOE_CONFIG_VERSION);
    assert_eq!(
        std::mem::size_of::<strata_moe_config>(),
        STRATA_MOE_CONFIG_VERSION as usize
    );
    // A struct of the layout before the version field starts with its tier
    // (or device): a small number, refused by name, and nothing is made.
    let mut old = c;
    old.version = STRATA_TIER_HOST as u32;
    let mut opt = null_mut();
    // SAFETY: readable weights and config, a writable handle.
    let s = unsafe { strata_optim_create(w.as_ptr(), w.len(), &old, &mut opt) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "strata_optim_config_init");
    assert!(opt.is_null());
    let mut old = m;
    old.version = 2;
    let mut moe = null_mut();
    // SAFETY: a readable config and a writable handle.
    let s = unsafe { strata_moe_create(&old, &mut moe) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "strata_moe_config_init");
    assert!(moe.is_null());
    // Only the version is read from a struct of another layout.
    let short: u32 = 3;
    // SAFETY: the version at the start is readable (the rest of this
    // object is not a strata_moe_config, and is never read).
    let s = unsafe { strata_moe_create((&short as *const u32).cast(), &mut moe) };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "must be rebuilt");
    // SAFETY: as above.
    let s = unsafe {
        strata_optim_create(w.as_ptr(), w.len(), (&short as *const u32).cast(), &mut opt)
    };
    fails(s, STRATA_ERR_INVALID_ARGUMENT, "must be rebuilt");
}
