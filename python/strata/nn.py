"""strata.nn: embedding tables whose rows live in strata's tiers.

``EmbeddingBag`` has the interface of ``torch.nn.EmbeddingBag`` (sum or
mean pooling, ``offsets`` or 2-D input, ``per_sample_weights``,
``include_last_offset``, ``padding_idx``); its table is a strata buffer of
fp32 rows instead of a dense parameter, so it can be larger than DRAM. The
rows read most are promoted into the runtime's fastest tier by strata's
balancer (from per-page access counts); the rest stay below, on NVMe.
``forward`` gathers and pools a whole batch in one call into Rust with the
GIL released; ``backward`` produces the gradient of the touched rows and,
with ``optimizer="sgd"`` or ``"rowwise_adagrad"``, applies it at once in
place (a fused sparse update, as FBGEMM's table-batched embedding bags do).
``EmbeddingBagCollection`` holds several tables (a DLRM model's sparse
features) in one runtime, so they share the fast tier.

    import torch
    import strata.nn

    emb = strata.nn.EmbeddingBag(
        1_000_000, 64, mode="sum",
        fast_bytes=64 << 20,            # DRAM for the hottest rows
        nvme_path="/var/tmp",           # the rest, in a private file there
        optimizer="rowwise_adagrad", lr=0.05,
    )
    out = emb(indices, offsets)         # (bags, 64), as torch.nn.EmbeddingBag
    loss = model_head(out).sum()
    loss.backward()                     # rows updated in place in strata

Tiers: with ``fast_bytes`` the runtime has a simulated device tier of that
size as its fastest tier. The simulated device's memory is a host DRAM
arena (copies are not slowed), so the hot rows live in DRAM; strata's
balancer promotes into the device tier, which is why it is that tier and
not the host tier. Below it sit a small host tier and, with ``nvme_path``,
an NVMe tier holding the rest (without ``nvme_path`` the rest is in the
host tier). Without ``fast_bytes`` the whole table lives in host DRAM.
Pass ``runtime=`` to use a runtime of your own (the module then leaves
its balancer to you: ``strata.nn.start_balancer(rt)``).

Hit rates: ``emb.stats()`` counts lookups and those whose row was in the
fastest tier when the batch was gathered.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import _strata
from ._bags import _bag_backward, _concat_bags
from ._checks import check_page_size
from ._strata import RowTable, Runtime, balance_once, start_balancer, stop_balancer

__all__ = [
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "initial_rows",
    "RowTable",
    "balance_once",
    "start_balancer",
    "stop_balancer",
]

_OPTIMIZERS = (None, "sgd", "rowwise_adagrad")
# A small host tier between the fast tier and NVMe: pages pass through it
# only when the tiers above are full.
_HOST_PAGES = 16
# Worker threads of a table's NVMe reads and updates (the default).
_NVME_WRITERS = 16


# Rows of a table's initial values drawn from one generator (its seed mixed
# from the collection's seed, the table and the block), so that a table
# starts alike however its rows are sharded.
_INIT_BLOCK = 1 << 14


def initial_rows(seed: int, table: int, dim: int, lo: int, hi: int, low: float, high: float) -> Tensor:
    """Rows [lo, hi) of table `table`'s initial values in a collection made
    from EmbeddingBagConfigs with `seed`: U(low, high), drawn in blocks of
    16384 rows, each block from a generator seeded by (seed, table,
    block), so every sharding of the table starts from the same rows (and
    a peer's table can be given them)."""
    parts = []
    for block in range(lo // _INIT_BLOCK, -(-hi // _INIT_BLOCK)):
        a = block * _INIT_BLOCK
        mixed = (seed * 0x9E3779B97F4A7C15 + table * 0xBF58476D1CE4E5B9 + block) % (1 << 63)
        g = torch.Generator().manual_seed(mixed)
        rows = torch.empty(_INIT_BLOCK, dim).uniform_(low, high, generator=g)
        parts.append(rows[max(lo, a) - a : min(hi, a + _INIT_BLOCK) - a])
    return torch.cat(parts) if parts else torch.empty(0, dim)


def _round_up(n: int, page: int) -> int:
    return (n + page - 1) // page * page


def _make_runtime(
    table_bytes: int,
    fast_bytes: Optional[int],
    nvme_path,
    nvme_bytes: Optional[int],
    page_size: int,
) -> Runtime:
    """A runtime for tables of table_bytes: see the module's docstring."""
    check_page_size(page_size)
    if fast_bytes is not None and (not isinstance(fast_bytes, int) or fast_bytes < page_size):
        raise _strata.InvalidArgumentError(
            f"fast_bytes {fast_bytes!r} must be an int of at least one page ({page_size} bytes)"
        )
    if nvme_bytes is not None and nvme_path is None:
        raise _strata.InvalidArgumentError("nvme_bytes is given without nvme_path")
    total = _round_up(table_bytes, page_size)
    if fast_bytes is None:
        if nvme_path is not None:
            raise _strata.InvalidArgumentError(
                "nvme_path needs fast_bytes (the DRAM that holds the hot rows)"
            )
        return Runtime(device=None, host_capacity=total, page_size=page_size)
    fast = _round_up(fast_bytes, page_size)
    kw = dict(
        device="sim",
        device_capacity=fast,
        page_size=page_size,
        # The balancer alone decides what stays in the fast tier.
        background_eviction=False,
        watermarks=(1.0, 1.0),
    )
    if nvme_path is None:
        kw["host_capacity"] = max(total, _HOST_PAGES * page_size)
    else:
        kw["host_capacity"] = _HOST_PAGES * page_size
        kw["nvme_path"] = nvme_path
        # An NVMe page is rewritten copy-then-commit into one of the store's
        # reserve slots (1/64 of it, at most 64), beyond what it holds: the
        # default holds every page of the tables (all of them, where row
        # caches take the fast tier) and room for _NVME_WRITERS concurrent
        # writes of an update.
        kw["nvme_capacity"] = total + 64 * _NVME_WRITERS * page_size if nvme_bytes is None else nvme_bytes
    return Runtime(**kw)


def _as_index(t: Tensor, what: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor, not {t.dtype}")
    return t.detach().to("cpu", torch.int64).contiguous()


def _bags(
    input: Tensor, offsets: Optional[Tensor], include_last_offset: bool
) -> Tuple[Tensor, Tensor]:
    """Flat int64 indices and offsets with one entry more than the bags."""
    idx = _as_index(input, "input")
    if idx.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets must be None when input is 2-D (each row is a bag)")
        b, n = idx.shape
        off = torch.arange(0, b * n + 1, n, dtype=torch.int64) if n else torch.zeros(b + 1, dtype=torch.int64)
        return idx.reshape(-1), off
    if idx.dim() != 1:
        raise ValueError(f"input must be 1-D (with offsets) or 2-D, not {idx.dim()}-D")
    if offsets is None:
        raise ValueError("offsets is required when input is 1-D")
    off = _as_index(offsets, "offsets")
    if off.dim() != 1:
        raise ValueError(f"offsets must be 1-D, not {off.dim()}-D")
    if include_last_offset:
        if off.numel() == 0:
            raise ValueError("include_last_offset=True needs at least one offset")
        last = int(off[-1])
        if 0 <= last < idx.numel():
            # torch pools up to the last offset and leaves the rest.
            idx = idx[:last]
        return idx, off
    if off.numel() == 0:
        # No bags: torch's result has no rows, whatever the input.
        return idx[:0], torch.zeros(1, dtype=torch.int64)
    if int(off.max()) > idx.numel():
        raise ValueError(f"offsets run past the {idx.numel()} indices (the largest is {int(off.max())})")
    return idx, torch.cat([off, torch.tensor([idx.numel()], dtype=torch.int64)])


def _gather(module, idx: Tensor, off: Tensor, weights: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """module's table pools the bags (the GIL released while it reads):
    the pooled rows and the float32 weights it used."""
    b = off.numel() - 1
    out = torch.empty(b, module.embedding_dim, dtype=torch.float32)
    w = None if weights is None else weights.detach().to("cpu", torch.float32).contiguous()
    module._table.bag(
        idx.numpy(),
        off.numpy(),
        out.numpy(),
        weights=None if w is None else w.numpy(),
        mean=module.mode == "mean",
        padding_idx=module.padding_idx,
    )
    return out, w


def _graph_task() -> Optional[int]:
    """The backward pass running on this thread (None where torch does not
    say: every deferred update is then applied)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else int(current())


# Threads that gather a collection's tables at once, where their rows may
# be on NVMe: each table's reads wait on the disk with the GIL released,
# so several tables keep more reads in flight than one.
_GATHERERS = 8
_gather_pool: Optional[ThreadPoolExecutor] = None
_gather_pool_lock = threading.Lock()


def _gather_all(jobs):
    """_gather of every (module, idx, off, weights) of jobs, at once."""
    global _gather_pool
    with _gather_pool_lock:
        if _gather_pool is None:
            _gather_pool = ThreadPoolExecutor(_GATHERERS, thread_name_prefix="strata-gather")
    return list(_gather_pool.map(lambda job: _gather(*job), jobs))


class _BagFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weights, module, idx, off, gathered=None):  # noqa: D401
        # gathered: the pooled rows and weights _gather gave already.
        out, w = gathered if gathered is not None else _gather(module, idx, off, weights)
        ctx.module = module
        rows = None
        if weights is not None and ctx.needs_input_grad[1]:
            # The weights' gradient is the rows pooled now: a backward of
            # another use of the table may update them before this one runs.
            rows = torch.empty(idx.numel(), module.embedding_dim, dtype=torch.float32)
            module._table.read_rows(idx.numpy(), rows.numpy())
        ctx.save_for_backward(idx, off, w, rows)
        ctx.has_weights = weights is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        idx, off, w, rows = ctx.saved_tensors
        module = ctx.module
        grad_out = grad_out.detach().to("cpu", torch.float32).contiguous()
        grad_w = None
        if ctx.has_weights and ctx.needs_input_grad[1]:
            grad_w = _bag_backward(module, idx, off, w, grad_out, rows_grad=False, weights_grad=True, rows=rows)
        grad_anchor = None
        if ctx.needs_input_grad[0]:
            # The rows' update waits for the anchor's gradient (see
            # EmbeddingBag.__init__): only a pass that wants it applies it.
            module._defer(lambda: _bag_backward(module, idx, off, w, grad_out))
            grad_anchor = torch.zeros(())
        return grad_anchor, grad_w, None, None, None, None


class EmbeddingBag(nn.Module):
    """torch.nn.EmbeddingBag with its table in strata's tiers.

    num_embeddings, embedding_dim, mode ("sum" or "mean"; "max" is not
    offered), padding_idx and include_last_offset as torch's.
    max_norm and scale_grad_by_freq are not offered (they raise if set);
    sparse is accepted and changes nothing: gradients are sparse by nature
    here and go to ``self.grad`` (a coalesced sparse COO tensor) or, with an
    optimizer, into the table, in a backward pass that wants the table's
    gradient (``loss.backward()``; not torch.autograd.grad for other
    inputs, nor backward(inputs=...) without the module);
    ``requires_grad_(False)`` on the module (or on its
    collection) freezes the table — a parent module's does not reach it,
    since the table is no parameter. The table is float32 on the CPU side:
    .to(), .half() and the like change neither it nor its accumulators.

    Tiers: runtime (a strata.Runtime to allocate in), or fast_bytes (DRAM
    for the hot rows), nvme_path and nvme_bytes (NVMe for the rest) and
    page_size for one made here; see the module's docstring.
    balance: "background" starts the balancer of a runtime made here
    (every balance_interval seconds); "manual" leaves it to ``balance()``.

    optimizer: None, "sgd" (w -= lr*g) or "rowwise_adagrad" (FBGEMM's
    EXACT_ROWWISE_ADAGRAD: one accumulator per row, state += mean(g*g),
    w -= lr/(sqrt(state)+eps)*g), applied in backward to the touched rows.
    The accumulators are ``momentum`` (float32 in DRAM, 4 bytes a row).
    state_dict() holds the table as torch's ``weight`` (read into a dense
    tensor: the whole table in memory), and with rowwise_adagrad
    ``momentum`` beside it, so a state dict loads between this module and
    torch's EmbeddingBag; load_state_dict() writes them back (a dict
    without ``momentum``, torch's, starts the accumulators at zero).

    _weight: initial rows (a (num_embeddings, embedding_dim) tensor);
    without it the rows are drawn from N(0, 1), as torch's, or from
    U(init[0], init[1]) where init is given, chunk by chunk (generator: a
    torch.Generator for them), or init(start, stop) where init is a
    function giving rows [start, stop). threads: NVMe reads in flight.
    row_cache: rows kept in the fast tier at their own granularity (a row
    cache, as FBGEMM's UVM caching; 0, the default: none), chosen by
    row_cache_policy (a strata policy name; the default policy when None).
    The cache takes row_cache rows of the fast tier's memory, in whole
    pages, for as long as the table lives; every lookup reads through it,
    and an update of a cached row stays in it until the row leaves it
    (a write-back cache; read_rows and the forward see it at once).
    stats() counts its hits
    ("cache_hits", among "fast_hits") and the rows it took in
    ("cache_fills").
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: Optional[Tensor] = None,
        include_last_offset: bool = False,
        padding_idx: Optional[int] = None,
        *,
        runtime: Optional[Runtime] = None,
        fast_bytes: Optional[int] = None,
        nvme_path=None,
        nvme_bytes: Optional[int] = None,
        page_size: int = 4096,
        balance: str = "background",
        balance_interval: float = 0.01,
        optimizer: Optional[str] = None,
        lr: float = 0.01,
        eps: float = 1e-8,
        generator: Optional[torch.Generator] = None,
        threads: int = _NVME_WRITERS,
        init: Optional[Tuple[float, float]] = None,
        row_cache: int = 0,
        row_cache_policy: Optional[str] = None,
    ) -> None:
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ValueError(f'mode {mode!r} is not offered (use "sum" or "mean")')
        if not (isinstance(row_cache, int) and row_cache >= 0):
            raise ValueError(f"row_cache {row_cache!r} must be a number of rows (0: none)")
        if max_norm is not None or scale_grad_by_freq:
            raise ValueError("max_norm and scale_grad_by_freq are not offered")
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f'optimizer {optimizer!r} is not one of None, "sgd", "rowwise_adagrad"')
        if balance not in ("background", "manual"):
            raise ValueError(f'balance {balance!r} is not "background" or "manual"')
        if not (isinstance(num_embeddings, int) and num_embeddings > 0):
            raise ValueError(f"num_embeddings {num_embeddings!r} must be a positive int")
        if not (isinstance(embedding_dim, int) and embedding_dim > 0):
            raise ValueError(f"embedding_dim {embedding_dim!r} must be a positive int")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise IndexError(f"padding_idx {padding_idx} is out of range for {num_embeddings} rows")
            padding_idx %= num_embeddings
        if not (math.isfinite(lr) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"lr {lr} and eps {eps} must be finite (eps non-negative)")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.padding_idx = padding_idx
        self.sparse = sparse
        self.optimizer = optimizer
        self.lr = lr
        self.eps = eps
        self.grad: Optional[Tensor] = None
        table_bytes = num_embeddings * embedding_dim * 4
        self._own_runtime = runtime is None
        if runtime is None:
            runtime = _make_runtime(table_bytes, fast_bytes, nvme_path, nvme_bytes, page_size)
        elif fast_bytes is not None or nvme_path is not None or nvme_bytes is not None:
            raise ValueError("give either runtime or fast_bytes/nvme_path/nvme_bytes, not both")
        self.runtime = runtime
        self._table = RowTable(
            runtime,
            num_embeddings,
            embedding_dim,
            threads=threads,
            row_cache=row_cache,
            row_cache_policy=row_cache_policy,
        )
        # The graph's handle on the table: autograd calls backward only
        # for outputs that depend on something requiring a gradient.
        self._anchor = torch.zeros((), requires_grad=True)
        # Backward's updates of the rows wait here until the anchor's
        # gradient is accumulated, which autograd does only in a pass that
        # wants it (not torch.autograd.grad for other inputs, nor
        # backward(inputs=...) without it). A weak reference: no cycle
        # keeps the table's memory alive after the module goes.
        self._pending: list = []
        me = weakref.ref(self)

        def _accumulated(anchor: Tensor) -> None:
            anchor.grad = None
            m = me()
            if m is not None:
                m._apply_pending()

        self._anchor.register_post_accumulate_grad_hook(_accumulated)
        # Not a buffer: .to() and .half() must not move or cast what the
        # table's update reads as float32 memory (state_dict() saves it).
        self.momentum = torch.zeros(num_embeddings if optimizer == "rowwise_adagrad" else 0, dtype=torch.float32)
        self._init_rows(_weight, generator, init)
        if padding_idx is not None and _weight is None:
            self._table.write_rows(padding_idx, torch.zeros(embedding_dim).numpy())
        if self._own_runtime and balance == "background" and "device" in runtime.tiers:
            start_balancer(runtime, interval=balance_interval)

    def _init_rows(self, weight: Optional[Tensor], generator, init=None) -> None:
        n, d = self.num_embeddings, self.embedding_dim
        if weight is not None:
            if tuple(weight.shape) != (n, d):
                raise ValueError(f"_weight has shape {tuple(weight.shape)}, not ({n}, {d})")
        chunk = max(1, (8 << 20) // (4 * d))
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            if weight is not None:
                rows = weight[start:stop].detach().to("cpu", torch.float32).contiguous()
            elif callable(init):
                rows = init(start, stop)
                if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (stop - start, d):
                    got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
                    raise ValueError(f"init({start}, {stop}) gave {got}, not rows of shape ({stop - start}, {d})")
                rows = rows.detach().to("cpu", torch.float32).contiguous()
            elif init is not None:
                rows = torch.empty(stop - start, d).uniform_(init[0], init[1], generator=generator)
            else:
                rows = torch.randn(stop - start, d, generator=generator)
            self._table.write_rows(start, rows.numpy())

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Tensor,
        freeze: bool = True,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: Optional[int] = None,
        **strata_kwargs,
    ) -> "EmbeddingBag":
        """As torch.nn.EmbeddingBag.from_pretrained: rows from a 2-D tensor.
        freeze=True drops the optimizer (rows never change)."""
        if embeddings.dim() != 2:
            raise ValueError("embeddings must be 2-D")
        if freeze:
            strata_kwargs["optimizer"] = None
        m = cls(
            embeddings.shape[0],
            embeddings.shape[1],
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            mode=mode,
            sparse=sparse,
            _weight=embeddings,
            include_last_offset=include_last_offset,
            padding_idx=padding_idx,
            **strata_kwargs,
        )
        m._frozen = freeze
        return m

    _frozen = False

    def requires_grad_(self, requires_grad: bool = True) -> "EmbeddingBag":
        """As torch's: False freezes the table (backward neither updates its
        rows nor fills grad), True trains it again."""
        super().requires_grad_(requires_grad)
        self._frozen = not requires_grad
        return self

    def forward(
        self,
        input: Tensor,
        offsets: Optional[Tensor] = None,
        per_sample_weights: Optional[Tensor] = None,
    ) -> Tensor:
        idx, off, per_sample_weights = self._inputs(input, offsets, per_sample_weights)
        out = self._pool(idx, off, per_sample_weights)
        if input.device.type != "cpu":
            out = out.to(input.device)
        return out

    def _inputs(self, input: Tensor, offsets: Optional[Tensor], per_sample_weights: Optional[Tensor]):
        """forward's arguments, checked, as flat idx, off (one entry more
        than the bags) and weights."""
        idx, off = _bags(input, offsets, self.include_last_offset)
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError('per_sample_weights are only offered with mode="sum"')
            if tuple(per_sample_weights.shape) != tuple(input.shape):
                raise ValueError(
                    f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                    f"input {tuple(input.shape)}"
                )
            # The lookups torch leaves unpooled (see _bags) weigh nothing.
            per_sample_weights = per_sample_weights.reshape(-1)[: idx.numel()]
        return idx, off, per_sample_weights

    def _pool(self, idx: Tensor, off: Tensor, weights: Optional[Tensor], gathered=None) -> Tensor:
        """The bags of flat int64 idx and off (one entry more than the
        bags), with autograd; gathered: what _gather gave for them already."""
        anchor = self._anchor if not self._frozen else self._anchor.detach()
        return _BagFunction.apply(anchor, weights, self, idx, off, gathered)

    def _defer(self, update) -> None:
        """Holds backward's update of the rows for _apply_pending."""
        self._pending.append((_graph_task(), update))

    def _apply_pending(self) -> None:
        """Applies the updates the running backward pass deferred; those of
        passes that did not want the table's gradient are dropped."""
        task = _graph_task()
        pending, self._pending = self._pending, []
        for t, update in pending:
            if task is None or t == task:
                update()

    def _apply_grad(self, rows: Tensor, grads: Tensor) -> None:
        rows = rows.contiguous()
        grads = grads.contiguous()
        if self.optimizer == "sgd":
            self._table.sgd(rows.numpy(), grads.numpy(), self.lr)
        elif self.optimizer == "rowwise_adagrad":
            self._table.rowwise_adagrad(rows.numpy(), grads.numpy(), self.momentum.numpy(), self.lr, self.eps)
        else:
            g = torch.sparse_coo_tensor(
                rows.unsqueeze(0),
                grads,
                (self.num_embeddings, self.embedding_dim),
                check_invariants=False,  # distinct, in-range rows by construction
            )
            self.grad = g.coalesce() if self.grad is None else (self.grad + g).coalesce()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.grad = None

    # -- the table --

    def read_rows(self, rows: Tensor) -> Tensor:
        """The current values of rows (an int tensor) as a (len, dim) tensor."""
        idx = _as_index(rows, "rows").reshape(-1)
        out = torch.empty(idx.numel(), self.embedding_dim, dtype=torch.float32)
        self._table.read_rows(idx.numpy(), out.numpy())
        return out

    @property
    def weight(self) -> Tensor:
        """The whole table as a dense tensor (a copy: for small tables and
        tests; state_dict() saves it under this name)."""
        return self._dense_rows()

    # -- the table in state_dict(), as torch's "weight" --

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # The table is no parameter of the module (it lives in strata's
        # tiers): saved as the dense (num_embeddings, embedding_dim) rows
        # torch's EmbeddingBag saves, read in chunks.
        destination[prefix + "weight"] = self._dense_rows()
        if self.optimizer == "rowwise_adagrad":
            destination[prefix + "momentum"] = self.momentum.clone()

    def _dense_rows(self) -> Tensor:
        n, d = self.num_embeddings, self.embedding_dim
        out = torch.empty(n, d, dtype=torch.float32)
        chunk = max(1, (8 << 20) // (4 * d))
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            self._table.read_rows(torch.arange(start, stop).numpy(), out[start:stop].numpy())
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        mkey = prefix + "momentum"
        momentum_ok = True
        if mkey in unexpected_keys:
            saved = state_dict[mkey]
            if self.optimizer == "rowwise_adagrad":
                unexpected_keys.remove(mkey)
                n = self.num_embeddings
                if not isinstance(saved, Tensor) or tuple(saved.shape) != (n,):
                    got = tuple(saved.shape) if isinstance(saved, Tensor) else type(saved).__name__
                    error_msgs.append(f"size mismatch for {mkey}: copying a buffer with shape {got}, the table has ({n},)")
                    momentum_ok = False
            elif isinstance(saved, Tensor) and saved.numel() == 0:
                # The empty accumulators earlier versions saved for every
                # optimizer: nothing to load.
                unexpected_keys.remove(mkey)
        key = prefix + "weight"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        rows = state_dict[key]
        n, d = self.num_embeddings, self.embedding_dim
        if not isinstance(rows, Tensor) or tuple(rows.shape) != (n, d):
            got = tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {got}, the table is ({n}, {d})")
            return
        if not momentum_ok:
            return
        self._init_rows(rows, None)
        if self.optimizer == "rowwise_adagrad":
            saved = state_dict.get(mkey)
            if saved is None:
                self.momentum.zero_()
            else:
                self.momentum.copy_(saved.detach().to("cpu", torch.float32))

    def flush(self) -> None:
        """Writes the rows the row cache holds changed back to the table's
        buffer (updates of cached rows wait in the cache until their rows
        leave it); a no-op without a row cache. read_rows and the forward
        never need it."""
        self._table.flush()

    def tier_of(self, row: int) -> Optional[str]:
        """The tier ("device", "host", "nvme") holding row's (first) page."""
        return self._table.tier_of_row(row)

    @property
    def fast_tier(self) -> str:
        """The runtime's fastest tier, whose lookups count as hits."""
        return self._table.fast_tier

    def balance(self) -> dict:
        """Runs one balancer round now (balance="manual")."""
        return balance_once(self.runtime)

    def stats(self) -> dict:
        """{"lookups", "fast_hits", "hit_rate", "cache_hits", "cache_fills"}
        since creation or reset_stats()."""
        s = self._table.stats()
        s["hit_rate"] = s["fast_hits"] / s["lookups"] if s["lookups"] else 0.0
        return s

    def reset_stats(self) -> None:
        self._table.reset_stats()

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.optimizer is not None:
            s += f", optimizer={self.optimizer!r}, lr={self.lr}"
        return s + f", tiers={self.runtime.tiers}"


def _default_init_fn(fn, bounds) -> bool:
    """Whether fn is the init_fn TorchRec's config gives itself when none
    is set: torch.nn.init.uniform_ over the config's range."""
    return (
        isinstance(fn, functools.partial)
        and fn.func is torch.nn.init.uniform_
        and not fn.args
        and fn.keywords == {"a": bounds[0], "b": bounds[1]}
    )


def _init_fn_rows(fn, dim: int):
    """EmbeddingBag's init from TorchRec's init_fn (which fills a weight
    tensor in place, or returns one), applied chunk by chunk: element-wise
    initialisers (torch.nn.init's uniform_, normal_, zeros_, ...) give the
    law they give the whole table."""

    def init(start: int, stop: int) -> Tensor:
        rows = torch.empty(stop - start, dim)
        got = fn(rows)
        return got if isinstance(got, Tensor) else rows

    return init


def _table_init(seed: int, table: int, dim: int, lo: int, bounds):
    """EmbeddingBag's init for a shard starting at table row lo."""
    return lambda start, stop: initial_rows(seed, table, dim, lo + start, lo + stop, bounds[0], bounds[1])


class _Spec:
    """One table of a collection: rows, dim, pooling, the features it
    serves (TorchRec's EmbeddingBagConfig, or a plain (rows, dim) pair),
    its name and its initial rows' range."""

    def __init__(self, rows, dim, mode, name, features, init, init_fn=None):
        self.rows, self.dim, self.mode = rows, dim, mode
        self.name, self.features, self.init = name, features, init
        # TorchRec's init_fn, where the config has one: it replaces init.
        self.init_fn = init_fn

    @classmethod
    def of(cls, table, k: int, mode: str) -> "_Spec":
        if isinstance(table, (tuple, list)):
            if len(table) != 2 or not all(isinstance(x, int) and x > 0 for x in table):
                raise ValueError(f"table {table!r} is not a (num_embeddings, embedding_dim) pair")
            return cls(table[0], table[1], mode, f"t{k}", [], None)
        for attr in ("num_embeddings", "embedding_dim", "name", "feature_names"):
            if not hasattr(table, attr):
                raise TypeError(
                    f"table {k} ({type(table).__name__}) is neither a (num_embeddings, embedding_dim) "
                    f"pair nor an EmbeddingBagConfig: it has no {attr}"
                )
        rows, dim, name = table.num_embeddings, table.embedding_dim, table.name
        if not (isinstance(rows, int) and rows > 0 and isinstance(dim, int) and dim > 0):
            raise ValueError(f"table {name!r}: {rows} rows of {dim} must be positive ints")
        pooling = getattr(table, "pooling", "SUM")
        pmode = str(getattr(pooling, "name", pooling)).lower()
        if pmode not in ("sum", "mean"):
            raise ValueError(f"table {name!r}: pooling {pmode.upper()} is not offered (SUM or MEAN)")
        features = list(table.feature_names) or [name]
        # TorchRec's default initial rows: U(-sqrt(1/rows), sqrt(1/rows)).
        bound = math.sqrt(1.0 / rows)
        lo = getattr(table, "weight_init_min", None)
        hi = getattr(table, "weight_init_max", None)
        init = (-bound if lo is None else float(lo), bound if hi is None else float(hi))
        init_fn = getattr(table, "init_fn", None)
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"table {name!r}: init_fn {init_fn!r} is not callable")
        if _default_init_fn(init_fn, init):
            # TorchRec's own default (uniform over the config's range): the
            # seeded draw below gives that law, the same on every rank.
            init_fn = None
        return cls(rows, dim, pmode, name, features, init, init_fn)


def _renamed(state_dict, old: str, new: str) -> None:
    """Moves state_dict's keys under old to new, in place."""
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old) :]] = state_dict.pop(key)


