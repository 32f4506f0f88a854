//! Pins (pages held resident in a memory tier, with their addresses) and
//! device maps with their launches.

use std::ffi::c_int;

use crate::buffer::range;
use crate::cast::{self, SetOpt};
use crate::enums::{access, strata_access, strata_tier, tier, tier_code};
use crate::objects::{
    self, strata_buffer, strata_launch, strata_map, strata_pin, MapObj, LAUNCHES, MAPS, PINS,
};
use crate::status::{boundary, Fail, STRATA_OK};

/// Makes the pages of `offset..offset + len` resident in `tier` (device,
/// host or CXL; NVMe pages have no address) and keeps them there until
/// `strata_unpin`; stores the pin's handle in `*pin`. Get the pages'
/// addresses with `strata_pin_addresses`: device addresses on the device
/// tier (host addresses on the simulated device), host addresses on host
/// and CXL. They stay valid until the pin ends. Writes through strata still
/// reach pinned pages in place; ordering them with users of the addresses is
/// the caller's job. A pin larger than the tier, or one that cannot be
/// satisfied, fails and pins nothing. Thread-safe.
///
/// # Safety
/// `pin` is NULL or points to a writable `strata_pin *`.
#[no_mangle]
pub unsafe extern "C" fn strata_buffer_pin(
    buf: *const strata_buffer,
    offset: u64,
    len: u64,
    tier_in: strata_tier,
    pin: *mut *mut strata_pin,
) -> c_int {
    boundary("strata_buffer_pin", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(pin, "pin") }?;
        let t = tier(tier_in)?;
        let b = objects::get(buf)?;
        let p = b.buffer.pin_owned(range(offset, len)?, t)?;
        out.set(objects::ptr(b.rt.adopt(&PINS, p)?));
        Ok(STRATA_OK)
    })
}

/// Describes a pin: its tier, its first page and its number of pages (any
/// of the three pointers may be NULL; all are checked before any is
/// written). Thread-safe.
///
/// # Safety
/// Each pointer is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn strata_pin_info(
    pin: *const strata_pin,
    tier_out: *mut strata_tier,
    first_page: *mut usize,
    page_count: *mut usize,
) -> c_int {
    boundary("strata_pin_info", || {
        // SAFETY: each NULL or writable (this function's contract).
        let (t, first, count) = unsafe {
            (
                cast::out_opt(tier_out, "tier_out")?,
                cast::out_opt(first_page, "first_page")?,
                cast::out_opt(page_count, "page_count")?,
            )
        };
        let p = objects::get(pin)?;
        let pages = p.pages();
        t.set(tier_code(Some(p.tier())));
        first.set(pages.start);
        count.set(pages.len());
        Ok(STRATA_OK)
    })
}

/// Copies the pinned pages' addresses, in page order, into `addresses` (at
/// most `cap` of them) and stores their number in `*count`. Returns
/// `STRATA_ERR_BUFFER_TOO_SMALL` when `cap < *count` (the first `cap` are
/// copied). `addresses` may be NULL when `cap` is 0. Page `i` of the pin
/// covers bytes `(first_page + i) * page_size` onwards. Thread-safe.
///
/// # Safety
/// `addresses` is NULL or points to `cap` writable `uint64_t`s; `count` is
/// NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_pin_addresses(
    pin: *const strata_pin,
    addresses: *mut u64,
    cap: usize,
    count: *mut usize,
) -> c_int {
    boundary("strata_pin_addresses", || {
        cast::disjoint(
            &[
                cast::region(addresses, cap, "addresses"),
                cast::region(count, 1, "count"),
            ],
            &[],
        )?;
        // SAFETY: NULL or writable (this function's contract), and apart
        // (checked above).
        let count = unsafe { cast::out(count, "count") }?;
        // SAFETY: NULL or `cap` writable elements (this function's contract).
        let dst = unsafe { cast::slice_mut(addresses, cap, "addresses") }?;
        let p = objects::get(pin)?;
        let status = cast::copy_array(p.addresses(), dst, count);
        if status != STRATA_OK {
            return Err(Fail::new(
                status,
                format!("the pin has {} pages, the array {cap}", p.addresses().len()),
            ));
        }
        Ok(STRATA_OK)
    })
}

