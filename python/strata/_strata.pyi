"""Type stubs of strata._strata, the extension module (re-exported by strata).

Conventions used throughout:

* Byte ranges (``_Range``) are ``(start, stop)`` tuples of byte offsets,
  half-open like a slice (``(0, 4096)`` is the first 4 KiB), or ``None`` for
  the whole buffer.
* Tiers (``_TierName``) are "device", "host", "cxl" or "nvme"; an unknown
  name, or a tier the runtime lacks, raises InvalidArgumentError.
* Capacities, offsets and lengths are in bytes; page indices are indices.
* Errors are StrataError subclasses carrying strata's one-line message.
* Calls that can wait (read, readinto, write, prefetch, evict, pin, unpin,
  Ticket.wait, building a Runtime) release the GIL.
"""

from os import PathLike
from types import TracebackType
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Type, Union, final

__version__: str

_TierName = Literal["device", "host", "cxl", "nvme"]
_Range = Optional[Tuple[int, int]]
_DType = Literal[
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "bool",
]
# Anything exporting the buffer protocol: bytes, bytearray, memoryview,
# array.array, a NumPy array, ...
_ReadableBuffer = Any
_WritableBuffer = Any

@final
class Runtime:
    """The tiers and everything allocated in them.

    Every keyword is optional: one left out, or None, keeps the
    configuration's default, the same as TOML's and C's (config() shows the
    result); only device=None means something else: no device tier.

    device: "auto" (the default: a GPU where present, else the simulated
        one), "sim", "cuda" (a GPU, else NoDeviceError), or None for no
        device tier.
    device_capacity: the device tier's size (the simulated GPU's, or a cap
        on a real one); default (or None): sim 1 GiB, cuda the GPU's free
        memory less a reserve; 0 for no device tier.
    host_capacity: the host DRAM tier, always present (default: a quarter
        of physical memory).
    huge_pages: transparent huge pages for the host tier (default True).
    numa_node: bind the host tier to this NUMA node (default None: none).
    page_size: the page of every tier: a power of two, 4 KiB ... 2 MiB
        (default 64 KiB).
    cxl_mode: "auto" (a CPU-less NUMA node slower than DRAM, if the
        machine has one),
        "emulated" (DRAM behind a bandwidth cap) or "off" (the default: no
        CXL tier). cxl_capacity: its size (default: the node's memory, else
        half the host tier; 0: none). cxl_bandwidth (bytes/s; default half
        of local memcpy) and cxl_latency_ns (default 100): emulation.
    nvme_path: a directory (a private swap file is made in it), a new file
        name or a block device for an NVMe tier; None (the default) for
        none. An unusable path raises NotFoundError, PermissionDeniedError,
        UnsupportedError, ...
    nvme_capacity: the NVMe tier's size, a whole number of pages, at least
        two (default: 16 GiB or half the free space, whichever is less; 0:
        none).
    nvme_engine: "auto" (the default), "uring" or "psync".
    nvme_queue_depth: NVMe operations in flight per queue (default 32).
    background_eviction: keep tiers between the watermarks (default True).
    watermarks: (low, high) fractions of a tier between which background
        eviction keeps it (0 < low <= high <= 1; default (0.85, 0.95)).
    policy: the balancer's placement policy ("default", "lru", "lfu", ...).
    sampling: count 1 in 2**k accesses (k 0 ... 16; default 0: every
        access), or "off".
    A bad value raises InvalidArgumentError with the message TOML and C
    give for it; an unknown keyword, TypeError.
    """

    def __new__(
        cls,
        *,
        device: Optional[Literal["auto", "sim", "cuda"]] = ...,
        device_capacity: Optional[int] = ...,
        host_capacity: Optional[int] = ...,
        huge_pages: Optional[bool] = ...,
        numa_node: Optional[int] = ...,
        page_size: Optional[int] = ...,
        cxl_mode: Optional[Literal["auto", "emulated", "off"]] = ...,
        cxl_capacity: Optional[int] = ...,
        cxl_bandwidth: Optional[int] = ...,
        cxl_latency_ns: Optional[int] = ...,
        nvme_path: Union[str, "PathLike[str]", None] = ...,
        nvme_capacity: Optional[int] = ...,
        nvme_engine: Optional[Literal["auto", "uring", "psync"]] = ...,
        nvme_queue_depth: Optional[int] = ...,
        background_eviction: Optional[bool] = ...,
        watermarks: Optional[Tuple[float, float]] = ...,
        policy: Optional[str] = ...,
        sampling: Union[int, Literal["off"], None] = ...,
    ) -> "Runtime": ...
    def config(self) -> Dict[str, Any]:
        """The resolved configuration this runtime was built from:
        "page_size", "device", "device_capacity" (None: the default),
        "host" ("capacity", "page_size", "huge_pages", "numa_node"), "cxl"
        and "nvme" (None without the tier), "watermarks" ("low", "high"),
        "policy", "background_eviction", "sampling" (the shift; None:
        none). The same settings through keywords, TOML or C give the same
        dict."""
    @classmethod
    def from_toml(cls, text: str, *, use_env: bool = False) -> "Runtime":
        """A runtime from the TOML of the `strata` command's config file
        (page_size, device, device_capacity, watermarks, policy,
        background_eviction, sampling, [host], [cxl], [nvme]). Values left
        out take their defaults, the NVMe tier included (a private file in
        the temporary directory). With use_env=True, STRATA_* environment
        variables override the text."""
    def alloc(self, nbytes: int, *, prefer: Optional[_TierName] = None) -> "Buffer":
        """Allocates nbytes (rounded up to whole pages). Pages take room in
        a tier when first written: the fastest with room, or `prefer`
        first. OutOfCapacityError when the tiers together cannot promise
        that much."""
    def stats(self) -> Dict[str, Any]:
        """Current use and traffic: "backend", "page_size", "tiers" (per
        tier: "tier", "used_pages", "free_pages", "pinned_pages",
        "emulated"), "reserved_pages", "moves", "failed_moves",
        "first_writes", "abandoned_moves", "faults", "reclaimed_pages",
        "in_flight_moves", "promotions", "demotions", "bypasses",
        "lost_count_readbacks", "lost_pages", "background_errors",
        "device_links", "links", "engine" (per priority, the migration
        engine's batches, mean queueing time, and its lanes' wall and CPU
        seconds running them)."""
    def check(self) -> None:
        """Raises the first failure of background work (eviction, the
        balancer) since the last check, and clears it."""
    def shutdown(self) -> None:
        """Stops background work, waits for moves in flight, raises the
        first background failure not yet raised by check(). Buffers go on
        working; start_balancer() starts the balancer again (background
        eviction stays off)."""
    def stats_json(self) -> str:
        """stats() as a JSON string."""
    @property
    def page_size(self) -> int:
        """The page size in bytes."""
    @property
    def tiers(self) -> List[_TierName]:
        """The configured tiers, fastest first."""
    @property
    def backend(self) -> Optional[Literal["simulated", "cuda"]]:
        """The device tier's backend, None without a device tier."""

