"""Adam and AdamW whose state lives in strata's tiers.

``strata.optim.Adam`` and ``strata.optim.AdamW`` are ``torch.optim.Optimizer``
subclasses with torch's signatures, param groups, ``zero_grad``,
``state_dict``/``load_state_dict`` (in torch's format: states load into
``torch.optim.AdamW`` and back) and ``GradScaler`` support. Change one line::

    opt = strata.optim.AdamW(model.parameters(), lr=1e-3, tier="nvme", nvme_path="/var/tmp")

Each parameter's fp32 master weights and both moments live in host DRAM,
CXL memory or NVMe (``tier``) and are streamed through in chunks at every
step (``strata._strata.OffloadedAdam``, the Rust ``OffloadedAdam``);
parameters and gradients are read and written in place. Parameters must be
float32 CPU tensors, contiguous. ``amsgrad``, ``maximize``, ``capturable``,
``differentiable`` and ``fused`` are not supported (``foreach`` is accepted
and ignored).

The master weights in the tier follow changes made to a parameter outside
the optimizer that torch counts (in-place ops under ``torch.no_grad()``,
``p.copy_(...)``, loading a state dict into the model): strata checks the
tensor's version at each step. Changes through ``p.data`` are not counted
by torch and are not seen: the next step starts from strata's copy.

Numerics: strata's update is ``w -= lr*((m/bc1)/(sqrt(v/bc2)+eps) + wd*w)``
in float32; torch orders the same operations differently (it decays ``w``
first, then adds ``-(lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)``), so results
agree to within a few float32 rounding steps, not bit for bit.

Importance-aware mode (ZenFlow's idea), ``importance=(fraction, every)``:
at every ``every``-th step (a flush) the optimizer streams all state and
picks, per chunk, the ``fraction`` of elements with the largest |g|; until
the next flush only those update each step (from memory, no state I/O), the
others accumulate their gradients and update once, with the mean, at the
flush. ``state_dict`` saves the window (extra keys ``importance_*``), so a
run resumes exactly.

On a runtime shared with your own buffers, ``runtime=strata.Runtime(...)``:
the states then live in that runtime's ``tier`` under the same per-tier
budgets as everything else allocated from it (for ``"nvme"`` its own NVMe
tier, no ``nvme_path``), in chunks of its page size, updated on the CPU.

ZeRO-1-style sharding, ``shard=True`` (torch.distributed initialised, e.g.
under DDP): each rank keeps and streams the states of only its contiguous
1/world of every parameter, steps it with its slice of the gradient (which
must be the same on every rank, as DDP's all-reduce leaves it), then the
updated weights are all-gathered in one collective per step. ``state_dict``
and ``load_state_dict`` are then collective calls (every rank calls them):
the saved state is whole, in torch's format, and loads into any world size
or into an unsharded optimizer.

torch is imported by this module only; ``import strata`` does not need it.
"""

import math
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch.optim import Optimizer

import torch.distributed as dist

from ._strata import OffloadedAdam

__all__ = ["Adam", "AdamW"]


def _chunk_bytes(numel: int, limit: int) -> int:
    """A power-of-two chunk no larger than needed (4 KiB at least)."""
    want = max(4096, 1 << max(0, (numel * 4 - 1).bit_length()))
    return min(want, limit)