def _torchrec_names(module, state_dict, prefix, local_metadata) -> None:
    """A collection of configs saves its tables under TorchRec's names."""
    for k, spec in enumerate(module._specs):
        _renamed(state_dict, f"{prefix}tables.{k}.", f"{prefix}embedding_bags.{spec.name}.")


def _strata_names(module, state_dict, prefix, *_) -> None:
    """... and loads them under TorchRec's names or its own."""
    for k, spec in enumerate(module._specs):
        _renamed(state_dict, f"{prefix}embedding_bags.{spec.name}.", f"{prefix}tables.{k}.")


class EmbeddingBagCollection(nn.Module):
    """Several EmbeddingBags (a DLRM model's sparse features) in one
    runtime, so that all tables share its fast tier and the balancer
    places the hottest rows of any of them there.

    tables: TorchRec's ``EmbeddingBagConfig`` list (or objects with its
    fields: num_embeddings, embedding_dim, name, feature_names, pooling SUM
    or MEAN, weight_init_min/max), or plain (num_embeddings, embedding_dim)
    pairs. mode (plain pairs only), optimizer, lr, eps, padding_idx,
    include_last_offset apply to every table. fast_bytes, nvme_path,
    nvme_bytes, page_size or runtime size the tiers for all tables
    together. Initial rows: weights (one tensor per table), else with
    configs TorchRec's range drawn by ``initial_rows(seed, ...)`` (seed
    from generator, or torch's global generator, unless given), else
    N(0, 1) from generator.

    With configs, in TorchRec's shape: ``forward(features)`` takes a
    ``KeyedJaggedTensor`` whose keys are the configs' feature names and
    returns a ``KeyedTensor`` (one column block per feature, in the configs'
    order), so the module drops into TorchRec's DLRM in place of
    ``torchrec.EmbeddingBagCollection``, and its state_dict() has
    TorchRec's keys (``embedding_bags.<table name>.weight``: checkpoints
    load either way; load_state_dict() also takes the ``tables.<k>.``
    keys of earlier versions); is_weighted=True pools with the
    KJT's weights (which get their gradient, as TorchRec's); features no
    table serves are left alone; a config's init_fn fills its table chunk
    by chunk. ``embedding_bag_configs()`` returns the configs.

    Plain, without TorchRec: ``forward(inputs, offsets=None,
    per_sample_weights=None)``, one input (and offsets, per_sample_weights
    entry, or None) per table; a list of tensors, or one (bags, sum of
    dims) tensor with concat=True.

    sharding="table" or "row" under torch.distributed (process_group, the
    default group if None): each rank keeps its shard of the tables in its
    own tiers (whole tables, table k on rank k % world; or a contiguous
    block of every table's rows), and forward routes each rank's ids to
    their owners and brings the pooled results back with all-to-all, as
    TorchRec's sharded collection does; backward sends each bag's gradient
    to the owners, which update their rows, averaged over the ranks as DDP
    averages the dense gradients (gradient_division=False: summed). Every
    rank calls forward and backward together, with a batch of the same
    features. Sharded tables take no padding_idx and no gradient for
    per-sample weights.
    """

    def __init__(
        self,
        tables: Sequence,
        mode: str = "sum",
        *,
        is_weighted: bool = False,
        concat: bool = False,
        runtime: Optional[Runtime] = None,
        fast_bytes: Optional[int] = None,
        nvme_path=None,
        nvme_bytes: Optional[int] = None,
        page_size: int = 4096,
        balance: str = "background",
        balance_interval: float = 0.01,
        generator: Optional[torch.Generator] = None,
        weights: Optional[Sequence[Tensor]] = None,
        seed: Optional[int] = None,
        sharding: Optional[str] = None,
        process_group=None,
        gradient_division: bool = True,
        **kwargs,
    ) -> None:
        super().__init__()
        tables = list(tables)
        if not tables:
            raise ValueError("tables is empty")
        if mode not in ("sum", "mean"):
            raise ValueError(f'mode {mode!r} is not offered (use "sum" or "mean")')
        specs = [_Spec.of(t, k, mode) for k, t in enumerate(tables)]
        self._configs = None if isinstance(tables[0], (tuple, list)) else tables
        if self._configs is not None and any(isinstance(t, (tuple, list)) for t in tables):
            raise TypeError("tables mixes EmbeddingBagConfigs and (rows, dim) pairs")
        # (feature, table) in the configs' order.
        self._features: List[Tuple[str, int]] = []
        for k, spec in enumerate(specs):
            for f in spec.features:
                if any(f == g for g, _ in self._features):
                    raise ValueError(f"feature {f!r} is served by two tables")
                self._features.append((f, k))
        if weights is not None and len(weights) != len(tables):
            raise ValueError(f"{len(weights)} weights for {len(tables)} tables")
        if balance not in ("background", "manual"):
            raise ValueError(f'balance {balance!r} is not "background" or "manual"')
        if sharding not in (None, "table", "row"):
            raise ValueError(f'sharding {sharding!r} is not None, "table" or "row"')
        if is_weighted:
            for spec in specs:
                if spec.mode != "sum":
                    raise ValueError(
                        f"table {spec.name!r} pools by {spec.mode}; a weighted collection pools sums"
                    )
        self.is_weighted = bool(is_weighted)
        self.concat = concat
        self.sharding = sharding
        self._specs = specs
        self._shard = None
        if sharding is not None:
            from ._sharded import Plan

            self._shard = Plan(specs, sharding, process_group, kwargs, gradient_division)
            local = self._shard.local_tables()
        else:
            local = [(k, spec.rows) for k, spec in enumerate(specs)]
        own = runtime is None
        if own:
            total = sum(_round_up(rows * specs[k].dim * 4, page_size) for k, rows in local)
            runtime = _make_runtime(max(total, page_size), fast_bytes, nvme_path, nvme_bytes, page_size)
        elif fast_bytes is not None or nvme_path is not None or nvme_bytes is not None:
            raise ValueError("give either runtime or fast_bytes/nvme_path/nvme_bytes, not both")
        self.runtime = runtime
        if self._configs is not None and weights is None and seed is None:
            # Every rank of a sharded collection must draw the same seed:
            # seed torch alike on every rank, or pass seed=.
            seed = int(torch.randint(0, 1 << 62, (1,), generator=generator))
        modules = []
        for k, rows in local:
            spec = specs[k]
            init = spec.init
            if self._configs is not None and weights is None and spec.init_fn is not None:
                init = _init_fn_rows(spec.init_fn, spec.dim)
            elif self._configs is not None and weights is None:
                lo = 0 if self._shard is None else self._shard._rows_on(k, self._shard.rank)[0]
                init = _table_init(seed, k, spec.dim, lo, spec.init)
            w = None
            if weights is not None:
                w = weights[k] if self._shard is None else self._shard.local_rows(k, weights[k])
            try:
                modules.append(
                    EmbeddingBag(
                        rows,
                        spec.dim,
                        # A shard pools sums; the rank that asked divides for a mean.
                        mode=spec.mode if self._shard is None else "sum",
                        runtime=runtime,
                        balance="manual",
                        generator=generator,
                        _weight=w,
                        init=init,
                        **kwargs,
                    )
                )
            except _strata.OutOfCapacityError as e:
                raise _strata.OutOfCapacityError(
                    f"table {spec.name!r} ({rows} rows of {spec.dim} floats) does not fit in the tiers: {e}"
                ) from e
        self.tables = nn.ModuleList(modules)
        if self._configs is not None and self._shard is None:
            # TorchRec's names in state_dict(): embedding_bags.<table>.weight.
            self.register_state_dict_post_hook(_torchrec_names)
            self.register_load_state_dict_pre_hook(_strata_names)
        if own and balance == "background" and "device" in runtime.tiers:
            start_balancer(runtime, interval=balance_interval)

    def embedding_bag_configs(self) -> list:
        """The EmbeddingBagConfigs this collection was made from (TorchRec's
        accessor, which its DLRM reads)."""
        if self._configs is None:
            raise AttributeError("this collection was made from (rows, dim) pairs, not EmbeddingBagConfigs")
        return list(self._configs)

    def feature_names(self) -> List[str]:
        """The features, in the order of the output's columns."""
        return [f for f, _ in self._features]

    def _jagged(self, features) -> Tuple[int, List[Tuple[Tensor, Tensor, Optional[Tensor]]]]:
        """The batch size and each configured feature's (ids, offsets,
        weights) from a KeyedJaggedTensor, checked, naming the feature
        at fault."""
        jt = features.to_dict()
        keys = list(features.keys())
        for k in keys:
            if keys.count(k) > 1:
                raise ValueError(f"feature {k!r} appears {keys.count(k)} times in the KeyedJaggedTensor")
            # A feature no table serves is left alone, as TorchRec does.
        batch = int(features.stride())
        out = []
        for f, k in self._features:
            if f not in jt:
                raise ValueError(f"the KeyedJaggedTensor has no feature {f!r} (its keys: {list(features.keys())})")
            j = jt[f]
            idx = _as_index(j.values(), f"feature {f!r}'s values")
            off = _as_index(j.offsets(), f"feature {f!r}'s offsets")
            if off.numel() != batch + 1 or (off.numel() and (off[0] != 0 or off[-1] != idx.numel())):
                raise ValueError(f"feature {f!r}: offsets do not span its {idx.numel()} values in {batch} bags")
            if off.numel() > 1 and bool((off[1:] < off[:-1]).any()):
                raise ValueError(f"feature {f!r}: a bag has a negative length")
            rows = self._specs[k].rows
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
                bad = int(idx[(idx < 0) | (idx >= rows)][0])
                raise IndexError(f"feature {f!r}: id {bad} is out of range for table {self._specs[k].name!r} of {rows} rows")
            w = None
            if self.is_weighted:
                w = j.weights_or_none()
                if w is None:
                    raise ValueError(f"feature {f!r} has no weights, and the collection is_weighted")
                # Attached, so that the weights get their gradient as
                # TorchRec's do (sharded tables take none: see the class).
                w = w.to("cpu", torch.float32).reshape(-1)
                if self._shard is not None:
                    w = w.detach()
            out.append((idx, off, w))
        return batch, out

    def _pool_by_table(self, batch: int, bags) -> Tensor:
        """Every feature's bags, pooled table by table: the features a table
        serves go through it in one call, so backward updates each row
        once a step with the sum of its features' gradients (as FBGEMM's
        table-batched kernels do)."""
        blocks: List[Optional[Tensor]] = [None] * len(bags)
        jobs = []
        for k, table in enumerate(self.tables):
            mine = [i for i, (_, t) in enumerate(self._features) if t == k]
            if mine:
                jobs.append((table, mine, *_concat_bags([bags[i] for i in mine])))
        gathered = self._gathered([(table, idx, off, w) for table, _, idx, off, w in jobs])
        for (table, mine, idx, off, w), got in zip(jobs, gathered):
            out = table._pool(idx, off, w, got)
            for j, i in enumerate(mine):
                blocks[i] = out[j * batch : (j + 1) * batch]
        return torch.cat(blocks, dim=1) if blocks else torch.zeros(batch, 0)

    def forward(
        self,
        inputs,
        offsets: Optional[Sequence[Optional[Tensor]]] = None,
        per_sample_weights: Optional[Sequence[Optional[Tensor]]] = None,
    ):
        if hasattr(inputs, "to_dict") and hasattr(inputs, "keys") and hasattr(inputs, "stride"):
            if self._configs is None:
                raise TypeError("a KeyedJaggedTensor needs a collection made from EmbeddingBagConfigs")
            if offsets is not None or per_sample_weights is not None:
                raise ValueError("with a KeyedJaggedTensor, offsets and weights are its own")
            batch, bags = self._jagged(inputs)
            if self._shard is not None:
                values = self._shard.pool(self, batch, bags)
            else:
                values = self._pool_by_table(batch, bags)
            from torchrec.sparse.jagged_tensor import KeyedTensor

            return KeyedTensor(
                keys=self.feature_names(),
                length_per_key=[self._specs[k].dim for _, k in self._features],
                values=values,
            )
        if self._shard is not None:
            raise TypeError("a sharded collection takes a KeyedJaggedTensor")
        n = len(self.tables)
        if len(inputs) != n:
            raise ValueError(f"{len(inputs)} inputs for {n} tables")
        offsets = [None] * n if offsets is None else list(offsets)
        psw = [None] * n if per_sample_weights is None else list(per_sample_weights)
        if len(offsets) != n or len(psw) != n:
            raise ValueError(f"offsets and per_sample_weights need one entry per table ({n})")
        jobs = [(t, *t._inputs(x, o, w)) for t, x, o, w in zip(self.tables, inputs, offsets, psw)]
        outs = []
        for (t, idx, off, w), got, x in zip(jobs, self._gathered(jobs), inputs):
            out = t._pool(idx, off, w, got)
            outs.append(out.to(x.device) if x.device.type != "cpu" else out)
        return torch.cat(outs, dim=1) if self.concat else outs

    def _gathered(self, jobs) -> list:
        """The tables' gathers of jobs ((table, idx, off, weights) each)
        run at once where rows may be on NVMe: each waits on the disk with
        the GIL released, so together they keep more reads in flight.
        Otherwise (all in memory) Nones: each gathers as it pools. Autograd's
        part stays on the calling thread either way."""
        if len(jobs) > 1 and "nvme" in self.runtime.tiers:
            return _gather_all(jobs)
        return [None] * len(jobs)

    def balance(self) -> dict:
        """Runs one balancer round now (balance="manual")."""
        return balance_once(self.runtime)

    def stats(self) -> dict:
        """Lookups and fast-tier hits over all tables (this rank's shards)."""
        total = {"lookups": 0, "fast_hits": 0, "cache_hits": 0, "cache_fills": 0}
        for t in self.tables:
            s = t._table.stats()
            for k in total:
                total[k] += s[k]
        lookups = total["lookups"]
        total["hit_rate"] = total["fast_hits"] / lookups if lookups else 0.0
        return total

    def reset_stats(self) -> None:
        for t in self.tables:
            t.reset_stats()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for t in self.tables:
            t.grad = None

    def requires_grad_(self, requires_grad: bool = True) -> "EmbeddingBagCollection":
        """Every table's requires_grad_ (False freezes them all)."""
        super().requires_grad_(requires_grad)
        for t in self.tables:
            t.requires_grad_(requires_grad)
        if self._shard is not None:
            self._shard.frozen = not requires_grad
        return self