def resolve_config(**settings: Any) -> Dict[str, Any]:
    """The configuration Runtime(**settings) would build (as
    Runtime.config() gives it), without opening any tier; a bad value raises
    what Runtime(**settings) would."""

@final
class Buffer:
    """An allocation whose pages may live in any tier; freed when the last
    reference to it (its own, a Pin's, an exported tensor's) goes."""

    @property
    def nbytes(self) -> int:
        """The length in bytes (also len(buffer))."""
    def __len__(self) -> int: ...
    @property
    def page_count(self) -> int:
        """The number of pages."""
    @property
    def page_size(self) -> int:
        """The page size in bytes."""
    def read(self, offset: int = 0, n: Optional[int] = None) -> bytes:
        """n bytes at offset (n=None: to the end) as a new bytes object.
        Pages never written read as zeros."""
    def readinto(self, offset: int, out: _WritableBuffer) -> int:
        """Reads len(out) bytes at offset straight into out (a writable
        C-contiguous buffer: bytearray, memoryview, NumPy array, ...).
        Returns the number of bytes read."""
    def write(self, offset: int, data: _ReadableBuffer) -> None:
        """Writes the bytes of data (any C-contiguous buffer: bytes,
        bytearray, memoryview, NumPy array, ...) at offset."""
    def cancel(self, ticket: "Ticket") -> int:
        """Cancels the request of ticket: its batches still queued are
        dropped (their pages stay where they are), one already moving
        finishes; returns the pages dropped."""
    def prefetch(self, range: _Range, tier: _TierName) -> "Ticket":
        """Moves the pages of range into tier in the background (the call
        returns once the moves are queued, which can wait while the
        engine's queues are full); the Ticket's wait() raises the first
        error, a range outside the buffer is refused at once. Where tier is
        full, its clean copies are dropped first, then its unpinned pages
        outside range not referenced since the clock hand last passed are
        demoted; what would need a page referenced since is declined
        (Ticket.declined counts it; wait() still succeeds).
        OutOfCapacityError when no page could make room at all (what fits
        moves, the rest stays readable where it was)."""
    def evict(self, range: _Range, tier: _TierName) -> None:
        """Moves the pages of range that live in faster tiers down to tier
        (or the next slower tier with room); returns when they are there."""
    def tier_of(self, page: int) -> Optional[_TierName]:
        """The tier page (an index) lives in; None if never written."""
    def residency(self) -> Dict[str, int]:
        """Pages per tier now: "device", "host", "cxl", "nvme", plus
        "unwritten" and "lost"."""
    def pin(self, range: _Range, tier: _TierName, *, dtype: _DType = "uint8") -> "Pin":
        """Makes the pages of range resident in tier ("device", "host" or
        "cxl") and keeps them there until the Pin is released. The Pin
        exports the range through DLPack as a 1-D tensor of dtype. A page
        pinned in another tier (also by a tensor exported from a released
        Pin) is refused with InvalidArgumentError."""

