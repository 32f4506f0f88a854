//! The runtime's tier stores, held by type: the one place that knows which
//! store serves which tier. Code that needs a medium's own features (the
//! device's batched copies, the host arena's slices, NVMe sessions) asks for
//! the typed store ([`Tiers::device`], [`Tiers::host`], [`Tiers::nvme`]);
//! everything else goes through [`PageStore`].
//!
//! Also the [`Watermarks`] the tiers are kept between.
#![forbid(unsafe_code)]

use std::sync::Arc;

use serde::Serialize;

use crate::device::{self, DeviceChoice};
use crate::error::{Error, Result};
use crate::io::IoEngine;
use crate::link::LinkModel;
use crate::size::format_size;
use crate::sys::Topology;
use crate::tier::{
    CxlConfig, CxlStore, DeviceStore, HostConfig, HostStore, NvmeConfig, NvmeStore, PageStore, Tier,
};

/// Fractions of a tier's capacity: above `high` the reclaimer demotes pages
/// until use is at `low`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Watermarks {
    /// Where reclaim stops.
    pub low: f64,
    /// Where reclaim starts.
    pub high: f64,
}

impl Default for Watermarks {
    fn default() -> Self {
        Self {
            low: 0.85,
            high: 0.95,
        }
    }
}

impl Watermarks {
    /// Reclaim starting at `high` and stopping at `low` (shares of a tier's
    /// capacity; checked when the runtime is built: `0 < low <= high <= 1`).
    pub fn new(low: f64, high: f64) -> Self {
        Self { low, high }
    }

    /// `0 < low <= high <= 1`, or an error naming the values.
    pub fn check(&self) -> Result<()> {
        if self.low > 0.0 && self.low <= self.high && self.high <= 1.0 {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "watermarks low {} and high {} must satisfy 0 < low <= high <= 1",
                self.low, self.high
            )))
        }
    }

    /// `fraction` of `capacity` pages, rounded down.
    pub(crate) fn pages(fraction: f64, capacity: u32) -> u32 {
        (fraction * capacity as f64).floor() as u32
    }
}

/// The configured stores, one field per tier (the host tier is always
/// there). Field order is drop order: the device goes before the host
/// arenas registered with it.
pub(crate) struct Tiers {
    device: Option<DeviceStore>,
    host: HostStore,
    cxl: Option<CxlStore>,
    nvme: Option<NvmeStore>,
    page_size: usize,
}

/// The device tier a runtime asks for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceSpec {
    /// Which backend.
    pub(crate) choice: DeviceChoice,
    /// At most how many bytes of it (0: no device tier).
    pub(crate) capacity: u64,
    /// The link a simulated device models.
    pub(crate) sim_link: LinkModel,
}

impl DeviceSpec {
    /// `capacity` bytes of `choice`, a simulated device on its default
    /// link.
    #[cfg(test)]
    pub(crate) fn new(choice: DeviceChoice, capacity: u64) -> Self {
        Self {
            choice,
            capacity,
            sim_link: crate::device::sim::PCIE_GEN4_X16,
        }
    }
}

impl Tiers {
    /// Opens every configured tier; a device capacity of 0 means no device
    /// tier. Host and CXL arenas are registered with the device, so kernels
    /// reach their pages in place and copies to and from them run
    /// asynchronously.
    pub(crate) fn open(
        page_size: usize,
        device: DeviceSpec,
        host: HostConfig,
        cxl: Option<CxlConfig>,
        nvme: Option<NvmeConfig>,
        nvme_engine: Option<Arc<dyn IoEngine>>,
    ) -> Result<Self> {
        let DeviceSpec {
            choice,
            capacity,
            sim_link,
        } = device;
        let device = if capacity > 0 {
            let backend = device::open_with_link(choice, capacity, sim_link)?;
            Some(DeviceStore::new(backend, capacity, page_size)?)
        } else {
            None
        };
        let host = HostStore::new(&HostConfig { page_size, ..host })?;
        if let Some(d) = &device {
            host.register_with_device(d.backend_handle())?;
        }
        let cxl = match cxl {
            Some(mut c) => {
                c.page_size = page_size;
                let cxl = CxlStore::new(&c, &Topology::detect())?;
                if let Some(d) = &device {
                    cxl.as_host().register_with_device(d.backend_handle())?;
                }
                Some(cxl)
            }
            None => None,
        };
        let nvme = match nvme {
            Some(mut c) => {
                c.page_size = page_size;
                Some(match nvme_engine {
                    Some(engine) => NvmeStore::with_engine(&c, engine)?,
                    None => NvmeStore::new(&c)?,
                })
            }
            None => None,
        };
        Ok(Self {
            device,
            host,
            cxl,
            nvme,
            page_size,
        })
    }

