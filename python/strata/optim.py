"""Adam and AdamW whose state lives in strata's tiers.

``strata.optim.Adam`` and ``strata.optim.AdamW`` are ``torch.optim.Optimizer``
subclasses with torch's signatures, param groups, ``zero_grad``,
``state_dict``/``load_state_dict`` (in torch's format: states load into
``torch.optim.AdamW`` and back) and ``GradScaler`` support. Change one line::

    opt = strata.optim.AdamW(model.parameters(), lr=1e-3, tier="nvme", nvme_path="/var/tmp")

Each parameter's fp32 master weights and both moments live in host DRAM,
CXL memory or NVMe (``tier``) and are streamed through in chunks at every
step (``strata._strata.OffloadedAdam``, the Rust ``OffloadedAdam``);
parameters and gradients are read and written in place. Parameters are
contiguous CPU tensors. ``amsgrad``, ``maximize``, ``capturable``,
``differentiable`` and ``fused`` are not supported (``foreach`` is accepted
and ignored); the first four are refused in a param group too, and
``decoupled_weight_decay`` in one of ``Adam``'s (use ``AdamW``).

An fp32 parameter (plain mode, the CPU updater) is its own master: strata
keeps only the moments in the tier and updates the parameter in place, each
byte read and written once a step; with the states in CXL or on NVMe only
the two moments stream (16 bytes a parameter each way, not 24).

Mixed precision: parameters may be float32, bfloat16 or float16, and each
one's gradient in its own dtype or float32. The fp32 master weights and
both moments live in the tier; a step widens each chunk's gradients to
fp32, updates the masters and writes them back into the parameter in its
own dtype (rounded to nearest even). ``state_dict`` holds the fp32 masters
(``"master"``, for parameters that are not float32) and the moments in
fp32, so a resumed run continues exactly. ``torch.amp.GradScaler`` works
with fp16 gradients as with torch's fused optimizers: the optimizer takes
the scale and the inf check from the scaler and unscales inside the step
(an explicit ``scaler.unscale_`` works for bf16 and fp32 gradients;
GradScaler itself refuses to unscale fp16 ones). ``torch.autocast`` with
bf16 needs nothing of the optimizer.

The master weights in the tier follow changes made to a parameter outside
the optimizer that torch counts (in-place ops under ``torch.no_grad()``,
``p.copy_(...)``, loading a state dict into the model): strata checks the
tensor's version at each step. Changes through ``p.data`` are not counted
by torch and are not seen: the next step starts from strata's copy (except
for an fp32 parameter in plain mode, which is its own master: there every
change is seen).

Numerics: strata's update is ``w -= step*(m/(sqrt(v)*rs+eps)) + lr*wd*w``
with ``step = lr/bc1`` and ``rs = 1/sqrt(bc2)``
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

FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters and gradients
are DTensors and each rank holds a shard of them; the optimizer steps each
rank's local shard (``DTensor.to_local()``, no collective: FSDP2 has
already reduce-scattered the gradients), and ``state_dict`` returns the
moments (and masters) as DTensors placed as their parameters are, as
torch's own optimizers do, so ``torch.distributed.checkpoint`` saves and
loads them. ``shard=True`` is for whole parameters and is refused there.

torch is imported by this module only; ``import strata`` does not need it.
"""

import math
import os
import tempfile
from collections import OrderedDict, defaultdict
from itertools import chain
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch.optim import Optimizer

import torch.distributed as dist

from ._checks import check_page_size
from ._strata import InvalidArgumentError, NotFoundError, OffloadedAdam

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without torch.distributed
    DTensor = None

# The parameter dtypes a step takes, by the name the Rust side knows them.
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

__all__ = ["Adam", "AdamW"]


def _raw(t: torch.Tensor):
    """t's elements as a NumPy array of the same bytes (16-bit floats,
    which NumPy lacks, as int16), for the Rust side."""
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.int16).numpy()