@final
class Ticket:
    """A background request (Buffer.prefetch); dropping it does not cancel it, Buffer.cancel does."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits (at most timeout seconds) and raises the request's first
        error. True when finished, False if the timeout passed first."""
    def done(self) -> bool:
        """Whether the request has finished."""
    @property
    def declined(self) -> int:
        """Pages of a prefetch declined so far: the tier was full and
        making room would have demoted pages referenced since the clock
        hand last passed. They stay readable where they are; wait() still
        succeeds."""

@final
class Pin:
    """Pages held resident in one tier; exports them through DLPack.

    numpy.from_dlpack(pin) and torch.from_dlpack(pin) wrap strata's memory
    in place. Each exported tensor holds its own pin of the range until it
    is gone, whether or not this Pin is released first."""

    @property
    def tier(self) -> _TierName: ...
    @property
    def range(self) -> Tuple[int, int]:
        """The pinned byte range, (start, stop)."""
    @property
    def nbytes(self) -> int: ...
    @property
    def pages(self) -> Tuple[int, int]:
        """The pinned pages (indices), (start, stop)."""
    @property
    def address(self) -> int:
        """The address of the range's first byte (host, or device on a GPU)."""
    @property
    def addresses(self) -> List[int]:
        """Each pinned page's address, in page order."""
    @property
    def dtype(self) -> _DType: ...
    @property
    def pinned(self) -> bool:
        """Whether this Pin still holds its pages."""
    def unpin(self) -> None:
        """Releases the pin now (exported tensors keep theirs)."""
    def __enter__(self) -> "Pin": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A "dltensor" capsule over the pinned range (in place; copy=True
        or another dl_device raise BufferError). UnsupportedError where the
        range spans pages not adjacent in the tier; ClosedError after
        unpin()."""
    def __dlpack_device__(self) -> Tuple[int, int]:
        """(1, 0) for CPU memory (host, CXL, simulated device); (2, 0) on a GPU."""

class StrataError(Exception):
    """The base of every strata error; str(e) is strata's message."""

    kind: Optional[str]
    """The ErrorKind's stable name (e.g. "invalid argument"); None here."""
    code: Optional[int]
    """The ErrorKind's stable code (the C ABI's status, negated)."""

class InvalidArgumentError(StrataError, ValueError): ...
class NoDeviceError(StrataError): ...
class OutOfCapacityError(StrataError): ...
class IoError(StrataError, OSError): ...
class NoSpaceError(StrataError, OSError): ...
class CorruptedError(StrataError): ...
class UnsupportedError(StrataError): ...
class ClosedError(StrataError): ...
class NotFoundError(StrataError, FileNotFoundError): ...
class PermissionDeniedError(StrataError, PermissionError): ...

