//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use strata::io::{self, EngineChoice, IoEngine};

/// The engines to run a test body against: psync always, io_uring where it
/// works here (otherwise the skip is printed, and fails the test when
/// STRATA_REQUIRE_URING=1).
pub fn engines() -> Vec<(&'static str, Arc<dyn IoEngine>)> {
    let mut v: Vec<(&'static str, Arc<dyn IoEngine>)> =
        vec![("psync", io::engine(EngineChoice::Psync).unwrap())];
    match io::engine(EngineChoice::Uring) {
        Ok(e) => v.push(("uring", e)),
        Err(e) => {
            if std::env::var_os("STRATA_REQUIRE_URING").is_some() {
                panic!("io_uring required but unavailable: {e}");
            }
            eprintln!("skipping io_uring: {e}");
        }
    }
    v
}

/// A deterministic byte pattern for page `page` written in round `round`.
pub fn pattern(page: u32, round: u32, len: usize) -> Vec<u8> {
    let mut x = (page as u64) << 32 | round as u64 | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
