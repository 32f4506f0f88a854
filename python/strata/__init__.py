"""strata: memory tiering for GPU programs.

Every page of a strata buffer lives in one of four tiers - GPU memory
("device"), host DRAM ("host"), CXL memory ("cxl"), NVMe ("nvme") - and moves
between them as asked (prefetch, evict, pin) or as it warms and cools.

    import numpy as np
    import strata

    rt = strata.Runtime(device="sim", device_capacity=1 << 20, host_capacity=8 << 20)
    buf = rt.alloc(4 << 20)
    buf.write(0, np.arange(1024, dtype=np.float32))
    buf.prefetch((0, buf.nbytes), "host").wait()
    with buf.pin((0, 4096), "host", dtype="float32") as pin:
        view = np.from_dlpack(pin)  # strata's memory, no copy

Conventions: byte ranges are (start, stop) tuples, half-open like slices, or
None for the whole buffer; tiers are named "device", "host", "cxl", "nvme".
Errors are StrataError subclasses, one per kind (InvalidArgumentError is
also a ValueError). Calls that can wait release the GIL.

Runtime's keywords are a partial configuration: each one left out keeps
the default that TOML and C have too. Runtime.config() shows the resolved
configuration; resolve_config(**settings) shows it without opening a tier.

strata.optim (import it explicitly; it needs torch) has Adam and AdamW as
torch.optim.Optimizer subclasses whose state lives in strata's tiers.
"""

from ._strata import (
    Buffer,
    ClosedError,
    CorruptedError,
    InvalidArgumentError,
    IoError,
    NoDeviceError,
    NoSpaceError,
    NotFoundError,
    OffloadedAdam,
    OutOfCapacityError,
    PermissionDeniedError,
    Pin,
    Runtime,
    StrataError,
    Ticket,
    UnsupportedError,
    __version__,
    resolve_config,
)

__all__ = [
    "Buffer",
    "ClosedError",
    "CorruptedError",
    "InvalidArgumentError",
    "IoError",
    "NoDeviceError",
    "NoSpaceError",
    "NotFoundError",
    "OffloadedAdam",
    "OutOfCapacityError",
    "PermissionDeniedError",
    "Pin",
    "Runtime",
    "StrataError",
    "Ticket",
    "UnsupportedError",
    "__version__",
    "resolve_config",
]

# The binding under strata.nn (import strata.nn for the torch modules:
# EmbeddingBag, EmbeddingBagCollection).
from ._strata import RowTable, balance_once, start_balancer, stop_balancer  # noqa: E402

__all__ += ["RowTable", "balance_once", "start_balancer", "stop_balancer"]

# The MoE expert cache under strata.moe (import strata.moe explicitly: it
# needs torch).
from ._strata import ExpertCache, ExpertSlot, parse_moe_trace  # noqa: E402

__all__ += ["ExpertCache", "ExpertSlot", "parse_moe_trace"]