@final
class OffloadedAdam:
    """Adam/AdamW state (fp32 master weights, both moments) for one float32
    array of parameters, kept in a tier ("host", "cxl", or "nvme" in the
    directory nvme_path) and streamed through in chunks at each step; the
    engine under strata.optim.Adam/AdamW. Decoupled weight decay
    (weight_decay 0 is plain Adam). Arrays are float32 buffers (NumPy
    views of CPU tensors), read and written in place. With runtime (a
    Runtime shared with your buffers), the states live in that runtime's
    tier under its budgets, in chunks of its page size ("nvme": its own
    NVMe tier, no nvme_path; the update on the CPU)."""

    def __new__(
        cls,
        weights: _ReadableBuffer,
        *,
        tier: Literal["host", "cxl", "nvme"] = "host",
        nvme_path: Union[str, "PathLike[str]", None] = None,
        chunk_bytes: int = 1 << 20,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        updater: Literal["cpu", "cuda"] = "cpu",
        importance: Optional[Tuple[float, int]] = None,
        runtime: Optional[Runtime] = None,
    ) -> "OffloadedAdam": ...
    def configure(
        self, *, lr: float, betas: Tuple[float, float], eps: float, weight_decay: float
    ) -> None:
        """Sets the hyper-parameters of the next steps."""
    def step(
        self,
        grads: _ReadableBuffer,
        out: Optional[_WritableBuffer] = None,
        *,
        in_place: bool = False,
        grads_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        out_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        unscale: float = 1.0,
    ) -> Dict[str, float]:
        """One step with these gradients; the updated weights then go into
        out if given (in_place=True: out already holds the weights as the
        previous step left them, and only changed elements are written).
        Mixed precision (with in_place=True): grads_dtype and out_dtype say
        what the arrays hold (16-bit floats viewed as int16), the gradients
        are widened to fp32 times unscale, and the fp32 masters rounded to
        nearest even into out. Returns seconds, bytes_read, bytes_written,
        io_wait_seconds."""
    def importance_window(self) -> Optional[Tuple[int, bool, bytes, bytes]]:
        """Importance mode's window: (deferred_steps, started, resident
        indices as uint64 bytes, accumulated gradients as float32 bytes);
        None in plain mode."""
    def set_importance_window(
        self, deferred_steps: int, started: bool, resident: _ReadableBuffer, accumulated: _ReadableBuffer
    ) -> None:
        """Restores a window read by importance_window (after the states)."""
    def read_state(self, which: int, out: _WritableBuffer) -> None:
        """Reads state which (0 weights, 1 first moment, 2 second moment) into out."""
    def write_state(self, which: int, data: _ReadableBuffer) -> None:
        """Overwrites state which (0, 1 or 2) from data."""
    @property
    def steps(self) -> int:
        """Steps taken."""
    def set_steps(self, steps: int) -> None:
        """Sets the step count (restoring a saved optimizer)."""
    @property
    def tier(self) -> Literal["host", "cxl", "nvme"]: ...
    @property
    def emulated(self) -> bool: ...
    def __len__(self) -> int: ...

