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

torch is imported by this module only; ``import strata`` does not need it.
"""

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch.optim import Optimizer

from ._strata import OffloadedAdam

__all__ = ["Adam", "AdamW"]


def _flat_numpy(t: torch.Tensor):
    """A NumPy view of t's memory (no copy)."""
    return t.detach().view(-1).numpy()


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
        self._updater = updater
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

    def _new_state(self, p: torch.Tensor, group: Dict[str, Any]) -> OffloadedAdam:
        self._check(p)
        adam = OffloadedAdam(
            _flat_numpy(p),
            tier=self._tier,
            nvme_path=self._nvme_path,
            chunk_bytes=_chunk_bytes(p.numel(), self._chunk_limit),
            updater=self._updater,
            **self._hyper(group),
        )
        self._offloaded[p] = [adam, p._version]
        return adam

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step for every parameter with a gradient (others are left as
        they are, without state, as torch's optimizers do)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = self._hyper(group)
            wd = float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("strata.optim does not support sparse gradients")
                entry = self._offloaded.get(p)
                if entry is None:
                    adam = self._new_state(p, group)
                    entry = self._offloaded[p]
                else:
                    adam = entry[0]
                    # Weights changed outside the optimizer (an in-place op,
                    # a loaded model): strata's master copy follows.
                    if p._version != entry[1]:
                        self._check(p)
                        adam.write_state(0, _flat_numpy(p))
                adam.configure(**hyper)
                grad = p.grad
                if not self._decoupled and wd != 0.0:
                    grad = grad.add(p, alpha=wd)
                adam.step(_flat_numpy(grad.contiguous()), _flat_numpy(p))
                entry[1] = p._version
        return loss

    def state_dict(self) -> Dict[str, Any]:
        """torch's format: per parameter "step", "exp_avg", "exp_avg_sq"
        (read back from strata's tiers into new tensors)."""
        live = self.state
        state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for p, (adam, _) in self._offloaded.items():
            m = torch.empty_like(p, memory_format=torch.contiguous_format)
            v = torch.empty_like(p, memory_format=torch.contiguous_format)
            adam.read_state(1, _flat_numpy(m))
            adam.read_state(2, _flat_numpy(v))
            state[p] = {
                "step": torch.tensor(float(adam.steps), dtype=torch.float32),
                "exp_avg": m,
                "exp_avg_sq": v,
            }
        self.state = state
        try:
            return super().state_dict()
        finally:
            self.state = live

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads torch's format (from this class or torch.optim.Adam/AdamW):
        hyper-parameters into the param groups, states into strata's tiers
        (master weights from the parameters as they are now)."""
        for group in state_dict.get("param_groups", []):
            for option in ("amsgrad", "maximize", "capturable", "differentiable"):
                if group.get(option):
                    raise NotImplementedError(
                        f"strata.optim does not support {option}=True (the state dict sets it)"
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
                for which, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                    t = st[key].detach().to(torch.float32).contiguous().view(-1)
                    adam.write_state(which, t.numpy())
                adam.set_steps(int(float(st["step"])))


class Adam(_OffloadedAdamBase):
    """torch.optim.Adam with its state in strata's tiers (weight_decay is L2,
    added to the gradient, as in torch.optim.Adam).

    tier: "host", "cxl" or "nvme" (then nvme_path, a directory on a disk);
    chunk_bytes: the largest chunk a state array streams in; updater: "cpu"
    or "cuda" (the update on a GPU; same result bitwise)."""

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