def _mark(p: torch.Tensor) -> Tuple[int, int]:
    """What changes when p's weights change outside the optimizer: its
    version counter (in-place ops) and its storage (p.data replaced, which
    leaves the counter as it was)."""
    t = _plain(p)
    return t._version, t.data_ptr()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor a step works on: a DTensor's local shard (FSDP2's
    parameters and gradients), otherwise t itself."""
    if DTensor is not None and isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def _placed_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """t (a tensor of p's local shape) as a DTensor placed as p is, where
    p is a DTensor; otherwise t."""
    if DTensor is not None and isinstance(p, DTensor):
        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return t


def _check_nvme_path(path: str) -> None:
    """Refuses a state directory that cannot take the states, at
    construction rather than at the first step."""
    if not os.path.isdir(path):
        raise NotFoundError(f"nvme_path {path!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise PermissionError(f"nvme_path {path!r} cannot take the optimizer's states: {e}") from e


def _f32(x: float) -> float:
    """x rounded to float32, as the step takes it (inf past its range)."""
    return torch.tensor(x, dtype=torch.float32).item()


def _check_hyper(hyper: Dict[str, Any], weight_decay: float, group: int) -> None:
    """Raises InvalidArgumentError for options an Adam step cannot take
    (param group `group`'s, as a schedule or an edit left them), checked
    in float32 as the step checks them: a beta that rounds to 1, or an lr
    past float32's range, is refused here, before any parameter moves."""
    b1, b2 = (_f32(b) for b in hyper["betas"])
    lr, eps, wd = _f32(hyper["lr"]), _f32(hyper["eps"]), _f32(weight_decay)
    ok = (
        math.isfinite(lr)
        and lr >= 0.0
        and 0.0 <= b1 < 1.0
        and 0.0 <= b2 < 1.0
        and math.isfinite(eps)
        and eps >= 0.0
        and math.isfinite(wd)
        and wd >= 0.0
    )
    if not ok:
        raise InvalidArgumentError(
            f"param group {group}: lr {hyper['lr']}, betas {hyper['betas']}, eps {hyper['eps']}, "
            f"weight_decay {weight_decay}: lr, eps and weight_decay must be finite and non-negative, "
            "betas in [0, 1), each as a float32"
        )


# Options of torch's Adam and AdamW that change the update, which strata's
# step does not do: refused wherever a param group carries them.
_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes a and b span (from their first element to their
    last, strides included) overlap."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        start = t.data_ptr()
        reach = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        return start, start + (reach + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


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
        if updater not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"unknown updater {updater!r} (use 'cpu' or 'cuda')")
        # A chunk streams in pages of its size.
        check_page_size(chunk_bytes, "chunk_bytes")
        if runtime is not None and nvme_path is not None:
            raise ValueError("nvme_path is the runtime's own for an optimizer on a runtime; leave it None")
        if runtime is None:
            if tier == "nvme" and nvme_path is None:
                raise InvalidArgumentError("tier 'nvme' needs nvme_path (a directory)")
            if tier != "nvme" and nvme_path is not None:
                raise InvalidArgumentError(f"nvme_path is for tier 'nvme', not {tier!r}")
            if nvme_path is not None:
                _check_nvme_path(str(nvme_path))
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
        # Per parameter: its OffloadedAdam, the parameter's version counter
        # when strata last wrote (or read) its weights, the shape and dtype
        # the state was made for, and the steps taken where there is no
        # OffloadedAdam to count them (no elements on this rank).
        self._offloaded: Dict[torch.Tensor, list] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._check(p)
                if self._shard and _plain(p) is not p:
                    raise ValueError(
                        f"shard=True shards whole parameters; {self._name(p)} is a DTensor "
                        "(FSDP2) whose shards this optimizer already steps: leave shard=False"
                    )

    def _check_options(self, group: Dict[str, Any], where: str) -> None:
        """Raises NotImplementedError for a param group's option that
        strata's step would otherwise ignore (`where` says who set it)."""
        for option in _UNSUPPORTED:
            if group.get(option):
                raise NotImplementedError(f"strata.optim does not support {option}=True ({where})")
        if group.get("decoupled_weight_decay") and not self._decoupled:
            raise NotImplementedError(
                f"strata.optim.Adam does not support decoupled_weight_decay=True ({where}); use strata.optim.AdamW"
            )

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's, refusing options strata's step does not take (torch's
        constructor adds each group through here)."""
        if isinstance(param_group, dict):
            self._check_options(param_group, "a param group sets it")
        super().add_param_group(param_group)

    # GradScaler hands this optimizer its scale and inf check (grad_scale,
    # found_inf) and lets the step unscale, as for torch's fused optimizers.
    _step_supports_amp_scaling = True

    def _aliases(self, p: torch.Tensor) -> bool:
        """Whether p (fp32) is its own master weights: in plain mode, on
        the CPU, strata keeps only the moments in the tier and updates the
        parameter in place (no master copy beside it, none streamed)."""
        return (
            p.dtype == torch.float32
            and self._importance is None
            and self._updater == "cpu"
        )

    def _name(self, p: torch.Tensor) -> str:
        """How an error names p: its name where the optimizer was given
        named parameters, else its place and shape."""
        for g, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    if names:
                        return f"parameter {names[i]!r}"
                    return f"parameter {i} of param group {g} (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(p.shape)}"

    def _check(self, p: torch.Tensor) -> None:
        t = _plain(p)
        problem = None
        if t.device.type != "cpu":
            problem = f"it is on {t.device}; strata.optim steps CPU tensors"
        elif t.dtype not in _DTYPES:
            problem = f"it is {t.dtype}; use float32, bfloat16 or float16"
        elif t.is_sparse or t.layout != torch.strided:
            problem = f"its layout is {t.layout}; use a dense (strided) tensor"
        elif not t.is_contiguous():
            problem = "it is not contiguous; make it so (p.data = p.data.contiguous()) before building the optimizer"
        if problem is not None:
            raise TypeError(f"strata.optim cannot step {self._name(p)}: {problem}")

    def _check_param(self, p: torch.Tensor) -> None:
        """p can be stepped, and is still the shape and dtype its state was
        made for (p.data may have been replaced since the last step)."""
        self._check(p)
        entry = self._offloaded.get(p)
        if entry is None:
            return
        t = _plain(p)
        if t.shape != entry[2]:
            raise ValueError(
                f"{self._name(p)} of shape {tuple(entry[2])} now has shape {tuple(t.shape)}: "
                "parameters may not change shape between steps"
            )
        if t.dtype != entry[3]:
            raise TypeError(
                f"{self._name(p)} was {entry[3]} and is now {t.dtype}: "
                "parameters may not change dtype between steps (build the optimizer after converting the model)"
            )

    def _check_grad(self, p: torch.Tensor) -> torch.Tensor:
        g, t = _plain(p.grad), _plain(p)
        if g.is_sparse or g.layout != torch.strided:
            raise TypeError(
                f"strata.optim cannot step {self._name(p)}: its gradient is {g.layout} "
                "(sparse gradients are not supported; use a dense gradient, e.g. sparse=False)"
            )
        if g.shape != t.shape:
            raise ValueError(
                f"a gradient of shape {tuple(g.shape)} for {self._name(p)} of shape {tuple(t.shape)}"
            )
        if g.dtype not in (t.dtype, torch.float32) or g.device != t.device:
            raise TypeError(
                f"strata.optim cannot step {self._name(p)} ({t.dtype}): its gradient is {g.dtype} "
                f"on {g.device}; use {t.dtype} or torch.float32 on the CPU"
            )
        if _overlap(g, t):
            raise InvalidArgumentError(
                f"the gradient of {self._name(p)} shares the parameter's memory; give it a gradient of its own"
            )
        return g

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
        n = _plain(p).numel() if entry is None else math.prod(entry[2])
        if not self._shard:
            return 0, n, n
        per = -(-n // self._world)
        lo = min(n, self._rank * per)
        return lo, min(n, lo + per), per

    def _local(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """t's elements in this rank's shard of p (a view)."""
        lo, hi, _ = self._span(p)
        return _plain(t).detach().reshape(-1)[lo:hi]

    def _new_state(self, p: torch.Tensor, group: Dict[str, Any]) -> Optional[OffloadedAdam]:
        """p's state in strata (None for a rank whose shard of p is empty)."""
        self._check(p)
        lo, hi, _ = self._span(p)
        if hi == lo:
            self._offloaded[p] = [None, _mark(p), _plain(p).shape, _plain(p).dtype, 0]
            return None
        adam = OffloadedAdam(
            self._local(p, p).float().numpy(),
            tier=self._tier,
            nvme_path=self._nvme_path,
            chunk_bytes=_chunk_bytes(hi - lo, self._chunk_limit),
            updater=self._updater,
            importance=self._importance,
            runtime=self._runtime,
            **self._hyper(group),
        )
        self._offloaded[p] = [adam, _mark(p), _plain(p).shape, _plain(p).dtype, 0]
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
        # Under GradScaler (see _step_supports_amp_scaling): skip a step
        # whose gradients overflowed; otherwise unscale inside it.
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            return loss
        scale = getattr(self, "grad_scale", None)
        unscale = 1.0 if scale is None else 1.0 / float(scale)
        stepped = []
        # Every group's options and every gradient checked before any
        # parameter moves: a refused step changes nothing.
        work = []
        for k, group in enumerate(self.param_groups):
            self._check_options(group, f"param group {k} sets it")
            hyper = self._hyper(group)
            _check_hyper(hyper, float(group["weight_decay"]), k)
            grads = []
            for p in group["params"]:
                if p.grad is not None:
                    self._check_param(p)
                    grads.append((p, self._check_grad(p)))
            work.append((group, hyper, grads))
        for group, hyper, grads in work:
            wd = float(group["weight_decay"])
            for p, grad in grads:
                entry = self._offloaded.get(p)
                if entry is None:
                    self._new_state(p, group)
                    entry = self._offloaded[p]
                elif _mark(p) != entry[1]:
                    # Weights changed outside the optimizer (an in-place
                    # op, a loaded model, p.data replaced): strata's
                    # master copy follows.
                    if entry[0] is not None and not self._aliases(p):
                        entry[0].write_state(0, self._local(p, p).float().numpy())
                adam = entry[0]
                if adam is not None:
                    adam.configure(**hyper)
                    g, u = self._local(grad, p), unscale
                    if not self._decoupled and wd != 0.0:
                        # Adam's L2 term joins the unscaled gradient, in fp32.
                        g = g.float().mul(u).add_(self._local(p, p).float(), alpha=wd)
                        u = 1.0
                    g = g.contiguous()
                    adam.step(
                        _raw(g),
                        _raw(self._local(p, p)),
                        in_place=True,
                        grads_dtype=_DTYPES[g.dtype],
                        out_dtype=_DTYPES[p.dtype],
                        unscale=u,
                        alias=self._aliases(p),
                    )
                else:
                    entry[4] += 1
                stepped.append((p, p))
        if self._shard:
            self._gather(stepped)
        for p, _ in stepped:
            self._offloaded[p][1] = _mark(p)
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
            "importance_resident": _placed_like(res.reshape(_plain(p).shape), p),
            "importance_accumulated": _placed_like(acc.reshape(_plain(p).shape), p),
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
                steps = torch.tensor([float(adam.steps if adam is not None else entry[4])])
                if self._shard:
                    self._gather([(p, m), (p, v)])
                    counts = [torch.empty_like(steps) for _ in range(self._world)]
                    dist.all_gather(counts, steps, group=self._group)
                    steps = max(counts, key=float)
                state[p] = {
                    "step": torch.tensor(float(steps), dtype=torch.float32),
                    "exp_avg": _placed_like(m, p),
                    "exp_avg_sq": _placed_like(v, p),
                }
                if p.dtype != torch.float32:
                    # The fp32 master weights: a bf16/fp16 parameter is
                    # only their rounding.
                    w = torch.zeros(shape, dtype=torch.float32)
                    if adam is not None:
                        adam.read_state(0, self._local(w, p).numpy())
                    if self._shard:
                        self._gather([(p, w)])
                    state[p]["master"] = _placed_like(w, p)
                if self._importance is not None:
                    state[p].update(self._window_state(p, adam))
        self.state = state
        try:
            return super().state_dict()
        finally:
            self.state = live

    def _check_loadable(self, p: torch.Tensor, st: Dict[str, Any]) -> None:
        """Raises InvalidArgumentError (a ValueError) unless `st` is a state `load_state_dict` can
        give `p`: its tensors of p's shape, its step a count."""
        if "exp_avg" not in st:
            return
        try:
            step = float(st.get("step", 0))
        except (TypeError, ValueError, RuntimeError):
            raise InvalidArgumentError(f"the state dict's step {st.get('step')!r} is not a number") from None
        lo, hi, _ = self._span(p)
        # Nothing of p on this rank: older versions saved its step as -1.
        lowest = -1 if hi == lo else 0
        if not (math.isfinite(step) and step >= lowest and step == math.floor(step) and step < 2.0**63):
            raise InvalidArgumentError(f"the state dict's step {step} is not a step count (a whole number from 0)")
        if hi == lo:
            return
        keys = ["exp_avg", "exp_avg_sq"]
        if "master" in st and p.dtype != torch.float32:
            keys.append("master")
        if self._importance is not None and "importance_accumulated" in st:
            keys += ["importance_resident", "importance_accumulated"]
        shape = tuple(_plain(p).shape)
        for key in keys:
            t = st.get(key)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidArgumentError(f"the state dict's {key} is {got} for a parameter of shape {shape}")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads torch's format (from this class or torch.optim.Adam/AdamW):
        hyper-parameters into the param groups, states into strata's tiers
        (master weights from the saved fp32 "master" for a bf16 or fp16
        parameter that is still their rounding, else from the parameters as
        they are now; in shard mode each rank takes its shard). An
        importance window is restored where the state has one and this
        optimizer is in importance mode."""
        # torch's load hooks run around strata's load, not inside torch's:
        # the pre-hooks' state dict is the one read below, and the
        # post-hooks see the states loaded into strata.
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        state_dict = state_dict.copy()
        for hook in pre.values():
            changed = hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        for group in state_dict.get("param_groups", []):
            self._check_options(group, "the state dict sets it")
        if self._importance is not None:
            # Refused before anything changes, rather than half loaded.
            for st in state_dict.get("state", {}).values():
                deferred = int(st.get("importance_deferred_steps", 0))
                if not 0 <= deferred < self._importance[1]:
                    raise ValueError(
                        f"the state dict's importance window is {deferred} steps in; "
                        f"this optimizer's windows are {self._importance[1]} steps"
                    )
        # torch's load casts every state tensor to its parameter's dtype:
        # keep the saved fp32 tensors (masters, moments) as they are.
        saved_ids = chain.from_iterable(g["params"] for g in state_dict.get("param_groups", []))
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        saved = state_dict.get("state", {})
        raw = {p: saved[i] for i, p in zip(saved_ids, params) if i in saved}
        # Every state and every group's options checked before anything
        # changes: a state dict refused leaves this optimizer as it was.
        for p, st in raw.items():
            self._check_loadable(p, st)
        for k, group in enumerate(state_dict.get("param_groups", [])):
            try:
                hyper = self._hyper(group)
            except (KeyError, TypeError, ValueError, IndexError):
                raise InvalidArgumentError(
                    f"the state dict's param group {k} lacks lr, betas, eps or weight_decay, or one is not a number"
                ) from None
            _check_hyper(hyper, float(group["weight_decay"]), k)
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre
            self._optimizer_load_state_dict_post_hooks = post
        loaded = {p: raw.get(p, st) for p, st in self.state.items()}
        self.state = defaultdict(dict)
        self._offloaded = {}
        for group in self.param_groups:
            for p in group["params"]:
                st = loaded.get(p)
                if not st or "exp_avg" not in st:
                    continue
                adam = self._new_state(p, group)
                if adam is None:
                    self._offloaded[p][4] = max(0, int(float(st.get("step", 0))))
                    continue
                keys = ((1, "exp_avg"), (2, "exp_avg_sq"))
                if "master" in st and p.dtype != torch.float32:
                    # The saved masters where the parameter is still their
                    # rounding; one that has moved since (stepped by
                    # torch.optim.AdamW from this state, say) is newer.
                    master = self._local(st["master"].detach().to(torch.float32), p)
                    if torch.equal(master.to(p.dtype), self._local(p, p)):
                        keys = ((0, "master"),) + keys
                for which, key in keys:
                    t = st[key].detach().to(torch.float32).contiguous()
                    adam.write_state(which, self._local(t, p).contiguous().numpy())
                # A state without a step is at step 0 (as _check_loadable takes it).
                adam.set_steps(int(float(st.get("step", 0))))
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
        for hook in post.values():
            hook(self)


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
