//! The C ABI used as intended, from Rust: every capability once, checked
//! against what was written.

mod common;

use std::ffi::CStr;
use std::ptr::null_mut;

use common::*;
use strata_ffi::*;

#[test]
fn oversubscribed_device_round_trips_through_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    // A 4-page simulated device, 8 host pages, 32 NVMe pages; the buffer is
    // 4× the device and more than the memory tiers hold.
    let rt = create(&config(4, 8, 32, &path));
    let mut mask = 0u32;
    // SAFETY: a writable u32.
    assert_eq!(unsafe { strata_runtime_tiers(rt, &mut mask) }, STRATA_OK);
    assert_eq!(
        mask,
        1 << STRATA_TIER_DEVICE | 1 << STRATA_TIER_HOST | 1 << STRATA_TIER_NVME
    );
    let len = 16 * PAGE;
    let buf = alloc(rt, len);
    let data: Vec<u8> = (0..len).map(|i| pattern(1, i)).collect();
    assert_eq!(write(buf, 0, &data), STRATA_OK, "{}", last_error());
    // Background eviction may already have moved the first pages down.
    assert!((STRATA_TIER_DEVICE..=STRATA_TIER_NVME).contains(&tier_of(buf, 0)));
    let mut back = vec![0u8; len as usize];
    assert_eq!(read(buf, 0, &mut back), STRATA_OK, "{}", last_error());
    assert!(back == data);

    // Down to NVMe and back up to the device, with tickets.
    assert_eq!(
        strata_evict(buf, 0, len, STRATA_TIER_NVME),
        STRATA_OK,
        "{}",
        last_error()
    );
    assert_eq!(tier_of(buf, 0), STRATA_TIER_NVME);
    let mut ticket = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_prefetch(buf, 0, 2 * PAGE, STRATA_TIER_DEVICE, &mut ticket) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let s = strata_ticket_wait_timeout(ticket, 10_000_000_000);
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert_eq!(strata_ticket_poll(ticket), STRATA_OK);
    assert_eq!(
        strata_ticket_wait(ticket),
        STRATA_OK,
        "waiting again gives the same"
    );
    // The device had room: nothing was declined.
    let mut declined = usize::MAX;
    // SAFETY: a writable size_t.
    let s = unsafe { strata_ticket_declined(ticket, &mut declined) };
    assert_eq!(s, STRATA_OK);
    assert_eq!(declined, 0);
    // SAFETY: NULL is refused with a status, never written.
    let s = unsafe { strata_ticket_declined(ticket, null_mut()) };
    assert_eq!(s, STRATA_ERR_NULL_POINTER);
    // A finished request: nothing left to drop.
    let mut dropped = usize::MAX;
    // SAFETY: a writable size_t.
    let s = unsafe { strata_ticket_cancel(buf, ticket, &mut dropped) };
    assert_eq!((s, dropped), (STRATA_OK, 0), "{}", last_error());
    // SAFETY: a NULL count is allowed.
    let s = unsafe { strata_ticket_cancel(buf, ticket, null_mut()) };
    assert_eq!(s, STRATA_OK);
    assert_eq!(strata_ticket_wait(ticket), STRATA_OK);
    assert_eq!(strata_ticket_free(ticket), STRATA_OK);
    // SAFETY: a freed ticket is a bad handle, refused with a status.
    let s = unsafe { strata_ticket_cancel(buf, ticket, null_mut()) };
    assert_eq!(s, STRATA_ERR_INVALID_HANDLE);
    // Two pages stay below the device's watermarks, so nothing demotes them.
    assert_eq!(tier_of(buf, 1), STRATA_TIER_DEVICE);
    assert_eq!(tier_of(buf, 2), STRATA_TIER_NVME);
    back.fill(0);
    assert_eq!(read(buf, 0, &mut back), STRATA_OK, "{}", last_error());
    assert!(back == data);

    let st = stats(rt);
    assert_eq!(st["backend"], "simulated");
    // The 12 pages first written into the memory tiers each moved down
    // once (by evict or by background eviction first), two came back up;
    // background eviction may have moved more.
    assert!(st["moves"].as_u64().unwrap() >= 14, "{st}");
    assert_eq!(strata_buffer_free(buf), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

#[test]
fn pins_give_addresses_that_hold_the_bytes() {
    let rt = create(&config(4, 8, 0, &c_path(std::path::Path::new("/"))));
    let buf = alloc(rt, 3 * PAGE);
    let data: Vec<u8> = (0..3 * PAGE).map(|i| pattern(2, i)).collect();
    assert_eq!(write(buf, 0, &data), STRATA_OK);
    let mut pin = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_buffer_pin(buf, PAGE + 10, PAGE, STRATA_TIER_HOST, &mut pin) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let (mut t, mut first, mut count) = (-2, 0usize, 0usize);
    // SAFETY: writable out-pointers.
    let s = unsafe { strata_pin_info(pin, &mut t, &mut first, &mut count) };
    assert_eq!(s, STRATA_OK);
    assert_eq!((t, first, count), (STRATA_TIER_HOST, 1, 2));
    let mut addresses = [0u64; 2];
    let mut n = 0usize;
    // SAFETY: a zero-length query with a NULL array.
    let s = unsafe { strata_pin_addresses(pin, null_mut(), 0, &mut n) };
    fails(s, STRATA_ERR_BUFFER_TOO_SMALL, "2 pages");
    assert_eq!(n, 2);
    // SAFETY: two writable u64s.
    let s = unsafe { strata_pin_addresses(pin, addresses.as_mut_ptr(), 2, &mut n) };
    assert_eq!(s, STRATA_OK);
    for (i, &a) in addresses.iter().enumerate() {
        // SAFETY: a pinned host page's address stays valid, and holds
        // PAGE bytes, until the pin ends; nothing writes the buffer meanwhile.
        let page = unsafe { std::slice::from_raw_parts(a as *const u8, PAGE as usize) };
        let at = (1 + i) * PAGE as usize;
        assert!(page == &data[at..at + PAGE as usize], "page {}", 1 + i);
    }
    assert_eq!(tier_of(buf, 1), STRATA_TIER_HOST);
    let st = stats(rt);
    let host = st["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "host")
        .unwrap();
    assert_eq!(host["pinned_pages"], 2);
    assert_eq!(strata_unpin(pin), STRATA_OK);
    assert_eq!(strata_unpin(null_mut()), STRATA_OK);
    let st = stats(rt);
    let host = st["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "host")
        .unwrap();
    assert_eq!(host["pinned_pages"], 0);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

#[test]
fn a_pin_outlives_the_freed_buffer_handle() {
    let rt = create(&config(4, 8, 0, &c_path(std::path::Path::new("/"))));
    let buf = alloc(rt, PAGE);
    assert_eq!(write(buf, 0, b"still here"), STRATA_OK);
    let mut pin = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_buffer_pin(buf, 0, 10, STRATA_TIER_DEVICE, &mut pin) };
    assert_eq!(s, STRATA_OK);
    let mut map = null_mut();
    // SAFETY: a writable out-pointer.
    assert_eq!(unsafe { strata_device_map(buf, &mut map) }, STRATA_OK);
    assert_eq!(strata_buffer_free(buf), STRATA_OK);
    // The pin keeps the buffer alive, not its device map's launches: they
    // end with the handle, as the header says.
    let mut launch = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe { strata_map_prepare(map, STRATA_ACCESS_READ_ONLY, &mut launch) };
    assert_eq!(s, STRATA_ERR_CLOSED, "{}", last_error());
    assert!(launch.is_null());
    assert_eq!(strata_map_free(map), STRATA_OK);
    let mut a = 0u64;
    let mut n = 0usize;
    // SAFETY: one writable u64.
    let s = unsafe { strata_pin_addresses(pin, &mut a, 1, &mut n) };
    assert_eq!(s, STRATA_OK);
    // SAFETY: the simulated device's memory is host memory; the pin keeps
    // the page (and its buffer) alive.
    let bytes = unsafe { std::slice::from_raw_parts(a as *const u8, 10) };
    assert_eq!(bytes, b"still here");
    assert_eq!(strata_unpin(pin), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

#[test]
fn device_maps_and_launches() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_path(dir.path());
    let rt = create(&config(2, 8, 16, &path));
    let buf = alloc(rt, 6 * PAGE);
    let data: Vec<u8> = (0..6 * PAGE).map(|i| pattern(3, i)).collect();
    assert_eq!(write(buf, 0, &data), STRATA_OK);
    assert_eq!(
        strata_evict(buf, 0, 6 * PAGE, STRATA_TIER_NVME),
        STRATA_OK,
        "{}",
        last_error()
    );
    let mut map = null_mut();
    // SAFETY: writable out-pointers throughout.
    unsafe {
        assert_eq!(strata_device_map(buf, &mut map), STRATA_OK);
        let mut pages = 0usize;
        assert_eq!(strata_map_pages(map, &mut pages), STRATA_OK);
        assert_eq!(pages, 6);
        let mut launch = null_mut();
        let s = strata_map_prepare(map, STRATA_ACCESS_READ_ONLY, &mut launch);
        assert_eq!(s, STRATA_OK, "{}", last_error());
        let mut address = 0u64;
        assert_eq!(strata_launch_map_address(launch, &mut address), STRATA_OK);
        assert_ne!(address, 0);
        for p in 0..6 {
            let mut entry = 0u64;
            assert_eq!(strata_launch_entry(launch, p, &mut entry), STRATA_OK);
            // The simulated map is host memory: the table kernels read.
            assert_eq!(entry, *(address as *const u64).add(p));
            let page = std::slice::from_raw_parts(entry as *const u8, PAGE as usize);
            let at = p * PAGE as usize;
            assert!(page == &data[at..at + PAGE as usize], "page {p}");
        }
        let mut entry = 0u64;
        fails(
            strata_launch_entry(launch, 6, &mut entry),
            STRATA_ERR_INVALID_ARGUMENT,
            "beyond",
        );
        // A read-only launch refuses writes until it ends.
        fails(
            write(buf, 0, b"x"),
            STRATA_ERR_INVALID_ARGUMENT,
            "read-only",
        );
        let mut counts = [7u32; 6];
        let mut n = 0usize;
        assert_eq!(
            strata_map_counts(map, counts.as_mut_ptr(), 6, &mut n),
            STRATA_OK
        );
        // The runtime's own writes above count as accesses too.
        assert_eq!(n, 6);
        assert!(counts.iter().all(|&c| c >= 1), "{counts:?}");
        assert_eq!(strata_launch_end(launch), STRATA_OK);
        assert_eq!(write(buf, 0, b"x"), STRATA_OK);
        assert_eq!(strata_map_free(map), STRATA_OK);
    }
    let st = stats(rt);
    assert!(st["faults"].as_u64().unwrap() >= 6, "{st}");
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

#[test]
fn runtimes_from_toml() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "page_size = \"64k\"\ndevice = \"sim\"\ndevice_capacity = \"256k\"\n\
         [host]\ncapacity = \"1M\"\n[nvme]\npath = {:?}\ncapacity = \"2M\"\n",
        dir.path().display().to_string()
    );
    let mut rt = null_mut();
    // SAFETY: `toml` is readable for its length; a writable out-pointer.
    let s = unsafe { strata_runtime_from_toml(toml.as_ptr().cast(), toml.len(), 0, &mut rt) };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    let mut page = 0usize;
    // SAFETY: a writable size_t.
    let s = unsafe { strata_runtime_page_size(rt, &mut page) };
    assert_eq!(s, STRATA_OK);
    assert_eq!(page, 64 << 10);
    let st = stats(rt);
    assert_eq!(st["backend"], "simulated");
    assert_eq!(st["tiers"].as_array().unwrap().len(), 3);

    // The copying form, too small and then big enough.
    let mut need = 0usize;
    let mut small = [0u8; 8];
    // SAFETY: `small` holds 8 writable bytes.
    let s =
        unsafe { strata_stats_json_copy(rt, small.as_mut_ptr().cast(), small.len(), &mut need) };
    fails(s, STRATA_ERR_BUFFER_TOO_SMALL, "bytes");
    assert_eq!(small[7], 0, "truncated and NUL-terminated");
    // Room to spare: the stats may grow between the two calls.
    let mut big = vec![0u8; need + 4096];
    // SAFETY: `big` holds need + 1 writable bytes.
    let s = unsafe { strata_stats_json_copy(rt, big.as_mut_ptr().cast(), big.len(), &mut need) };
    assert_eq!(s, STRATA_OK);
    let text = CStr::from_bytes_until_nul(&big).unwrap().to_str().unwrap();
    assert!(serde_json::from_str::<serde_json::Value>(text).is_ok());
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

#[test]
fn dlpack_export_of_a_pinned_range() {
    let rt = create(&config(4, 8, 0, &c_path(std::path::Path::new("/"))));
    let buf = alloc(rt, 2 * PAGE);
    let floats: Vec<f32> = (0..2 * PAGE as usize / 4).map(|i| i as f32).collect();
    let bytes: Vec<u8> = floats.iter().flat_map(|f| f.to_ne_bytes()).collect();
    assert_eq!(write(buf, 0, &bytes), STRATA_OK);
    let f32_type = DLDataType {
        code: DLDataTypeCode::kDLFloat as u8,
        bits: 32,
        lanes: 1,
    };
    let mut t: *mut DLManagedTensor = null_mut();
    // SAFETY: a writable out-pointer.
    let s = unsafe {
        strata_dlpack_export(
            buf,
            400,
            4000,
            STRATA_TIER_HOST,
            f32_type.code,
            f32_type.bits,
            f32_type.lanes,
            &mut t,
        )
    };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    // SAFETY: strata returned a live tensor; its shape and data stay valid
    // until its deleter runs.
    unsafe {
        let dl = &(*t).dl_tensor;
        assert_eq!(dl.ndim, 1);
        assert_eq!(*dl.shape, 1000);
        assert_eq!(*dl.strides, 1);
        assert_eq!(dl.device.device_type, DLDeviceType::kDLCPU);
        let values = std::slice::from_raw_parts(dl.data as *const f32, 1000);
        assert_eq!(values, &floats[100..1100]);
        // The consumer's way out: the deleter, once.
        ((*t).deleter.unwrap())(t);
    }
    // Deleted: a second free is refused, not a double free.
    fails(
        strata_dlpack_free(t),
        STRATA_ERR_INVALID_HANDLE,
        "not a DLPack tensor",
    );
    assert_eq!(strata_dlpack_free(null_mut()), STRATA_OK);

    // Bad element types and lengths.
    // SAFETY: writable out-pointers.
    unsafe {
        let odd = DLDataType {
            code: 2,
            bits: 12,
            lanes: 1,
        };
        fails(
            strata_dlpack_export(
                buf,
                0,
                12,
                STRATA_TIER_HOST,
                odd.code,
                odd.bits,
                odd.lanes,
                &mut t,
            ),
            STRATA_ERR_UNSUPPORTED,
            "whole bytes",
        );
        // No bits or no lanes is no type at all: bad input, not a type
        // strata cannot export.
        for (bits, lanes) in [(0u8, 1u16), (32, 0)] {
            fails(
                strata_dlpack_export(buf, 0, 8, STRATA_TIER_HOST, 2, bits, lanes, &mut t),
                STRATA_ERR_INVALID_ARGUMENT,
                "no element has none",
            );
        }
        let unknown = DLDataType {
            code: 99,
            bits: 8,
            lanes: 1,
        };
        fails(
            strata_dlpack_export(
                buf,
                0,
                8,
                STRATA_TIER_HOST,
                unknown.code,
                unknown.bits,
                unknown.lanes,
                &mut t,
            ),
            STRATA_ERR_INVALID_ARGUMENT,
            "type code",
        );
        fails(
            strata_dlpack_export(
                buf,
                0,
                6,
                STRATA_TIER_HOST,
                f32_type.code,
                f32_type.bits,
                f32_type.lanes,
                &mut t,
            ),
            STRATA_ERR_INVALID_ARGUMENT,
            "elements",
        );
        fails(
            strata_dlpack_export(
                buf,
                2,
                8,
                STRATA_TIER_HOST,
                f32_type.code,
                f32_type.bits,
                f32_type.lanes,
                &mut t,
            ),
            STRATA_ERR_INVALID_ARGUMENT,
            "aligned",
        );
        fails(
            strata_dlpack_export(
                buf,
                0,
                8,
                STRATA_TIER_NVME,
                f32_type.code,
                f32_type.bits,
                f32_type.lanes,
                &mut t,
            ),
            STRATA_ERR_INVALID_ARGUMENT,
            "tier",
        );
    }
    // A tensor outlives its runtime: the pin keeps the memory.
    // SAFETY: a writable out-pointer.
    let s = unsafe {
        strata_dlpack_export(
            buf,
            0,
            16,
            STRATA_TIER_DEVICE,
            f32_type.code,
            f32_type.bits,
            f32_type.lanes,
            &mut t,
        )
    };
    assert_eq!(s, STRATA_OK, "{}", last_error());
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    // SAFETY: the tensor is live until freed below.
    let first = unsafe { *((*t).dl_tensor.data as *const f32).add(3) };
    assert_eq!(first, 3.0);
    assert_eq!(strata_dlpack_free(t), STRATA_OK);
}

/// A string or DLPack tensor freed twice is refused even when a newer one
/// of the same size was handed out since: strata holds freed memory back,
/// so the newer one never takes the stale pointer's address (without that,
/// the allocator hands the address straight back within a few rounds).
#[test]
fn a_second_free_is_refused_after_a_newer_object_of_the_same_size() {
    let path = c_path(std::path::Path::new("/"));
    let rt = create(&config(4, 8, 0, &path));
    let json = || {
        let (mut s, mut len) = (null_mut(), 0usize);
        // SAFETY: writable out-pointers.
        let status = unsafe { strata_runtime_config_json(rt, &mut s, &mut len) };
        assert_eq!(status, STRATA_OK, "{}", last_error());
        s
    };
    for _ in 0..64 {
        let stale = json();
        assert_eq!(strata_string_free(stale), STRATA_OK);
        let newer = json();
        assert_ne!(newer, stale);
        fails(
            strata_string_free(stale),
            STRATA_ERR_INVALID_HANDLE,
            "not a string",
        );
        assert_eq!(strata_string_free(newer), STRATA_OK);
    }

    let buf = alloc(rt, PAGE);
    let export = || {
        let mut t: *mut DLManagedTensor = null_mut();
        // SAFETY: a writable out-pointer.
        let s = unsafe {
            strata_dlpack_export(
                buf,
                0,
                64,
                STRATA_TIER_HOST,
                DLDataTypeCode::kDLFloat as u8,
                32,
                1,
                &mut t,
            )
        };
        assert_eq!(s, STRATA_OK, "{}", last_error());
        t
    };
    for _ in 0..64 {
        let stale = export();
        assert_eq!(strata_dlpack_free(stale), STRATA_OK);
        let newer = export();
        assert_ne!(newer, stale);
        fails(
            strata_dlpack_free(stale),
            STRATA_ERR_INVALID_HANDLE,
            "not a DLPack tensor",
        );
        // The newer tensor is whole: its pin ends with it, once.
        assert_eq!(strata_dlpack_free(newer), STRATA_OK);
    }
    assert_eq!(strata_buffer_free(buf), STRATA_OK);
    assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
}

#[test]
fn a_launch_says_the_shift_kernels_sample_at_and_counts_nothing_with_sampling_off() {
    for (sampling, shift, counting) in [
        (0u32, 0u32, true),
        (5, 5, true),
        (STRATA_SAMPLING_OFF, STRATA_SAMPLING_OFF, false),
    ] {
        let mut c = config(2, 8, 0, &c_path(std::path::Path::new("/")));
        c.sampling = sampling;
        let rt = create(&c);
        let buf = alloc(rt, 2 * PAGE);
        let mut map = null_mut();
        let mut launch = null_mut();
        // SAFETY: writable out-pointers throughout.
        unsafe {
            assert_eq!(strata_device_map(buf, &mut map), STRATA_OK);
            assert_eq!(
                strata_map_prepare(map, STRATA_ACCESS_READ_ONLY, &mut launch),
                STRATA_OK
            );
            let mut got = 7u32;
            assert_eq!(strata_launch_sample_shift(launch, &mut got), STRATA_OK);
            assert_eq!(got, shift);
            let mut address = 7u64;
            assert_eq!(
                strata_launch_counters_address(launch, &mut address),
                STRATA_OK
            );
            assert_eq!(address != 0, counting, "sampling {sampling}");
            fails(
                strata_launch_sample_shift(launch, std::ptr::null_mut()),
                STRATA_ERR_NULL_POINTER,
                "shift",
            );
            assert_eq!(strata_launch_end(launch), STRATA_OK);
            assert_eq!(strata_map_free(map), STRATA_OK);
        }
        assert_eq!(strata_runtime_destroy(rt), STRATA_OK);
    }
}