/// Ends a pin: its pages may move again, and the addresses it gave are no
/// longer valid. NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_unpin(pin: *mut strata_pin) -> c_int {
    boundary("strata_unpin", || {
        drop(objects::remove(pin)?);
        Ok(STRATA_OK)
    })
}

/// Stores in `*map` a handle to the buffer's device map: one 64-bit address
/// per page that kernels translate through. Prepare it before each launch
/// with `strata_map_prepare`. Free it with `strata_map_free`. Thread-safe.
///
/// # Safety
/// `map` is NULL or points to a writable `strata_map *`.
#[no_mangle]
pub unsafe extern "C" fn strata_device_map(
    buf: *const strata_buffer,
    map: *mut *mut strata_map,
) -> c_int {
    boundary("strata_device_map", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(map, "map") }?;
        let b = objects::get(buf)?;
        let m = b.buffer.device_map()?;
        let bits = b.rt.adopt(
            &MAPS,
            MapObj {
                map: m,
                rt: b.rt.clone(),
            },
        )?;
        out.set(objects::ptr(bits));
        Ok(STRATA_OK)
    })
}

/// Stores the number of pages the map covers in `*pages`. Thread-safe.
///
/// # Safety
/// `pages` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_map_pages(map: *const strata_map, pages: *mut usize) -> c_int {
    boundary("strata_map_pages", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(pages, "pages") }?;
        out.set(objects::with(map, |m| m.map.pages())?);
        Ok(STRATA_OK)
    })
}

/// Copies each page's access count so far (bumped by kernels reading
/// through the map) into `counts` (at most `cap`) and stores the number of
/// pages in `*count`; `STRATA_ERR_BUFFER_TOO_SMALL` when `cap < *count`.
/// `counts` may be NULL when `cap` is 0. Thread-safe.
///
/// # Safety
/// `counts` is NULL or points to `cap` writable `uint32_t`s; `count` is
/// NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_map_counts(
    map: *const strata_map,
    counts: *mut u32,
    cap: usize,
    count: *mut usize,
) -> c_int {
    boundary("strata_map_counts", || {
        cast::disjoint(
            &[
                cast::region(counts, cap, "counts"),
                cast::region(count, 1, "count"),
            ],
            &[],
        )?;
        // SAFETY: NULL or writable (this function's contract), and apart
        // (checked above).
        let count = unsafe { cast::out(count, "count") }?;
        // SAFETY: NULL or `cap` writable elements (this function's contract).
        let dst = unsafe { cast::slice_mut(counts, cap, "counts") }?;
        let values = objects::get(map)?.map.counts();
        let status = cast::copy_array(&values, dst, count);
        if status != STRATA_OK {
            return Err(Fail::new(
                status,
                format!("the map has {} pages, the array {cap}", values.len()),
            ));
        }
        Ok(STRATA_OK)
    })
}

/// Frees a device map handle (launches made from it stay valid until they
/// end). NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_map_free(map: *mut strata_map) -> c_int {
    boundary("strata_map_free", || {
        drop(objects::remove(map)?);
        Ok(STRATA_OK)
    })
}

/// Starts a launch: makes every page of the buffer addressable by kernels
/// (NVMe pages staged into a memory tier, never-written pages materialized
/// as zeros), fills the map and stores the launch's handle in `*launch`.
/// While it lives no mapped page leaves memory; with
/// `STRATA_ACCESS_READ_ONLY` pages may still be promoted (the old copy stays
/// valid until the last launch ends) and writes through strata are refused.
/// `STRATA_ERR_OUT_OF_CAPACITY` when the memory tiers cannot hold the whole
/// buffer; `STRATA_ERR_INVALID_ARGUMENT` while a launch of the buffer in the
/// other mode is live (read-only and read-write launches exclude each
/// other); `STRATA_ERR_CLOSED` when the map's buffer was freed (or its
/// runtime destroyed). End it with `strata_launch_end`. Thread-safe.
///
/// # Safety
/// `launch` is NULL or points to a writable `strata_launch *`.
#[no_mangle]
pub unsafe extern "C" fn strata_map_prepare(
    map: *const strata_map,
    access_mode: strata_access,
    launch: *mut *mut strata_launch,
) -> c_int {
    boundary("strata_map_prepare", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(launch, "launch") }?;
        let a = access(access_mode)?;
        let m = objects::get(map)?;
        let l = m.map.prepare_owned(a)?;
        out.set(objects::ptr(m.rt.adopt(&LAUNCHES, l)?));
        Ok(STRATA_OK)
    })
}

