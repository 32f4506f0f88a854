//! The opaque handle types C sees, the objects behind them, and one handle
//! table per type.
#![forbid(unsafe_code)]
#![allow(non_camel_case_types)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use strata::runtime::{DeviceMap, OwnedLaunch, OwnedPin, Ticket};
use strata::{Buffer, Runtime};

use crate::cast::{handle_bits, handle_ptr};
use crate::handle::{Handles, Owner};
use crate::status::{Fail, R, STRATA_ERR_CLOSED};

/// A runtime: the tiers and everything allocated in them. Opaque; made by
/// `strata_runtime_create` or `strata_runtime_from_toml`, ended by
/// `strata_runtime_destroy`.
pub struct strata_runtime {
    _opaque: [u8; 0],
}

/// An allocation whose pages live in any tier. Opaque; made by
/// `strata_alloc`, ended by `strata_buffer_free`.
pub struct strata_buffer {
    _opaque: [u8; 0],
}

/// Pages held resident in one tier. Opaque; made by `strata_buffer_pin`, ended by
/// `strata_unpin`.
pub struct strata_pin {
    _opaque: [u8; 0],
}

/// An asynchronous request. Opaque; made by `strata_prefetch`, ended by
/// `strata_ticket_free`.
pub struct strata_ticket {
    _opaque: [u8; 0],
}

/// A buffer's device map. Opaque; made by `strata_device_map`, ended by
/// `strata_map_free`.
pub struct strata_map {
    _opaque: [u8; 0],
}

/// A prepared device map while kernels run. Opaque; made by
/// `strata_map_prepare`, ended by `strata_launch_end`.
pub struct strata_launch {
    _opaque: [u8; 0],
}

/// An offloaded Adam optimizer. Opaque; made by `strata_optim_create`,
/// ended by `strata_optim_free`.
pub struct strata_optim {
    _opaque: [u8; 0],
}

/// An MoE expert cache. Opaque; made by `strata_moe_create`, ended by
/// `strata_moe_free`.
pub struct strata_moe {
    _opaque: [u8; 0],
}

/// An expert pinned in device memory. Opaque; made by `strata_moe_fetch`,
/// ended by `strata_moe_release`.
pub struct strata_expert_pin {
    _opaque: [u8; 0],
}

/// The cache behind a `strata_moe`: registration needs it unshared, so it
/// sits behind a lock and fetched experts hold their own reference.
pub(crate) type MoeObj = RwLock<Arc<strata::offload::moe::ExpertCache>>;

/// A runtime and the gate its children are created through.
pub(crate) struct RtObj {
    pub(crate) rt: Runtime,
    pub(crate) owner: Owner,
    /// False once `strata_runtime_destroy` began: no child may be added.
    open: RwLock<bool>,
    /// The trace being recorded, if any (`strata_trace_start`).
    pub(crate) trace: parking_lot::Mutex<Option<strata::runtime::TraceRecorder>>,
}

impl RtObj {
    pub(crate) fn new(rt: Runtime) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self {
            rt,
            owner: NEXT.fetch_add(1, Ordering::Relaxed),
            open: RwLock::new(true),
            trace: parking_lot::Mutex::new(None),
        }
    }

    /// Registers a child object of this runtime, unless the runtime is
    /// being destroyed (checked under the gate, so that a child is either
    /// swept by the destruction or refused here — never left behind).
    pub(crate) fn adopt<T>(&self, table: &Handles<T>, obj: T) -> R<u64> {
        let open = self.open.read();
        if !*open {
            return Err(Fail::new(STRATA_ERR_CLOSED, "the runtime was destroyed"));
        }
        table.insert(obj, self.owner)
    }

    /// Closes the gate; false if it was already closed.
    pub(crate) fn close(&self) -> bool {
        std::mem::replace(&mut *self.open.write(), false)
    }
}

/// A buffer and its runtime.
pub(crate) struct BufferObj {
    pub(crate) buffer: Arc<Buffer>,
    pub(crate) rt: Arc<RtObj>,
}

/// A device map and its runtime.
pub(crate) struct MapObj {
    pub(crate) map: DeviceMap,
    pub(crate) rt: Arc<RtObj>,
}

pub(crate) static RUNTIMES: Handles<RtObj> = Handles::new(crate::handle::RUNTIME_TAG, "runtime");
pub(crate) static BUFFERS: Handles<BufferObj> = Handles::new(2, "buffer");
pub(crate) static PINS: Handles<OwnedPin> = Handles::new(3, "pin");
pub(crate) static TICKETS: Handles<Ticket> = Handles::new(4, "ticket");
pub(crate) static MAPS: Handles<MapObj> = Handles::new(5, "device map");
pub(crate) static LAUNCHES: Handles<OwnedLaunch> = Handles::new(6, "launch");
pub(crate) static OPTIMS: Handles<parking_lot::Mutex<strata::offload::optim::OffloadedAdam>> =
    Handles::new(7, "optimizer");

/// Looks up a handle of one type.
pub(crate) trait Handle {
    type Obj: 'static;
    fn table() -> &'static Handles<Self::Obj>;
}

macro_rules! handle {
    ($c:ty, $obj:ty, $table:ident) => {
        impl Handle for $c {
            type Obj = $obj;
            fn table() -> &'static Handles<$obj> {
                &$table
            }
        }
    };
}
handle!(strata_runtime, RtObj, RUNTIMES);
handle!(strata_buffer, BufferObj, BUFFERS);
handle!(strata_pin, OwnedPin, PINS);
handle!(strata_ticket, Ticket, TICKETS);
handle!(strata_map, MapObj, MAPS);
handle!(strata_launch, OwnedLaunch, LAUNCHES);
pub(crate) static MOES: Handles<MoeObj> = Handles::new(8, "expert cache");
pub(crate) static EXPERT_PINS: Handles<strata::offload::moe::OwnedExpertPin> =
    Handles::new(9, "expert pin");
handle!(strata_moe, MoeObj, MOES);
handle!(
    strata_expert_pin,
    strata::offload::moe::OwnedExpertPin,
    EXPERT_PINS
);
handle!(
    strata_optim,
    parking_lot::Mutex<strata::offload::optim::OffloadedAdam>,
    OPTIMS
);

/// The object behind a handle.
#[inline]
pub(crate) fn get<H: Handle>(h: *const H) -> R<Arc<H::Obj>> {
    H::table().get(handle_bits(h))
}

/// Runs a call that never blocks on the object behind a handle (see
/// [`Handles::with`]).
#[inline]
pub(crate) fn with<H: Handle, U>(h: *const H, f: impl FnOnce(&H::Obj) -> U) -> R<U> {
    H::table().with(handle_bits(h), f)
}

/// Removes a handle's object (`None` for NULL). The caller drops it.
pub(crate) fn remove<H: Handle>(h: *const H) -> R<Option<Arc<H::Obj>>> {
    H::table().remove(handle_bits(h))
}

/// As [`remove`], but the handle reads `STRATA_ERR_CLOSED` from now on.
pub(crate) fn close<H: Handle>(h: *const H) -> R<Option<Arc<H::Obj>>> {
    H::table().close(handle_bits(h))
}

/// A new handle's pointer from its bits.
pub(crate) fn ptr<H>(bits: u64) -> *mut H {
    handle_ptr(bits)
}