class _OffloadedAdamBase(Optimizer):
    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        tier: str = "host",
        nvme_path: Optional[str] = None,
        chunk_bytes: int = 1 << 20,
        updater: str = "cpu",
        importance: Optional[Tuple[float, int]] = None,
        runtime: Optional[Any] = None,
        shard: bool = False,
        process_group: Optional[Any] = None,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        for name, on in (
            ("amsgrad", amsgrad),
            ("maximize", maximize),
            ("capturable", capturable),
            ("differentiable", differentiable),
            ("fused", fused),
        ):
            if on:
                raise NotImplementedError(f"strata.optim does not support {name}=True")
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if tier not in ("host", "cxl", "nvme"):
            raise ValueError(f"unknown optimizer state tier {tier!r} (use 'host', 'cxl' or 'nvme')")
        if runtime is not None and nvme_path is not None:
            raise ValueError("nvme_path is the runtime's own for an optimizer on a runtime; leave it None")
        if importance is not None:
            try:
                fraction, every = float(importance[0]), importance[1]
                ok = len(importance) == 2 and 0.0 < fraction <= 1.0 and int(every) == every >= 1
            except (TypeError, ValueError, IndexError):
                ok = False
            if not ok:
                raise ValueError(
                    f"importance must be (fraction in (0, 1], every >= 1 steps), not {importance!r}"
                )
            importance = (fraction, int(every))
        self._group = process_group
        if shard:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("shard=True needs torch.distributed initialised (init_process_group)")
            self._world = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)
        else:
            self._world, self._rank = 1, 0
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=None,
        )
        super().__init__(params, defaults)
        self._tier = tier
        self._nvme_path = None if nvme_path is None else str(nvme_path)
        self._chunk_limit = chunk_bytes
        self._runtime = runtime
        self._updater = updater
        self._importance = importance
        self._shard = bool(shard)
        # Per parameter: its OffloadedAdam and the parameter's version
        # counter when strata last wrote (or read) its weights.
        self._offloaded: Dict[torch.Tensor, list] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._check(p)

    @staticmethod
    def _check(p: torch.Tensor) -> None:
        if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
            raise TypeError(
                "strata.optim takes contiguous float32 CPU parameters, "
                f"not {p.dtype} on {p.device}" + ("" if p.is_contiguous() else " (non-contiguous)")
            )

    def _hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        wd = float(group["weight_decay"])
        return dict(
            lr=float(group["lr"]),
            betas=(float(group["betas"][0]), float(group["betas"][1])),
            eps=float(group["eps"]),
            # Adam's weight decay is L2 (added to the gradient), not strata's.
            weight_decay=wd if self._decoupled else 0.0,
        )

    def _span(self, p: torch.Tensor) -> Tuple[int, int, int]:
        """This rank's elements of p, [lo, hi), and the shard length every
        rank pads to (the whole parameter where not sharded)."""
        entry = self._offloaded.get(p)
        # The shape the state was made for, where it has been.
        n = p.numel() if entry is None else math.prod(entry[2])
        if not self._shard:
            return 0, n, n
        per = -(-n // self._world)
        lo = min(n, self._rank * per)
        return lo, min(n, lo + per), per

    def _local(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """t's elements in this rank's shard of p (a view)."""
        lo, hi, _ = self._span(p)
        return t.detach().reshape(-1)[lo:hi]

    def _new_state(self, p: torch.Tensor, group: Dict[str, Any]) -> Optional[OffloadedAdam]:
        """p's state in strata (None for a rank whose shard of p is empty)."""
        self._check(p)
        lo, hi, _ = self._span(p)
        if hi == lo:
            self._offloaded[p] = [None, p._version, p.shape]
            return None
        adam = OffloadedAdam(
            self._local(p, p).numpy(),
            tier=self._tier,
            nvme_path=self._nvme_path,
            chunk_bytes=_chunk_bytes(hi - lo, self._chunk_limit),
            updater=self._updater,
            importance=self._importance,
            runtime=self._runtime,
            **self._hyper(group),
        )
        self._offloaded[p] = [adam, p._version, p.shape]
        return adam

    def _gather(self, parts: list) -> None:
        """Shard mode: every rank's updated elements of each (p, tensor)
        in parts into every rank's copy, in one all-gather."""
        if not parts:
            return
        spans = [self._span(p) for p, _ in parts]
        send = torch.zeros(sum(per for _, _, per in spans), dtype=torch.float32)
        at = 0
        for (p, t), (lo, hi, per) in zip(parts, spans):
            send[at : at + hi - lo] = t.detach().reshape(-1)[lo:hi]
            at += per
        recv = [torch.empty_like(send) for _ in range(self._world)]
        dist.all_gather(recv, send, group=self._group)
        for r, got in enumerate(recv):
            at = 0
            for (p, t), (_, _, per) in zip(parts, spans):
                n = t.numel()
                lo, hi = min(n, r * per), min(n, (r + 1) * per)
                t.detach().view(-1)[lo:hi] = got[at : at + hi - lo]
                at += per

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step for every parameter with a gradient (others are left as
        they are, without state, as torch's optimizers do). Shard mode: a
        collective call, every rank with gradients for the same parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = []
        for group in self.param_groups:
            hyper = self._hyper(group)
            wd = float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("strata.optim does not support sparse gradients")
                if p.grad.shape != p.shape:
                    raise ValueError(
                        f"a gradient of shape {tuple(p.grad.shape)} for a parameter of shape {tuple(p.shape)}"
                    )
                entry = self._offloaded.get(p)
                if entry is None:
                    self._new_state(p, group)
                    entry = self._offloaded[p]
                elif p._version != entry[1]:
                    # Weights changed outside the optimizer (an in-place
                    # op, a loaded model): strata's master copy follows.
                    self._check(p)
                    if p.shape != entry[2]:
                        raise ValueError(
                            f"a parameter of shape {tuple(entry[2])} now has shape "
                            f"{tuple(p.shape)}: parameters may not change shape between steps"
                        )
                    if entry[0] is not None:
                        entry[0].write_state(0, self._local(p, p).numpy())
                adam = entry[0]
                if adam is not None:
                    adam.configure(**hyper)
                    grad = self._local(p.grad, p)
                    if not self._decoupled and wd != 0.0:
                        grad = grad.add(self._local(p, p), alpha=wd)
                    adam.step(grad.contiguous().numpy(), self._local(p, p).numpy(), in_place=True)
                stepped.append((p, p))
        if self._shard:
            self._gather(stepped)
        for p, _ in stepped:
            self._offloaded[p][1] = p._version
        return loss

    def _window_state(self, p: torch.Tensor, adam: Optional[OffloadedAdam]) -> Dict[str, Any]:
        """Importance mode: p's window as state-dict entries (whole, in
        shard mode: a collective)."""
        # The resident set as a mask: torch's load_state_dict casts every
        # tensor but "step" to the parameter's dtype, exact for 0 and 1.
        lo, hi, _ = self._span(p)
        res = torch.zeros(hi - lo, dtype=torch.bool)
        window = adam.importance_window() if adam is not None else None
        if window is not None:
            deferred, started, idx, acc = window
            # torch.frombuffer refuses empty buffers.
            if len(idx):
                res[torch.frombuffer(bytearray(idx), dtype=torch.int64)] = True
            acc = (
                torch.frombuffer(bytearray(acc), dtype=torch.float32)
                if len(acc)
                else torch.zeros(0, dtype=torch.float32)
            )
        else:
            deferred, started = 0, False
            acc = torch.zeros(hi - lo, dtype=torch.float32)
        if self._shard:
            pieces: list = [None] * self._world
            dist.all_gather_object(pieces, (deferred, started, res, acc), group=self._group)
            live = [x for x in pieces if x[3].numel() > 0]
            deferred = max(x[0] for x in live)
            started = any(x[1] for x in live)
            res = torch.cat([x[2] for x in pieces])
            acc = torch.cat([x[3] for x in pieces])
        return {
            "importance_deferred_steps": int(deferred),
            "importance_started": bool(started),
            "importance_resident": res.reshape(p.shape),
            "importance_accumulated": acc.reshape(p.shape),
        }

    def state_dict(self) -> Dict[str, Any]:
        """torch's format: per parameter "step", "exp_avg", "exp_avg_sq"
        (read back from strata's tiers into new tensors); in importance
        mode also the window ("importance_*"). Shard mode: a collective
        call; every rank gets the whole state."""
        live = self.state
        state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for group in self.param_groups:
            for p in group["params"]:
                entry = self._offloaded.get(p)
                if entry is None:
                    continue
                adam, shape = entry[0], entry[2]
                # The shape the state was made for (a parameter that has
                # changed shape since is refused at the next step).
                m = torch.zeros(shape, dtype=torch.float32)
                v = torch.zeros(shape, dtype=torch.float32)
                if adam is not None:
                    adam.read_state(1, self._local(m, p).numpy())
                    adam.read_state(2, self._local(v, p).numpy())
                steps = torch.tensor([float(adam.steps if adam is not None else -1)])
                if self._shard:
                    self._gather([(p, m), (p, v)])
                    counts = [torch.empty_like(steps) for _ in range(self._world)]
                    dist.all_gather(counts, steps, group=self._group)
                    steps = max(counts, key=float)
                state[p] = {
                    "step": torch.tensor(float(steps), dtype=torch.float32),
                    "exp_avg": m,
                    "exp_avg_sq": v,
                }
                if self._importance is not None:
                    state[p].update(self._window_state(p, adam))
        self.state = state
        try:
            return super().state_dict()
        finally:
            self.state = live

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads torch's format (from this class or torch.optim.Adam/AdamW):
        hyper-parameters into the param groups, states into strata's tiers
        (master weights from the parameters as they are now; in shard mode
        each rank takes its shard). An importance window is restored where
        the state has one and this optimizer is in importance mode."""
        for group in state_dict.get("param_groups", []):
            for option in ("amsgrad", "maximize", "capturable", "differentiable"):
                if group.get(option):
                    raise NotImplementedError(
                        f"strata.optim does not support {option}=True (the state dict sets it)"
                    )
        if self._importance is not None:
            # Refused before anything changes, rather than half loaded.
            for st in state_dict.get("state", {}).values():
                deferred = int(st.get("importance_deferred_steps", 0))
                if not 0 <= deferred < self._importance[1]:
                    raise ValueError(
                        f"the state dict's importance window is {deferred} steps in; "
                        f"this optimizer's windows are {self._importance[1]} steps"
                    )
        super().load_state_dict(state_dict)
        loaded = self.state
        self.state = defaultdict(dict)
        self._offloaded = {}
        for group in self.param_groups:
            for p in group["params"]:
                st = loaded.get(p)
                if not st or "exp_avg" not in st:
                    continue
                adam = self._new_state(p, group)
                if adam is None:
                    continue
                for which, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                    t = st[key].detach().to(torch.float32).contiguous()
                    adam.write_state(which, self._local(t, p).contiguous().numpy())
                adam.set_steps(int(float(st["step"])))
                if self._importance is not None and "importance_accumulated" in st:
                    mask = self._local(st["importance_resident"], p) != 0
                    res = mask.nonzero().reshape(-1).to(torch.int64)
                    acc = st["importance_accumulated"].detach().to(torch.float32).contiguous()
                    adam.set_importance_window(
                        int(st["importance_deferred_steps"]),
                        bool(st["importance_started"]) and res.numel() > 0,
                        res.contiguous().numpy(),
                        self._local(acc, p).contiguous().numpy(),
                    )


class Adam(_OffloadedAdamBase):
    """torch.optim.Adam with its state in strata's tiers (weight_decay is L2,
    added to the gradient, as in torch.optim.Adam).

    tier: "host", "cxl" or "nvme" (then nvme_path, a directory on a disk);
    chunk_bytes: the largest chunk a state array streams in; updater: "cpu"
    or "cuda" (the update on a GPU; same result bitwise); importance:
    (fraction, every), the importance-aware mode; shard: ZeRO-1-style
    sharding over process_group (torch.distributed's default group if
    None). See the module docs."""

    _decoupled = False


class AdamW(_OffloadedAdamBase):
    """torch.optim.AdamW with its state in strata's tiers (decoupled weight
    decay, default 1e-2 as in torch). Keyword arguments as for Adam."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