class RowTable:
    """An embedding table of rows x dim float32 in a strata buffer (under
    strata.nn.EmbeddingBag; the binding of strata::offload::embedding).
    Indices and offsets are int64 arrays, values float32; calls release
    the GIL. An index or row range outside the table raises IndexError,
    other bad input InvalidArgumentError, before anything is read or
    written."""

    def __init__(
        self,
        runtime: Runtime,
        rows: int,
        dim: int,
        *,
        prefer: Optional[Literal["device", "host", "cxl", "nvme"]] = None,
        threads: int = 16,
    ) -> None: ...
    @property
    def rows(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def buffer(self) -> Buffer: ...
    @property
    def fast_tier(self) -> str: ...
    def page_of_row(self, row: int) -> int: ...
    def tier_of_row(self, row: int) -> Optional[str]: ...
    def write_rows(self, start: int, data: _ReadableBuffer) -> None: ...
    def read_rows(self, indices: _ReadableBuffer, out: _WritableBuffer) -> None: ...
    def bag(
        self,
        indices: _ReadableBuffer,
        offsets: _ReadableBuffer,
        out: _WritableBuffer,
        *,
        weights: Optional[_ReadableBuffer] = None,
        mean: bool = False,
        padding_idx: Optional[int] = None,
    ) -> Tuple[int, int]:
        """Pools the bags into out; returns (lookups, fast_tier_hits)."""
    def sgd(self, rows: _ReadableBuffer, grads: _ReadableBuffer, lr: float) -> None: ...
    def rowwise_adagrad(
        self,
        rows: _ReadableBuffer,
        grads: _ReadableBuffer,
        state: _WritableBuffer,
        lr: float,
        eps: float,
    ) -> None: ...
    def bag_backward(
        self,
        indices: _ReadableBuffer,
        offsets: _ReadableBuffer,
        grad: _ReadableBuffer,
        *,
        weights: Optional[_ReadableBuffer] = None,
        mean: bool = False,
        padding_idx: Optional[int] = None,
        optimizer: str,
        lr: float,
        eps: float = 1e-8,
        state: Optional[_WritableBuffer] = None,
    ) -> None:
        """The fused backward of bag(): each row's summed gradient applied
        once by the optimizer ("sgd", or "rowwise_adagrad" with state)."""
    def stats(self) -> Dict[str, int]: ...
    def reset_stats(self) -> None: ...

def start_balancer(
    runtime: Runtime, *, interval: float = 0.01, min_accesses: int = 0, policy: Optional[str] = None
) -> None: ...
def stop_balancer(runtime: Runtime) -> None: ...
def balance_once(runtime: Runtime) -> Dict[str, int]: ...

@final
class ExpertCache:
    """An MoE expert cache: experts registered into the host tier (NVMe
    beyond host_bytes), device_slots of them in device memory at once
    (host memory on the simulated device); with runtime, on a Runtime
    shared with your buffers (its tiers and budgets). See strata.moe."""

    def __new__(
        cls,
        *,
        slot_bytes: int,
        host_bytes: Optional[int] = None,
        device_slots: Optional[int] = None,
        device_bytes: Optional[int] = None,
        device: Literal["sim", "cuda", "auto"] = "sim",
        nvme_path: Union[str, "PathLike[str]", None] = None,
        nvme_capacity: Optional[int] = None,
        page_size: int = 65536,
        eviction: Literal["lrfu", "reuse", "lru", "no-cache"] = "lrfu",
        decay: float = 0.999,
        per_layer: bool = False,
        layers: int = 1,
        protect_fetches: int = 16,
        nvme_miss_cost: float = 4.0,
        host_cache: bool = False,
        host_in_place: bool = False,
        link_priority: bool = True,
        runtime: Optional[Runtime] = None,
    ) -> "ExpertCache": ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def device_slots(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def backend(self) -> Optional[Literal["simulated", "cuda"]]: ...
    def register(self, layer: int, expert: int, weights: _ReadableBuffer) -> None:
        """Copies 1 to slot_bytes bytes of weights in as this expert's;
        refused while a fetched ExpertSlot is held."""
    def fetch(self, layer: int, expert: int) -> "ExpertSlot":
        """The expert pinned in device memory (in host memory when read in
        place: host_in_place) until the slot is released."""
    def prefetch(self, layer: int, experts: List[int]) -> int:
        """Starts background moves into device memory; returns how many started."""
    def read_ahead(self, layer: int, experts: List[int]) -> int:
        """Starts the reads of experts about to be fetched (misses whose
        fetch waits only for the rest of its read); returns how many started."""
    def cancel_prefetches(self, layer: int, keep: Optional[Sequence[int]] = None) -> int:
        """Cancels the layer's unused, unfinished prefetches (but those of
        the experts in ``keep``, the layer's own picks); returns how many."""
    def advance(self, seconds: float) -> None:
        """Advances the simulated device's modelled clock by compute time
        (InvalidArgumentError for a negative or non-finite duration, or one
        that would take the clock past 1e9 s)."""
    def modelled_now(self) -> Optional[float]: ...
    def is_resident(self, layer: int, expert: int) -> bool: ...
    def is_ready(self, layer: int, expert: int) -> bool:
        """Resident (or on its way), or read in place from host memory."""
    def stats(self) -> Dict[str, Any]:
        """fetches, hits, late_prefetch_hits, prefetches, prefetches_used,
        prefetches_dropped, prefetches_cancelled, evictions, bytes_moved,
        stall_seconds, stall_modelled, hit_rate, prefetch_accuracy, moves
        (experts moved into device memory), moves_paid (of those, fetched
        before they left), served_in_place (read from host memory where
        they are: host_in_place)."""
    def nvme_stats(self) -> Optional[Dict[str, Any]]:
        """The NVMe tier's "reads", "writes", "bytes_read", "bytes_written",
        "errors" and "busy_seconds" (time with I/O in flight); None without
        an NVMe tier."""
    def runtime_stats_json(self) -> str: ...

@final
class ExpertSlot:
    """A fetched expert, pinned where it is read (tier: device memory, or
    host memory when read in place) until release(). Tensors from pin()
    hold their own pins: drop them before releasing."""

    @property
    def key(self) -> Tuple[int, int]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def addresses(self) -> List[int]: ...
    @property
    def tier(self) -> Literal["device", "host"]: ...
    @property
    def contiguous(self) -> bool: ...
    @property
    def held(self) -> bool: ...
    @property
    def buffer(self) -> Buffer: ...
    def pin(self, range: _Range = None, dtype: _DType = "uint8") -> Pin:
        """A strata.Pin (DLPack) over a range of the expert in its tier."""
    def release(self) -> None: ...
    def __enter__(self) -> "ExpertSlot": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

def parse_moe_trace(text: str, source: str = "<trace>") -> Tuple[List[List[List[int]]], int, int]:
    """Parses `token layer expert` lines as `strata bench moe --routing
    file:` does: (routes[token][layer], layers, experts)."""