    /// The store of `tier`, if configured.
    #[inline]
    pub(crate) fn get(&self, tier: Tier) -> Option<&dyn PageStore> {
        match tier {
            Tier::Device => self.device.as_ref().map(|s| s as &dyn PageStore),
            Tier::Host => Some(&self.host),
            Tier::Cxl => self.cxl.as_ref().map(|s| s as &dyn PageStore),
            Tier::Nvme => self.nvme.as_ref().map(|s| s as &dyn PageStore),
        }
    }

    /// The device tier's store.
    pub(crate) fn device(&self) -> Option<&DeviceStore> {
        self.device.as_ref()
    }

    /// The host DRAM tier's store.
    pub(crate) fn host(&self) -> &HostStore {
        &self.host
    }

    /// The NVMe tier's store.
    pub(crate) fn nvme(&self) -> Option<&NvmeStore> {
        self.nvme.as_ref()
    }

    /// The configured stores, fastest first.
    pub(crate) fn stores(&self) -> impl Iterator<Item = &dyn PageStore> + '_ {
        Tier::ALL.into_iter().filter_map(|t| self.get(t))
    }

    /// The configured tiers, fastest first.
    /// The fastest configured tier.
    pub(crate) fn fastest(&self) -> Tier {
        self.stores()
            .next()
            .expect("a runtime has a host tier")
            .tier()
    }

    pub(crate) fn list(&self) -> Vec<Tier> {
        self.stores().map(|s| s.tier()).collect()
    }

    /// The configured tiers slower than `tier`, fastest first (where its
    /// pages are demoted to).
    pub(crate) fn below(&self, tier: Tier) -> Vec<Tier> {
        self.stores()
            .map(|s| s.tier())
            .filter(|&t| t > tier)
            .collect()
    }

    /// The configured memory tiers (all but NVMe), fastest first.
    pub(crate) fn memory(&self) -> Vec<Tier> {
        self.stores()
            .map(|s| s.tier())
            .filter(|&t| t != Tier::Nvme)
            .collect()
    }

    /// Slots across every tier.
    pub(crate) fn total_pages(&self) -> u64 {
        self.stores().map(|s| s.capacity_pages() as u64).sum()
    }

    /// Free slots across `tiers`.
    pub(crate) fn free_pages(&self, tiers: &[Tier]) -> usize {
        tiers
            .iter()
            .filter_map(|&t| self.get(t))
            .map(|s| s.capacity_pages().saturating_sub(s.used_pages()) as usize)
            .sum()
    }

    /// Whether `tier` is above its high watermark.
    pub(crate) fn above_high(&self, tier: Tier, watermarks: &Watermarks) -> bool {
        self.get(tier).is_some_and(|s| {
            s.used_pages() > Watermarks::pages(watermarks.high, s.capacity_pages())
        })
    }

    /// "host 1 MiB of 4 MiB used, nvme …", for errors.
    pub(crate) fn capacity_report(&self) -> String {
        let page = self.page_size as u64;
        self.stores()
            .map(|s| {
                format!(
                    "{} {} of {} used",
                    s.tier(),
                    format_size(s.used_pages() as u64 * page),
                    format_size(s.capacity_pages() as u64 * page)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}