/// Stores in `*address` where kernels find the map (an array of one
/// `uint64_t` per page): a device address on CUDA, a host address on the
/// simulated device. Valid until the launch ends. Thread-safe.
///
/// # Safety
/// `address` is NULL or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_launch_map_address(
    launch: *const strata_launch,
    address: *mut u64,
) -> c_int {
    boundary("strata_launch_map_address", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(address, "address") }?;
        out.set(objects::with(launch, |l| l.map_address())?);
        Ok(STRATA_OK)
    })
}

/// Stores in `*address` where kernels count their accesses (the
/// `counters` argument of `strata_touch` / `strata_load` in
/// `strata_device.cuh`: one `uint32_t` per page): device memory on CUDA,
/// added to the buffer's counts (the balancer's input) when the buffer's
/// last launch ends; on the simulated device the buffer's counters in host
/// memory; 0 while the runtime's sampling is off (kernels given it count
/// nothing). Kernels sample at `strata_launch_sample_shift`. Valid until
/// the launch ends. Thread-safe.
///
/// # Safety
/// `address` is NULL or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_launch_counters_address(
    launch: *const strata_launch,
    address: *mut u64,
) -> c_int {
    boundary("strata_launch_counters_address", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(address, "address") }?;
        out.set(objects::with(launch, |l| l.counters_address())?);
        Ok(STRATA_OK)
    })
}

/// Stores in `*shift` the `shift` kernels pass to `strata_touch` /
/// `strata_load` (`strata_device.cuh`: one access in 2^shift counted): the
/// runtime's sampling, by which the balancer scales the counts back up. A
/// kernel sampling at another shift skews the balancer by the difference.
/// While sampling is off, `STRATA_SAMPLING_OFF`, and
/// `strata_launch_counters_address` gives 0 (nothing is counted).
/// Thread-safe.
///
/// # Safety
/// `shift` is NULL or points to a writable `uint32_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_launch_sample_shift(
    launch: *const strata_launch,
    shift: *mut u32,
) -> c_int {
    boundary("strata_launch_sample_shift", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(shift, "shift") }?;
        let s = objects::with(launch, |l| l.sample_shift())?;
        out.set(s.unwrap_or(crate::runtime::STRATA_SAMPLING_OFF));
        Ok(STRATA_OK)
    })
}

/// Stores page `page`'s current map entry (the address kernels use for it)
/// in `*entry`. Thread-safe.
///
/// # Safety
/// `entry` is NULL or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn strata_launch_entry(
    launch: *const strata_launch,
    page: usize,
    entry: *mut u64,
) -> c_int {
    boundary("strata_launch_entry", || {
        // SAFETY: NULL or writable (this function's contract).
        let out = unsafe { cast::out(entry, "entry") }?;
        let (pages, value) = objects::with(launch, |l| {
            let pages = l.pages();
            (pages, (page < pages).then(|| l.entry(page)))
        })?;
        let value = value.ok_or_else(|| {
            Fail::invalid(format!("page {page} is beyond the map's {pages} pages"))
        })?;
        out.set(value);
        Ok(STRATA_OK)
    })
}

/// Ends a launch (call it once the kernels using the map have finished).
/// NULL is a no-op. Thread-safe.
#[no_mangle]
pub extern "C" fn strata_launch_end(launch: *mut strata_launch) -> c_int {
    boundary("strata_launch_end", || {
        drop(objects::remove(launch)?);
        Ok(STRATA_OK)
    })
}
