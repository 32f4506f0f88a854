"""MoE experts of Hugging Face ``transformers`` models in strata's tiers.

``strata.moe.offload(model, ...)`` moves the expert weights of a
transformers MoE model (Mixtral, Qwen2-MoE: every module holding a layer's
experts as fused 3-D tensors, ``gate_up_proj`` of shape ``[E, 2I, H]`` and
``down_proj`` of shape ``[E, H, I]``, as transformers 5 keeps them; the
transposed ones of GPT-OSS and Llama 4; DBRX's ``w1``, ``v1`` and ``w2``
of ``[E * I, H]`` each; JetMoE's ``input_linear`` and ``output_linear``,
whose blocks are replaced whole, their attention's experts left as they
are) into a
strata expert cache (``strata.ExpertCache``): each expert's two slices are
registered as one entry in the host tier (NVMe beyond ``host_bytes``), the
original tensors are freed, and ``device_slots`` experts live in device
memory at once (host memory on the simulated device of a machine without a
GPU). Every MoE block keeps its router; its expert computation fetches the
experts the router picked through the cache, computes on the cache's slots
in place (DLPack, no copy), and unpins them. On the simulated device (a
model on the CPU) an expert held in host memory is computed on where it
is, taking no slot (``host_in_place``), so the slots hold the experts read
from NVMe. Everything else in the model is left as it was::

    import strata.moe
    moe = strata.moe.offload(model, device_slots=16, host_bytes=8 << 30,
                             nvme_path="/var/tmp", record_routing="route.txt")
    out = model.generate(ids, max_new_tokens=64)
    print(moe.stats()["total"])
    moe.close()

**Lookahead.** With ``prefetch=True`` each MoE block, once the experts it
needs are pinned, applies the *next* MoE block's router (after that layer's
``post_attention_layernorm``) to the residual stream entering this block
and prefetches the experts it predicts (the pre-gated / MoE-Infinity
lookahead); the next block fetches what it actually routes to and finds the
right predictions resident or on their way, the rest by demand fetches.
Prefetches a layer did not use are cancelled once it has run (what they
had not read yet is never read).

**Stats** (``OffloadedMoE.stats()``), per layer and in total: fetches, hit
rate, prefetch accuracy, bytes moved into device memory (and per token),
the wall time spent waiting in fetches (``stall_seconds``), and on the
simulated device the cache's modelled stall (``modelled_stall_seconds``: its
PCIe model, its clock advanced by the measured time between fetches).

``record_routing=PATH`` writes the routing as ``token layer expert`` lines,
the format ``strata bench moe --routing file:PATH`` replays. By default a
"token" of the trace is one forward step (all rows of the batch) and its
experts at a layer are those the step fetched, in fetch order, so the
replay fetches what the model fetched; ``record_per_token=True`` writes one
trace token per token row instead. Layers are numbered over the MoE blocks.

Inference only: the expert computation runs without autograd (the experts'
weights are not parameters of the model any more, and ``state_dict`` no
longer holds them). torch and transformers are imported by this module
only; ``import strata`` does not need them.
"""

import itertools
import os
import re
import time
import traceback
import types
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_count, check_page_size
from ._strata import ExpertCache, InvalidArgumentError

__all__ = ["offload", "OffloadedMoE", "StrataExperts", "StrataGroupedMoE", "find_moe_blocks"]

_MIB = 1 << 20
_MAX_PAGE = 2 << 20
_MIN_PAGE = 4 << 10

_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}

# The counters of ExpertCache.stats() that add up (per layer, in total).
_COUNTERS = (
    "fetches",
    "hits",
    "late_prefetch_hits",
    "prefetches",
    "prefetches_used",
    "prefetches_dropped",
    "prefetches_declined",
    "prefetches_cancelled",
    "evictions",
    "bytes_moved",
    "stall_seconds",
    "reads_ahead",
    "moves_from_nvme",
    "host_swaps",
    "served_in_place",
)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def _bytes(value, what: str) -> int:
    """A byte count: an int, or a size as accelerate writes them ("10GiB",
    "500MB": decimal units, binary with "i"; "5Gb", a lower-case b, in
    bits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", value.upper())
        if m:
            n = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
            # accelerate reads "5Gb" (decimal units, a lower-case b) as bits.
            bits = m.group(2) is not None and len(m.group(2)) == 2 and value.rstrip().endswith("b")
            return n // 8 if bits else n
    raise InvalidArgumentError(f"{what} {value!r} is not a size (bytes, or a string such as '10GiB')")


def _budgets(max_memory, offload_folder, device_bytes, host_bytes, nvme_path):
    """accelerate's vocabulary (max_memory={"cpu": ..., 0: ...},
    offload_folder=) as strata's budgets; one vocabulary at a time."""
    if max_memory is not None:
        if host_bytes is not None or device_bytes is not None:
            raise InvalidArgumentError("give max_memory or host_bytes/device_bytes, not both")
        if not isinstance(max_memory, dict):
            raise InvalidArgumentError(f"max_memory must be a dict such as {{'cpu': '8GiB', 0: '20GiB'}}, not {max_memory!r}")
        devices = [key for key in max_memory if key in (0, "cuda", "cuda:0")]
        if len(devices) > 1:
            raise InvalidArgumentError(f"max_memory names the device {len(devices)} times ({devices}); give one")
        for key, value in max_memory.items():
            if key == "cpu":
                host_bytes = _bytes(value, 'max_memory["cpu"]')
            elif key in (0, "cuda", "cuda:0"):
                device_bytes = _bytes(value, f"max_memory[{key!r}]")
            elif key == "disk":
                continue  # accelerate's disk has no budget: offload_folder holds the rest
            else:
                raise InvalidArgumentError(
                    f"max_memory key {key!r}: strata.moe runs on one device (keys 'cpu' and 0)"
                )
    if offload_folder is not None:
        if nvme_path is not None:
            raise InvalidArgumentError("give offload_folder or nvme_path, not both")
        nvme_path = offload_folder
    if host_bytes is not None:
        host_bytes = _bytes(host_bytes, "host_bytes")
    if device_bytes is not None:
        device_bytes = _bytes(device_bytes, "device_bytes")
    return device_bytes, host_bytes, nvme_path


def _spare_bytes() -> int:
    """Memory this process can take without pressing on the machine or its
    memory limit: four fifths of the smaller of the kernel's MemAvailable
    and the cgroup's headroom (the rest left to the process's own growth)."""
    spare = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    spare = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        for line in lines:
            _, ctrl, path = line.split(":", 2)
            if ctrl == "memory":  # cgroup v1
                base = f"/sys/fs/cgroup/memory{path}"
                limit, used = base + "/memory.limit_in_bytes", base + "/memory.usage_in_bytes"
            elif ctrl == "":  # cgroup v2
                base = f"/sys/fs/cgroup{path}"
                limit, used = base + "/memory.max", base + "/memory.current"
            else:
                continue
            try:
                with open(limit) as f:
                    lim = f.read().strip()
                with open(used) as f:
                    cur = int(f.read().strip())
            except OSError:
                continue
            if lim != "max" and int(lim) < (1 << 60):
                room = max(0, int(lim) - cur)
                spare = room if spare is None else min(spare, room)
    except (OSError, ValueError):
        pass
    return (spare if spare is not None else 1 << 62) * 4 // 5


def _unsupported_experts(model: nn.Module) -> Optional[str]:
    """The first module that looks like a block's experts (or, without
    one, the MoE block itself) but is not in the fused layout strata.moe
    runs: 'ClassName at name'."""
    blocks = None
    for name, m in model.named_modules():
        cls = type(m).__name__
        if name.endswith("experts") or "Experts" in cls:
            if not (_is_fused_experts(m) or _is_split_glu(m) or _is_grouped_moe(m)):
                return f"{cls} at {name}"
        elif blocks is None and cls.endswith(("MoE", "Moe", "MoeBlock", "SparseMoeBlock")):
            blocks = f"{cls} at {name}"
    return blocks


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _page_for(gate_up_bytes: int, down_bytes: int) -> int:
    """The default page: each expert tensor in one page up to 2 MiB, then
    halved while the page padding of [gate_up | pad | down | pad] wastes
    more than a sixteenth of the expert (a slot is whole pages: a 2 MiB
    page for a 3 MiB expert would leave a quarter of every slot empty),
    down to 64 KiB."""
    page = min(_MAX_PAGE, max(_MIN_PAGE, _next_pow2(max(gate_up_bytes, down_bytes))))

    def waste(p):
        return -(-gate_up_bytes // p) * p + -(-down_bytes // p) * p - gate_up_bytes - down_bytes

    while page > (64 << 10) and waste(page) * 16 > gate_up_bytes + down_bytes:
        page //= 2
    return page


def _is_dense_call(m: nn.Module) -> bool:
    """Llama 4's experts: forward(hidden_states) alone, every expert given
    every token ([E * T, H]) and one batched product over [E, H, 2I] and
    [E, I, H]."""
    import inspect

    try:
        params = list(inspect.signature(type(m).forward).parameters)
    except (TypeError, ValueError):
        return False
    return params == ["self", "hidden_states"]


def _is_gpt_oss(m: nn.Module) -> bool:
    """GPT-OSS's experts: transposed, interleaved gate and up, biases, and
    a gate function of its own (``_apply_gate``, its clamped SwiGLU)."""
    return (
        getattr(m, "is_transposed", False)
        and callable(getattr(type(m), "_apply_gate", None))
        and isinstance(getattr(m, "gate_up_proj_bias", None), torch.Tensor)
        and isinstance(getattr(m, "down_proj_bias", None), torch.Tensor)
    )


def _is_split_glu(m: nn.Module) -> bool:
    """DBRX's experts: an ``mlp`` holding ``w1`` (gate), ``v1`` (up) and
    ``w2`` (down), each ``[E * I, H]``, called as the fused families' are
    (``forward(hidden_states, top_k_index, top_k_weights)``)."""
    import inspect

    mlp = getattr(m, "mlp", None)
    ts = [getattr(mlp, n, None) for n in ("w1", "v1", "w2")]
    e = getattr(m, "num_experts", None)
    if not (all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in ts) and isinstance(e, int) and e > 0):
        return False
    if not callable(getattr(mlp, "activation_fn", None)):
        return False
    try:
        params = list(inspect.signature(type(m).forward).parameters)
    except (TypeError, ValueError):
        return False
    return params[:4] == ["self", "hidden_states", "top_k_index", "top_k_weights"]


def _is_grouped_moe(m: nn.Module) -> bool:
    """JetMoE's MoE block: the experts as two ``JetMoeParallelExperts``
    (``input_linear.weight`` ``[E, 2I, H]``, ``output_linear.weight``
    ``[E, H, I]``) called with the rows grouped by expert and their counts,
    a ``router`` whose ``layer`` scores the experts, an ``activation`` and a
    ``bias`` added to the block's output. (Its attention's experts, which
    have no activation, are not matched: they stay in the model.)"""
    import inspect

    w_in = getattr(getattr(m, "input_linear", None), "weight", None)
    w_out = getattr(getattr(m, "output_linear", None), "weight", None)
    router = getattr(m, "router", None)
    bias = getattr(m, "bias", None)
    if not (isinstance(w_in, torch.Tensor) and isinstance(w_out, torch.Tensor) and w_in.dim() == 3 == w_out.dim()):
        return False
    if not (callable(getattr(m, "activation", None)) and isinstance(bias, torch.Tensor)):
        return False
    scores = getattr(getattr(router, "layer", None), "weight", None)
    if not (isinstance(scores, torch.Tensor) and hasattr(router, "top_k")):
        return False
    try:
        params = list(inspect.signature(type(m).forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) == 2


def _is_fused_experts(m: nn.Module) -> bool:
    gu = getattr(m, "gate_up_proj", None)
    dp = getattr(m, "down_proj", None)
    return (
        isinstance(gu, torch.Tensor)
        and isinstance(dp, torch.Tensor)
        and gu.dim() == 3
        and dp.dim() == 3
    )


class _Block:
    """One MoE block found in the model."""

    def __init__(
        self, index, name, decoder_layer, block, experts, transposed=False, dense=False, split=False, grouped=False
    ):
        self.index = index
        self.name = name
        self.decoder_layer = decoder_layer
        self.block = block
        self.experts = experts
        gate = getattr(block, "gate", None)
        self.gate = gate if gate is not None else getattr(block, "router", None)
        self.norm = getattr(decoder_layer, "post_attention_layernorm", None)
        # DBRX's layout: gate, up and down as separate [E * I, H] tensors
        # under the experts' `mlp`; its norm before the block is the second
        # of its attention's pair.
        self.split = split
        if split and self.norm is None:
            self.norm = getattr(getattr(decoder_layer, "norm_attn_norm", None), "norm_2", None)
        # GPT-OSS's layout: gate_up_proj [E, H, 2I] (gate and up interleaved)
        # and down_proj [E, I, H], used as x @ W, with biases and the
        # module's own gate function.
        self.transposed = transposed
        # Llama 4's experts take every token for every expert ([E * T, H],
        # scaled by the router's scores) and run one batched product.
        self.dense = dense
        # JetMoE's: the block is its own experts module (input_linear and
        # output_linear, [E, 2I, H] and [E, H, I]), replaced whole.
        self.grouped = grouped
        # What the lookahead runs on the layer before's input.
        self.router_linear = self._router_linear()

    def _router_linear(self) -> Optional[nn.Module]:
        """The router's linear layer (an [E, H] weight, perhaps a bias),
        wherever the family keeps it: the router itself (Mixtral's gate),
        or its `layer` (DBRX, JetMoE), `wg` (HunYuan) or `gate` (AFMoE);
        None where there is none (the lookahead then predicts nothing)."""
        e, _, h = self.dims()
        for m in (self.gate, *(getattr(self.gate, n, None) for n in ("layer", "wg", "gate"))):
            w = getattr(m, "weight", None)
            if isinstance(w, torch.Tensor) and tuple(w.shape) == (e, h):
                return m
        return None

    def dims(self):
        """(experts, 2 * intermediate, hidden) of the experts."""
        if self.split:
            e = self.experts.num_experts
            ei, h = self.experts.mlp.w1.shape
            return (e, 2 * (ei // e), h)
        if self.grouped:
            return tuple(self.experts.input_linear.weight.shape)
        e, a, b = self.experts.gate_up_proj.shape
        return (e, b, a) if self.transposed else (e, a, b)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The experts' weight tensors by their names under the block."""
        if self.split:
            return {f"mlp.{n}": getattr(self.experts.mlp, n) for n in ("w1", "v1", "w2")}
        if self.grouped:
            return {f"{n}.weight": getattr(self.experts, n).weight for n in ("input_linear", "output_linear")}
        return {n: getattr(self.experts, n) for n in ("gate_up_proj", "down_proj")}

    def expert(self, tensors, x):
        """(gate_up [2I, H] or its transpose, down) of expert `x`, from
        `tensors` (the block's own, or slices of the checkpoint's, by
        name): DBRX's w1 and v1 rows stacked, its w2 rows ([I, H])."""
        if self.split:
            i = self.dims()[1] // 2
            rows = slice(x * i, (x + 1) * i)
            w1, v1, w2 = (tensors[f"mlp.{n}"][rows] for n in ("w1", "v1", "w2"))
            return torch.cat([w1, v1]), w2
        if self.grouped:
            return tensors["input_linear.weight"][x], tensors["output_linear.weight"][x]
        return tensors["gate_up_proj"][x], tensors["down_proj"][x]


def find_moe_blocks(model: nn.Module) -> List[_Block]:
    """The MoE blocks of a transformers model, in model order: modules
    holding fused experts (``gate_up_proj`` ``[E, 2I, H]`` and
    ``down_proj`` ``[E, H, I]``; GPT-OSS's and Llama 4's transposed ones;
    DBRX's ``mlp.w1``, ``mlp.v1`` and ``mlp.w2``, ``[E * I, H]`` each) as
    the ``experts`` child of a block with a router ``gate`` or ``router``;
    and JetMoE's blocks, their experts ``input_linear`` and
    ``output_linear`` (``[E, 2I, H]``, ``[E, H, I]``) called with the rows
    grouped by expert.
    Raises InvalidArgumentError for a layout strata.moe cannot run (biases
    other than GPT-OSS's, transposed or interleaved experts of another
    kind)."""
    modules = dict(model.named_modules())
    found = []
    for name, m in model.named_modules():
        if _is_grouped_moe(m) and "." in name:
            cls = f"{type(m).__name__} at {name}"
            e, two_i, h = m.input_linear.weight.shape
            if m.output_linear.weight.shape != (e, h, two_i // 2) or two_i % 2 or m.bias.shape != (h,):
                raise InvalidArgumentError(
                    f"strata.moe cannot offload {cls}: input_linear {tuple(m.input_linear.weight.shape)}, "
                    f"output_linear {tuple(m.output_linear.weight.shape)} and bias {tuple(m.bias.shape)} are not "
                    "[E, 2I, H], [E, H, I] and [H]"
                )
            layer_name = name.rsplit(".", 1)[0]
            found.append(_Block(len(found), name, modules[layer_name], m, m, grouped=True))
            continue
        if not (_is_fused_experts(m) or _is_split_glu(m)) or "." not in name:
            continue
        parent_name, attr = name.rsplit(".", 1)
        block = modules[parent_name]
        if _is_split_glu(m):
            if attr != "experts" or not (hasattr(block, "gate") or hasattr(block, "router")):
                continue
            layer_name = parent_name.rsplit(".", 1)[0] if "." in parent_name else ""
            w1, v1, w2 = m.mlp.w1, m.mlp.v1, m.mlp.w2
            if not (w1.shape == v1.shape == w2.shape) or w1.shape[0] % m.num_experts:
                raise InvalidArgumentError(
                    f"strata.moe cannot offload {type(m).__name__} at {name}: w1 {tuple(w1.shape)}, v1 "
                    f"{tuple(v1.shape)} and w2 {tuple(w2.shape)} are not each [E * I, H] for {m.num_experts} experts"
                )
            found.append(_Block(len(found), name, modules[layer_name], block, m, split=True))
            continue
        # The router: `gate` (Mixtral, Qwen) or `router` (PhiMoE, GraniteMoE).
        if attr != "experts" or not (hasattr(block, "gate") or hasattr(block, "router")):
            continue
        cls = f"{type(m).__name__} at {name}"
        layer_name = parent_name.rsplit(".", 1)[0] if "." in parent_name else ""
        if _is_dense_call(m):
            e, h, two_i = m.gate_up_proj.shape
            if m.down_proj.shape != (e, two_i // 2, h) or two_i % 2 or not hasattr(m, "act_fn"):
                raise InvalidArgumentError(
                    f"strata.moe cannot offload {cls}: gate_up_proj {tuple(m.gate_up_proj.shape)} and down_proj "
                    f"{tuple(m.down_proj.shape)} are not [E, H, 2I] and [E, I, H]"
                )
            found.append(_Block(len(found), name, modules[layer_name], block, m, transposed=True, dense=True))
            continue
        if _is_gpt_oss(m):
            e, h, two_i = m.gate_up_proj.shape
            if m.down_proj.shape != (e, two_i // 2, h) or two_i % 2:
                raise InvalidArgumentError(
                    f"strata.moe cannot offload {cls}: gate_up_proj {tuple(m.gate_up_proj.shape)} and down_proj "
                    f"{tuple(m.down_proj.shape)} are not [E, H, 2I] and [E, I, H]"
                )
            found.append(_Block(len(found), name, modules[layer_name], block, m, transposed=True))
            continue
        if getattr(m, "is_transposed", False) or not getattr(m, "is_concatenated", True):
            raise InvalidArgumentError(
                f"strata.moe cannot offload {cls}: transposed or interleaved experts are not supported"
            )
        if (
            getattr(m, "has_bias", False)
            or not getattr(m, "has_gate", True)
            or any(isinstance(getattr(m, b, None), torch.Tensor) for b in ("gate_up_proj_bias", "down_proj_bias"))
        ):
            raise InvalidArgumentError(
                f"strata.moe cannot offload {cls}: experts with biases or without a gate projection are not supported"
            )
        if not hasattr(m, "act_fn"):
            raise InvalidArgumentError(f"strata.moe cannot offload {cls}: the experts module has no act_fn")
        if _own_gate(m) or getattr(m, "has_post_expert_norm", False):
            # The loop below computes act_fn(gate) * up and nothing after
            # the down projection: another gating (a clamped SwiGLU) or a
            # norm after each expert would be skipped, silently.
            raise InvalidArgumentError(
                f"strata.moe cannot offload {cls}: its experts gate their own way (_apply_gate) or normalize "
                "each expert's output; only act_fn(gate) * up is supported"
            )
        e, two_i, h = m.gate_up_proj.shape
        if m.down_proj.shape != (e, h, two_i // 2) or two_i % 2:
            raise InvalidArgumentError(
                f"strata.moe cannot offload {cls}: gate_up_proj {tuple(m.gate_up_proj.shape)} and down_proj "
                f"{tuple(m.down_proj.shape)} are not [E, 2I, H] and [E, H, I] (transposed experts)"
            )
        found.append(_Block(len(found), name, modules[layer_name], block, m))
    return found


def _own_gate(m: nn.Module) -> bool:
    """Whether the experts class gates otherwise than transformers' default
    act_fn(gate) * up (its own _apply_gate)."""
    gate = getattr(type(m), "_apply_gate", None)
    if gate is None:
        return False
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a transformers without the hook: nothing to override
        return False
    return gate is not _default_apply_gate


class _State:
    """What the blocks of one offloaded model share."""

    def __init__(self, cache, blocks, prefetch, max_prefetch, writer, per_token):
        self.cache = cache
        self.blocks = blocks
        self.prefetch = prefetch
        self.max_prefetch = max_prefetch
        self.writer = writer
        self.per_token = per_token
        self.layers = len(blocks)
        self.residual: List[Optional[torch.Tensor]] = [None] * self.layers
        self.per_layer = [dict.fromkeys(_COUNTERS, 0) for _ in range(self.layers)]
        self.measured_stall = [0.0] * self.layers
        # Wall time in prefetch and cancel_prefetches calls (they may evict
        # a victim, which waits for its move down).
        self.call_seconds = [0.0] * self.layers
        # Wall time in the experts' arithmetic, per layer; and the steps'
        # wall time from their first MoE layer's start to their last's end.
        self.compute_seconds = [0.0] * self.layers
        self.wall_seconds = 0.0
        self.step_start = None
        self.tokens = 0
        self.steps = 0
        self.mark = time.perf_counter()
        self.pending: List[str] = []
        self.trace_token = 0
        self.modelled = cache.modelled_now() is not None

    def snapshot(self):
        return self.cache.stats()

    def credit(self, layer, before, after):
        acc = self.per_layer[layer]
        for k in _COUNTERS:
            acc[k] += after[k] - before[k]

    def flush(self):
        if self.writer is not None and self.pending:
            self.writer.write("".join(self.pending))
            self.writer.flush()
        self.pending = []


class StrataExperts(nn.Module):
    """A drop-in replacement for a transformers experts module
    (``forward(hidden_states, top_k_index, top_k_weights)``) whose experts
    live in a strata ExpertCache. Made by ``offload``."""

    def __init__(self, state: _State, layer: int, src: nn.Module, layout: Dict[str, Any], biases=None):
        super().__init__()
        self._state = state
        self.layer = layer
        self.num_experts = layout["experts"]
        self.hidden_dim = layout["hidden"]
        self.intermediate_dim = layout["intermediate"]
        self.transposed = layout["transposed"]
        self.dense = layout["dense"]
        self.split = layout.get("split", False)
        self.grouped = layout.get("grouped", False)
        if self.split:
            # DBRX: its gate function is its GLU module's.
            self.act_fn = src.mlp.activation_fn
        elif self.grouped:
            # JetMoE: its block's activation.
            self.act_fn = src.activation
        elif self.transposed and not self.dense:
            # The biases stay in memory (2I + H values an expert); the gate
            # function is the family's own, on a shell holding its settings.
            self.gate_up_bias, self.down_bias = biases
            shell = types.SimpleNamespace(alpha=src.alpha, limit=src.limit)
            gate = type(src)._apply_gate
            self.act_fn = lambda gate_up: gate(shell, gate_up)
        else:
            self.act_fn = src.act_fn
        self._dtype = layout["dtype"]
        self._dtype_name = _DTYPES[layout["dtype"]]
        self._elt = layout["elt"]
        self._down_at = layout["down_at"]
        self._gate_up_bytes = 2 * self.intermediate_dim * self.hidden_dim * self._elt

    def extra_repr(self):
        return (
            f"layer={self.layer}, num_experts={self.num_experts}, hidden={self.hidden_dim}, "
            f"intermediate={self.intermediate_dim}, dtype={self._dtype_name}"
        )

    # -- weights on the slot ---------------------------------------------

    def _linear(self, x, slot, at, rows, cols):
        """x @ W.T for the [rows, cols] matrix at byte `at` of the slot,
        computed on the slot's pages in place: on the CPU one tensor per run
        of adjacent pages when runs hold whole rows, else (and on a GPU)
        through a copy."""
        page = slot.page_size
        nbytes = rows * cols * self._elt
        addrs = slot.addresses
        first, last = at // page, (at + nbytes - 1) // page
        runs = []  # byte ranges of the matrix on adjacent pages
        start = at
        for p in range(first, last):
            if addrs[p + 1] != addrs[p] + page:
                runs.append((start, (p + 1) * page))
                start = (p + 1) * page
        runs.append((start, at + nbytes))
        row_bytes = cols * self._elt
        views = []
        for a, b in runs:
            pin = slot.pin((a, b), self._dtype_name)
            views.append(torch.from_dlpack(pin))
            pin.unpin()  # the tensor holds its own pin
        if len(views) == 1:
            return F.linear(x, views[0].view(rows, cols))
        # Split by rows, each output column is the same sum over the same
        # row, and the CPU's GEMM gives the same bits as over the whole
        # matrix (the tests check it). A GPU's library may pick another
        # kernel, with another order of the sum, for a narrower product:
        # there the runs are copied into one matrix (device memory, cheap).
        if not x.is_cuda and all((a - at) % row_bytes == 0 for a, _ in runs):
            out = x.new_empty(x.shape[:-1] + (rows,))
            r0 = 0
            for (a, b), v in zip(runs, views):
                n = (b - a) // row_bytes
                out[..., r0 : r0 + n] = F.linear(x, v.view(n, cols))
                r0 += n
            return out
        return F.linear(x, torch.cat(views).view(rows, cols))

    def _matrix(self, slot, at, rows, cols):
        """The [rows, cols] matrix at byte `at` of the slot, as one tensor
        (a copy where its pages are not adjacent: x @ W's sums run over
        W's rows, which must not be split)."""
        page = slot.page_size
        nbytes = rows * cols * self._elt
        addrs = slot.addresses
        first, last = at // page, (at + nbytes - 1) // page
        if all(addrs[p + 1] == addrs[p] + page for p in range(first, last)):
            pin = slot.pin((at, at + nbytes), self._dtype_name)
            t = torch.from_dlpack(pin)
            pin.unpin()  # the tensor holds its own pin
            return t.view(rows, cols)
        parts = []
        for p in range(first, last + 1):
            a, b = max(at, p * page), min(at + nbytes, (p + 1) * page)
            pin = slot.pin((a, b), self._dtype_name)
            parts.append(torch.from_dlpack(pin))
            pin.unpin()
        return torch.cat(parts).view(rows, cols)

    def _expert(self, x, slot, e):
        i, h = self.intermediate_dim, self.hidden_dim
        if self.split:
            # DBRX's own arithmetic: x @ w1.T and x @ v1.T apart, then the
            # product with w2 ([I, H]) as it is.
            gate = x.matmul(self._matrix(slot, 0, i, h).T)
            up = x.matmul(self._matrix(slot, i * h * self._elt, i, h).T)
            return (self.act_fn(gate) * up).matmul(self._matrix(slot, self._down_at, i, h))
        if self.dense:
            # Llama 4's own arithmetic (its batched product, one expert).
            gate, up = (x @ self._matrix(slot, 0, h, 2 * i)).chunk(2, dim=-1)
            return (up * self.act_fn(gate)) @ self._matrix(slot, self._down_at, i, h)
        if self.transposed:
            # GPT-OSS's own arithmetic, on the slot's matrices.
            gate_up = x @ self._matrix(slot, 0, h, 2 * i) + self.gate_up_bias[e]
            return self.act_fn(gate_up) @ self._matrix(slot, self._down_at, i, h) + self.down_bias[e]
        gate, up = self._linear(x, slot, 0, 2 * i, h).chunk(2, dim=-1)
        return self._linear(self.act_fn(gate) * up, slot, self._down_at, h, i)

    # -- the forward -----------------------------------------------------

    def _predict_next(self, st: _State) -> List[int]:
        nxt = st.blocks[self.layer + 1]
        resid = st.residual[self.layer]
        router = nxt.router_linear
        if resid is None or router is None:
            return []
        h = resid.reshape(-1, resid.shape[-1])
        if nxt.norm is not None:
            h = nxt.norm.forward(h)  # not through hooks (ours among them)
        # The router's scores without calling the router module (its hooks
        # record router logits for outputs).
        logits = F.linear(h.to(router.weight.dtype), router.weight, getattr(router, "bias", None))
        k = int(getattr(nxt.gate, "top_k", 0) or getattr(nxt.block, "top_k", 1))
        idx = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices.reshape(-1)
        counts = torch.bincount(idx, minlength=logits.shape[-1])
        order = torch.argsort(counts, descending=True, stable=True)
        n = int((counts > 0).sum())
        # The k most-voted of those that need a read: every prediction of a
        # single token, the surest of a batch's (a wrong prefetch costs a
        # whole read). A prediction already in a slot or read in place costs
        # nothing, so the next-voted one takes its place in the cap.
        cap = st.max_prefetch if st.max_prefetch is not None else k
        cache, layer = st.cache, self.layer + 1
        needed = (e for e in order[:n].tolist() if not cache.is_ready(layer, e))
        return list(itertools.islice(needed, cap))

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
        if self.dense:
            return self._forward_dense(hidden_states)
        st = self._state
        # DBRX hands over [B, T, H]; the others [tokens, H].
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        self._begin(hidden_states.shape[0])
        with torch.no_grad():
            final = torch.zeros_like(hidden_states)
            hit = torch.unique(top_k_index).tolist()
            hit = [e for e in hit if 0 <= e < self.num_experts]
            outputs = {}

            def work(e, slot):
                top_k_pos, token_idx = torch.where((top_k_index == e).T)
                y = self._expert(hidden_states[token_idx], slot, e)
                y = y * top_k_weights[token_idx, top_k_pos, None]
                outputs[e] = (token_idx, y)

            order = self._visit(hit, work)
            # Accumulated in expert order, as transformers' own loop does.
            for e in sorted(outputs):
                token_idx, y = outputs[e]
                final.index_add_(0, token_idx, y.to(final.dtype))
            if st.writer is not None:
                self._record(st, top_k_index, order)
        self._end()
        return final.view(shape)

    def forward_grouped(self, x, index_sorted_experts, batch_index, batch_gates, expert_size):
        """JetMoE's call: `x` [T, H] and its router's grouping (the first
        four of what ``JetMoeTopKGating`` returns: the token-expert pairs in
        expert order, their tokens, their gates, the rows of each expert).
        Each expert computes its group's rows as the model's own
        input_linear and output_linear would, and the gated outputs are
        summed into [T, H] in one index_add in that order, as the model's
        block does (its bias is the caller's)."""
        st = self._state
        self._begin(x.shape[0])
        with torch.no_grad():
            sizes = [int(n) for n in expert_size]
            starts = [0]
            for n in sizes:
                starts.append(starts[-1] + n)
            hit = [e for e in range(self.num_experts) if sizes[e] > 0]
            outputs = {}

            def work(e, slot):
                outputs[e] = self._expert(x[batch_index[starts[e] : starts[e + 1]]], slot, e)

            order = self._visit(hit, work)
            if outputs:
                y = torch.cat([outputs[e] for e in hit]) * batch_gates[:, None]
            else:
                y = x.new_zeros((0, self.hidden_dim))
            final = torch.zeros((x.shape[0], self.hidden_dim), dtype=y.dtype, device=y.device)
            final = final.index_add(0, batch_index, y)
            if st.writer is not None:
                # Each token's experts, in its top-k order.
                chosen = torch.repeat_interleave(torch.arange(self.num_experts), torch.tensor(sizes))
                index = torch.empty_like(chosen)
                index[index_sorted_experts.cpu()] = chosen
                self._record(st, index.view(x.shape[0], -1), order)
        self._end()
        return final

    def _forward_dense(self, routed_in):
        """Llama 4's call: every expert's copy of every token, [E * T, H],
        the rows of tokens an expert was not chosen for all zero (scaled by
        a zero score). Experts with a non-zero row are computed, as the
        model's batched product would, the others give zeros."""
        st = self._state
        e_all, h = self.num_experts, self.hidden_dim
        x = routed_in.view(e_all, -1, h)
        tokens = x.shape[1]
        self._begin(tokens)
        with torch.no_grad():
            chosen = (x != 0).any(dim=-1)  # [E, T]
            hit = [e for e in range(e_all) if bool(chosen[e].any())]
            out = torch.zeros_like(x)

            def work(e, slot):
                out[e] = self._expert(x[e], slot, e)

            order = self._visit(hit, work)
            if st.writer is not None:
                picks = chosen.T
                index = [row.nonzero().reshape(-1).tolist() for row in picks]
                self._record(st, index, order)
        self._end()
        return out.view(-1, h)

    def _begin(self, tokens):
        st = self._state
        if self.layer == 0:
            st.flush()
            st.steps += 1
            st.tokens += tokens
            st.step_start = time.perf_counter()

    def _end(self):
        st = self._state
        if self.layer == st.layers - 1 and st.step_start is not None:
            st.wall_seconds += time.perf_counter() - st.step_start
            st.step_start = None

    def _visit(self, hit, work):
        """Runs work(e, slot) for each expert of `hit`, its slot held, in
        waves of the device slots, reads overlapping compute: a wave pins
        its resident experts first (no wait; pinned, nothing below evicts
        them), starts the reads of the rest at once (read_ahead), starts
        the next layer's lookahead behind them, then computes the resident
        experts while those reads run and each read expert as soon as its
        own read is done. Returns the experts in the order fetched."""
        st = self._state
        cache = st.cache
        layer = self.layer
        slots = cache.device_slots
        # Resident experts first: their compute hides the first reads.
        hit = sorted(hit, key=lambda e: not cache.is_ready(layer, e))
        order = []
        for w0 in range(0, len(hit), slots):
            wave = hit[w0 : w0 + slots]
            resident = [e for e in wave if cache.is_ready(layer, e)]
            held = {}
            try:
                for e in resident:
                    held[e] = self._fetch(st, e)
                    order.append(e)
                missing = [e for e in wave if e not in held]
                if missing:
                    self._submit(st, layer, missing, st.cache.read_ahead)
                if w0 == 0 and st.prefetch and layer + 1 < st.layers:
                    guess = self._predict_next(st)
                    st.residual[layer] = None
                    if guess:
                        self._submit(st, layer + 1, guess, st.cache.prefetch)
                        if st.writer is not None and not st.per_token:
                            step = st.steps - 1
                            st.pending.extend(f"{step} {layer + 1} {e} prefetched\n" for e in guess)
                for e in wave:
                    if e not in held:
                        held[e] = self._fetch(st, e)
                        order.append(e)
                    t0 = time.perf_counter()
                    work(e, held[e])
                    st.compute_seconds[layer] += time.perf_counter() - t0
                    # Done with it: its slot may go to a later read.
                    held.pop(e).release()
            except BaseException as ex:
                # The frames below (the experts' arithmetic) hold views of
                # the slots, each with a pin of its own: a traceback kept
                # alive (a notebook's last exception) would keep them
                # pinned after the slots go back.
                traceback.clear_frames(ex.__traceback__)
                raise
            finally:
                for slot in held.values():
                    slot.release()
        # This layer has run: its prefetches still in flight were late
        # or wrong.
        before = st.snapshot()
        t0 = time.perf_counter()
        cache.cancel_prefetches(layer)
        st.call_seconds[layer] += time.perf_counter() - t0
        st.credit(layer, before, st.snapshot())
        return order

    def _fetch(self, st, e):
        """Expert e of this layer pinned (waiting for its read if need be),
        the wait counted as stall."""
        cache, layer = st.cache, self.layer
        before = st.snapshot()
        t0 = time.perf_counter()
        if st.modelled:
            cache.advance(max(0.0, t0 - st.mark))
        slot = cache.fetch(layer, e)
        st.mark = time.perf_counter()
        st.measured_stall[layer] += st.mark - t0
        st.credit(layer, before, st.snapshot())
        return slot

    def _submit(self, st, layer, experts, call):
        """call(layer, experts): starts reads (read_ahead or prefetch; the
        submission only: the reads run off this thread), its time counted
        as submit."""
        before = st.snapshot()
        t0 = time.perf_counter()
        if st.modelled:
            # The modelled link starts the reads now, not at the last fetch.
            st.cache.advance(max(0.0, t0 - st.mark))
            st.mark = t0
        call(layer, experts)
        st.call_seconds[self.layer] += time.perf_counter() - t0
        st.credit(layer, before, st.snapshot())

    def _record(self, st, top_k_index, order):
        if st.per_token:
            # Written when the step ends, token by token (see flush).
            rows = top_k_index if isinstance(top_k_index, list) else top_k_index.tolist()
            st.pending.extend(
                f"{st.trace_token + t} {self.layer} {e}\n" for t, row in enumerate(rows) for e in row
            )
            if self.layer == st.layers - 1:
                base = st.trace_token
                st.pending.sort(key=lambda line: int(line.split(" ", 1)[0]) - base)
                st.trace_token += len(rows)
        else:
            step = st.steps - 1
            st.pending.extend(f"{step} {self.layer} {e}\n" for e in order)


class StrataGroupedMoE(nn.Module):
    """JetMoE's MoE block with its experts in a strata ExpertCache: the
    block's own router and bias, its experts' arithmetic through
    ``StrataExperts.forward_grouped``. Made by ``offload`` in place of the
    block."""

    def __init__(self, block: nn.Module, experts: StrataExperts):
        super().__init__()
        self.router = block.router
        self.bias = block.bias
        self.experts = experts

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        x = layer_input.reshape(-1, emb_size)
        index_sorted_experts, batch_index, batch_gates, expert_size, _ = self.router(x)
        out = self.experts.forward_grouped(x, index_sorted_experts, batch_index, batch_gates, expert_size)
        return out.view(bsz, length, emb_size) + self.bias


class OffloadedMoE:
    """The handle ``offload`` returns: the cache, the blocks, their stats."""

    def __init__(self, state: _State, layout: Dict[str, Any], hooks, record_path):
        self._state = state
        self.layout = layout
        self._hooks = hooks
        self.record_path = record_path

    @property
    def cache(self) -> ExpertCache:
        return self._state.cache

    @property
    def layers(self) -> int:
        return self._state.layers

    def _summary(self, c: Dict[str, Any], measured: float, calls: float, compute: float) -> Dict[str, Any]:
        st = self._state
        out = dict(c)
        out["hit_rate"] = c["hits"] / c["fetches"] if c["fetches"] else 0.0
        out["prefetch_accuracy"] = c["prefetches_used"] / c["prefetches"] if c["prefetches"] else 0.0
        # Experts moved into device memory, and those fetched before they
        # left (every miss's move; a prefetch only if it was used).
        misses = c["fetches"] - c["hits"] - c["served_in_place"]
        out["moves"] = misses + c["prefetches"]
        out["moves_paid"] = misses + c["prefetches_used"]
        out["bytes_moved_per_token"] = c["bytes_moved"] / st.tokens if st.tokens else 0.0
        cache_stall = out.pop("stall_seconds")
        out["modelled_stall_seconds"] = cache_stall if st.modelled else None
        out["stall_seconds"] = measured
        out["prefetch_call_seconds"] = calls
        out["compute_seconds"] = compute
        return out

    def stats(self) -> Dict[str, Any]:
        """{"total": {...}, "layers": [{...} per MoE block], "tokens",
        "steps", "modelled", "expert_bytes", "device_slots"}. Each entry:
        fetches, hits, hit_rate, prefetches, prefetches_used,
        prefetch_accuracy, moves (experts moved into device memory: misses
        and prefetches), moves_paid (of those, the ones fetched before they
        left), moves_from_nvme (of the moves, those read from the disk; the
        others copied from host memory), host_swaps (evictions that took the
        host memory of an expert worth less there), served_in_place (fetches
        read from host memory where the expert is: host_in_place; neither
        hits nor moves), prefetches_dropped, prefetches_cancelled,
        evictions, bytes_moved, bytes_moved_per_token, stall_seconds (wall
        time spent in fetches), prefetch_call_seconds (wall time in the
        prefetch and cancel calls: their submission, since room is made off
        the caller's thread), compute_seconds (wall time in the experts'
        arithmetic), modelled_stall_seconds (the simulated device's model;
        None on a GPU). A layer's prefetches are those made for it (by the
        layer before). "breakdown": the steps' wall time from their first
        MoE layer's start to their last's end, split into compute, stall
        (fetches), submit (prefetch and cancel calls) and other (what
        runs between the MoE layers: attention, norms, routers)."""
        st = self._state
        layers = [
            self._summary(dict(c), m, x, k)
            for c, m, x, k in zip(st.per_layer, st.measured_stall, st.call_seconds, st.compute_seconds)
        ]
        total = dict.fromkeys(_COUNTERS, 0)
        for c in st.per_layer:
            for k in _COUNTERS:
                total[k] += c[k]
        stall, submit, compute = sum(st.measured_stall), sum(st.call_seconds), sum(st.compute_seconds)
        return {
            "total": self._summary(total, stall, submit, compute),
            "breakdown": {
                "wall_seconds": st.wall_seconds,
                "compute_seconds": compute,
                "stall_seconds": stall,
                "submit_seconds": submit,
                "other_seconds": max(0.0, st.wall_seconds - compute - stall - submit),
            },
            "layers": layers,
            "tokens": st.tokens,
            "steps": st.steps,
            "modelled": st.modelled,
            "expert_bytes": self.layout["expert_bytes"],
            "device_slots": st.cache.device_slots,
        }

    def reset_stats(self) -> None:
        """Zeroes the per-layer counters (the cache's own keep counting)."""
        st = self._state
        st.per_layer = [dict.fromkeys(_COUNTERS, 0) for _ in range(st.layers)]
        st.measured_stall = [0.0] * st.layers
        st.call_seconds = [0.0] * st.layers
        st.compute_seconds = [0.0] * st.layers
        st.wall_seconds = 0.0
        st.step_start = None
        st.tokens = st.steps = 0

    def set_prefetch(self, on: bool) -> None:
        """Turns the lookahead prefetch on or off."""
        self._state.prefetch = bool(on)

    def flush(self) -> None:
        """Writes the routing recorded so far (the last step's too)."""
        self._state.flush()

    def close(self) -> None:
        """Flushes and closes the routing trace (the model keeps working)."""
        st = self._state
        st.flush()
        if st.writer is not None:
            st.writer.close()
            st.writer = None


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _check_device(model: nn.Module, dev: torch.device, device) -> bool:
    """Whether the slots go to the GPU (device "cuda", or "auto" where one
    is present); refuses a model that does not sit where its experts will
    be computed: on the CPU for the simulated device, on GPU 0 (the one
    strata opens) for CUDA, all of it on one device."""
    where = sorted({str(p.device) for p in model.parameters() if p.device.type != "meta"})
    if len(where) > 1:
        raise InvalidArgumentError(
            f"the model's parameters are on {', '.join(where)}: strata.moe offloads a model on one device"
        )
    if device not in ("sim", "cuda", "auto"):
        raise InvalidArgumentError(f"device must be 'sim', 'cuda' or 'auto', not {device!r}")
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if on_gpu and (dev.type != "cuda" or (dev.index or 0) != 0):
        raise InvalidArgumentError(
            f"the model is on {dev}, and device={device!r} puts the expert slots on GPU 0: "
            "move the model to cuda:0, or give device='sim' for a model on the CPU"
        )
    if not on_gpu and dev.type != "cpu":
        raise InvalidArgumentError(
            f"the model is on {dev}, and device={device!r} keeps the expert slots in host memory: "
            "give device='cuda' for a model on the GPU, or move the model to the CPU"
        )
    return on_gpu


def _checkpoint(path) -> Dict[str, Any]:
    """Tensor name -> the open safetensors file holding it, for a file or a
    directory of them."""
    from pathlib import Path

    from safetensors import safe_open

    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    if not files:
        raise InvalidArgumentError(f"checkpoint {os.fspath(path)!r}: no .safetensors file there")
    where = {}
    for f in files:
        h = safe_open(os.fspath(f), framework="pt")
        for k in h.keys():
            where[k] = h
    return where


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _checkpoint_dtype(checkpoint, where, block) -> torch.dtype:
    """The dtype of `block`'s experts in the checkpoint (`where`: its
    tensors' files, from _checkpoint)."""
    key = f"{block.name}.{next(iter(block.tensors()))}"
    if key not in where:
        raise InvalidArgumentError(f"checkpoint {os.fspath(checkpoint)!r} has no tensor {key!r}")
    name = where[key].get_slice(key).get_dtype()
    if name not in _SAFETENSORS_DTYPES:
        raise InvalidArgumentError(f"checkpoint tensor {key!r} is {name} (use float32, float16 or bfloat16)")
    return _SAFETENSORS_DTYPES[name]


def _expert_source(blocks, checkpoint, where):
    """A function (block, expert) -> (gate_up [2I, H], down [H, I]) reading
    the model's own tensors or, for experts on the meta device, the
    checkpoint (one expert at a time; `where`: its tensors' files)."""
    meta = [b.name for b in blocks if any(t.device.type == "meta" for t in b.tensors().values())]
    if checkpoint is None:
        if meta:
            raise InvalidArgumentError(
                f"the experts of {meta[0]} are on the meta device: pass checkpoint= (the "
                "safetensors the model was saved to) to read them from"
            )
        return lambda b, x: b.expert({n: t.detach() for n, t in b.tensors().items()}, x)
    for b in blocks:
        for t, own in b.tensors().items():
            key = f"{b.name}.{t}"
            if key not in where:
                raise InvalidArgumentError(
                    f"checkpoint {os.fspath(checkpoint)!r} has no tensor {key!r} (transformers 5 keeps "
                    "fused experts under these names with save_pretrained(..., save_original_format=False))"
                )
            shape = tuple(where[key].get_slice(key).get_shape())
            if shape != tuple(own.shape):
                raise InvalidArgumentError(f"checkpoint tensor {key!r} has shape {shape}, the model's {tuple(own.shape)}")

    class _Slices:
        """The checkpoint's tensors of one block, sliced as they are read."""

        def __init__(self, b):
            self.b = b

        def __getitem__(self, name):
            key = f"{self.b.name}.{name}"
            return where[key].get_slice(key)

    def read(b, x):
        return b.expert(_Slices(b), x)

    return read


def _biases(b, checkpoint, where, dtype):
    """A transposed block's experts' biases (gate_up [E, 2I], down [E, H]):
    the model's, or the checkpoint's for experts on the meta device, in the
    experts' dtype (a model built on the meta device has the config's
    default dtype there, the checkpoint's experts their own)."""
    names = ("gate_up_proj_bias", "down_proj_bias")
    own = [getattr(b.experts, n) for n in names]
    if all(t.device.type != "meta" for t in own):
        return [t.detach().clone() for t in own]
    if checkpoint is None:
        raise InvalidArgumentError(f"the expert biases of {b.name} are on the meta device: pass checkpoint=")
    out = []
    for n, t in zip(names, own):
        key = f"{b.name}.{n}"
        if key not in where:
            raise InvalidArgumentError(f"checkpoint {os.fspath(checkpoint)!r} has no tensor {key!r}")
        out.append(where[key].get_tensor(key).to(dtype))
    return out


def offload(
    model: nn.Module,
    *,
    device_slots: Optional[int] = None,
    device_bytes: Optional[int] = None,
    host_bytes: Optional[int] = None,
    nvme_path: Optional[str] = None,
    nvme_capacity: Optional[int] = None,
    device: Optional[str] = None,
    prefetch: bool = True,
    max_prefetch: Optional[int] = None,
    record_routing: Optional[str] = None,
    record_per_token: bool = False,
    page_size: Optional[int] = None,
    eviction: str = "reuse",
    decay: Optional[float] = None,
    protect_fetches: Optional[int] = None,
    nvme_miss_cost: float = 4.0,
    host_cache: bool = False,
    host_in_place: Optional[bool] = None,
    checkpoint: Optional[str] = None,
    max_memory: Optional[Dict[Any, Any]] = None,
    offload_folder: Optional[str] = None,
) -> OffloadedMoE:
    """Moves the experts of every MoE block of `model` into a strata
    expert cache and makes the blocks fetch them through it (see the module
    docs). Returns the OffloadedMoE handle (stats, the trace).

    device_slots / device_bytes: experts in device memory at once (one of
        them; default: a quarter of all experts, at least one).
    host_bytes: host memory for the experts; the rest goes to an NVMe tier
        at nvme_path (a directory or a new file name), of nvme_capacity
        bytes (default: every expert's bytes and the store's reserve of
        64 pages, so that every expert keeps its NVMe copy). Default: what this machine
        can spare (four fifths of the smaller of MemAvailable and the
        memory cgroup's headroom, less the device slots on the simulated
        device, whose slots are host memory), at most every expert;
        without nvme_path the experts must fit in it.
    max_memory, offload_folder: the same budgets in accelerate's words:
        max_memory={"cpu": host, 0: device} (bytes or sizes such as
        "8GiB"; "disk" ignored) and offload_folder for nvme_path.
    device: "sim" (no GPU: slots are host memory, stall also modelled),
        "cuda" (GPU 0) or "auto" (a GPU where present); default "cuda" for
        a model on a GPU, else "sim". A model that is not where the slots
        go (on the CPU for "sim", on cuda:0 for a GPU, all on one device)
        is refused.
    prefetch: the lookahead through the next layer's router; max_prefetch
        caps the experts prefetched per layer (default: the router's top-k;
        the experts most of the batch's tokens are predicted to pick, among
        those not already in a slot or read in place).
    record_routing: a path for the `token layer expert` trace
        (record_per_token: one trace token per token row, not per step).
        Per step, the lookahead is recorded too: `token layer expert
        prefetched` for each expert prefetched for `layer` (what `strata
        bench moe --routing file:` then prefetches).
    page_size: the runtime page (default: each expert tensor in one page up
        to 2 MiB, larger ones over 2 MiB pages; smaller pages where a slot
        of whole pages would waste more than a sixteenth of it).
    eviction, decay, protect_fetches: the cache's victim choice ("reuse",
        the default: the expert whose next use is expected farthest away,
        its layer's next visit or a later one with the share of that
        layer's visits that used it, decayed with a half-life of 256 visits
        by default, times what its miss costs: an expert on NVMe counts
        as nvme_miss_cost (4 by default) kept in host memory; prefetches
        whose victim is worth more are declined;
        "lrfu":
        decayed use counts, a half-life of 16 passes over all experts'
        fetches by default; "lru"), and how many fetches a prefetched
        expert is protected for (default: two layers' worth of a token's
        experts).
    host_cache: where the host budget holds fewer than every expert, host
        memory caches them: an expert moved into device memory leaves it,
        an evicted one is copied there in place of the one least worth
        keeping, every expert has its copy on NVMe (written once, here).
        False, the default: host memory keeps the experts placed first
        (the copies on eviction cost about what the disk reads they save
        on a CPU; docs/perf-log.md).
    host_in_place: an expert in host memory and not in a device slot is
        read where it is, taking no slot and moving nothing, so the slots
        hold experts read from NVMe. Default: on for the simulated device
        (its slots are host memory too), off on a GPU (where it is refused:
        its kernels would need the host tier mapped, not built).
    checkpoint: a safetensors file or directory to read the experts from,
        one expert at a time, for a model whose experts were left on the
        meta device (built under accelerate.init_empty_weights(), say) so
        that the whole model never has to fit in memory. Tensor names are
        the modules' (transformers 5: save_pretrained(...,
        save_original_format=False)).

    The offloaded model runs one forward at a time: its blocks share one
    cache and one set of counters, and forwards from several threads at
    once can find every slot pinned by another (OutOfCapacityError) and
    mix their stats. A failed offload leaves the model as it was.
    """
    done = next((name for name, m in model.named_modules() if isinstance(m, (StrataExperts, StrataGroupedMoE))), None)
    if done is not None:
        raise InvalidArgumentError(f"{type(model).__name__} is offloaded already ({done} is strata's)")
    blocks = find_moe_blocks(model)
    if not blocks:
        other = _unsupported_experts(model)
        if other is not None:
            raise InvalidArgumentError(
                f"strata.moe cannot offload {other} of {type(model).__name__}: it runs experts modules "
                "with fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] tensors (or their transposes, or "
                "DBRX's w1, v1 and w2 [E * I, H]) under a block with a router (`gate` or `router`), or "
                "JetMoE's blocks (input_linear [E, 2I, H] and output_linear [E, H, I])"
            )
        raise InvalidArgumentError(
            f"{type(model).__name__} has no MoE block strata.moe can offload: it looks for experts "
            "modules with fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] tensors under a "
            "block with a router `gate` (Mixtral, Qwen2-MoE in transformers 5)"
        )
    device_bytes, host_bytes, nvme_path = _budgets(max_memory, offload_folder, device_bytes, host_bytes, nvme_path)
    if device_slots is not None:
        check_count(device_slots, "device_slots", 1)
    if max_prefetch is not None:
        check_count(max_prefetch, "max_prefetch")
    if protect_fetches is not None:
        check_count(protect_fetches, "protect_fetches")
    if nvme_capacity is not None:
        nvme_capacity = _bytes(nvme_capacity, "nvme_capacity")
    if isinstance(eviction, str):
        # The cache takes any case; the default decay depends on which.
        eviction = eviction.lower()
    if device_slots is not None and device_bytes is not None:
        raise InvalidArgumentError("give device_slots or a device budget (device_bytes, max_memory[0]), not both")
    if page_size is not None:
        check_page_size(page_size)
    first = next(iter(blocks[0].tensors().values()))
    e, two_i, h = blocks[0].dims()
    i = two_i // 2
    on_meta = first.device.type == "meta"
    # Experts left on the meta device take the checkpoint's dtype (a model
    # built under init_empty_weights has the config's default there).
    # The checkpoint's files, opened once for the whole call.
    where = _checkpoint(checkpoint) if checkpoint is not None else None
    dtype = _checkpoint_dtype(checkpoint, where, blocks[0]) if on_meta and where is not None else first.dtype
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"experts of dtype {dtype} are not supported (use float32, float16 or bfloat16)")
    for b in blocks:
        own = next(iter(b.tensors().values()))
        if (
            b.dims() != blocks[0].dims()
            or (not on_meta and own.dtype != dtype)
            or (b.transposed, b.dense, b.split, b.grouped)
            != (blocks[0].transposed, blocks[0].dense, blocks[0].split, blocks[0].grouped)
        ):
            raise InvalidArgumentError(f"{b.name}: every MoE block must have experts of the same layout and dtype")
    source = _expert_source(blocks, checkpoint, where)
    elt = dtype.itemsize
    gate_up_bytes = two_i * h * elt
    down_bytes = h * i * elt
    if page_size is None:
        page_size = _page_for(gate_up_bytes, down_bytes)
    down_at = -(-gate_up_bytes // page_size) * page_size
    expert_bytes = down_at + down_bytes
    padded = -(-expert_bytes // page_size) * page_size
    n_experts = e * len(blocks)
    total = padded * n_experts
    if device_slots is None and device_bytes is None:
        device_slots = max(1, n_experts // 4)
    if device_bytes is not None:
        # A slot takes whole pages: the budget counts them.
        if device_bytes < padded:
            raise InvalidArgumentError(
                f"the device budget {device_bytes} holds no expert: one takes {padded} bytes "
                f"({expert_bytes} and its page padding)"
            )
        device_slots = device_bytes // padded
    dev = _model_device(model)
    if device is None:
        device = "cuda" if dev.type == "cuda" else "sim"
    on_gpu = _check_device(model, dev, device)
    spare = _spare_bytes()
    if not on_gpu:
        # The simulated device's slots are this process's memory too: more
        # than the machine can spare is refused here, not met by the OOM
        # killer once they are committed.
        if device_slots * padded > spare:
            raise InvalidArgumentError(
                f"the simulated device's {device_slots} slots take {device_slots * padded} bytes of this "
                f"process's memory and this machine can spare {spare}: give fewer device_slots"
            )
        spare -= device_slots * padded
    if host_bytes is None:
        if nvme_path is None and spare < total:
            raise InvalidArgumentError(
                f"the {n_experts} experts take {total} bytes and this machine can spare {spare}: "
                "give offload_folder (or nvme_path) for the rest, or host_bytes to insist"
            )
        host_bytes = min(total, max(padded, spare // padded * padded))
    if host_bytes < padded:
        raise InvalidArgumentError(
            f"the host budget {host_bytes} holds no expert ({padded} bytes each): strata.moe keeps at least "
            "one expert in host memory besides the device slots"
        )
    if host_bytes < total and nvme_path is None:
        raise InvalidArgumentError(
            f"host_bytes {host_bytes} holds {host_bytes // padded} of the {n_experts} experts "
            f"({padded} bytes each): give nvme_path for the rest, or more host_bytes"
        )
    if nvme_path is not None and nvme_capacity is None:
        # The store holds back up to 64 slots for copy-then-commit writes:
        # sized to the experts alone, it could not keep every expert's
        # copy, and an evicted expert whose copy was dropped for room
        # would be written back.
        nvme_capacity = total + 64 * page_size
    if nvme_capacity is not None:
        nvme_capacity = -(-nvme_capacity // page_size) * page_size
    if host_in_place is None:
        host_in_place = not on_gpu
    if decay is None:
        # A half-life of 16 passes over all experts' fetches for LRFU, of
        # 256 visits of a layer for the reuse estimate.
        decay = 0.5 ** (1.0 / (16.0 * n_experts)) if eviction == "lrfu" else 0.5 ** (1.0 / 256.0)
    if protect_fetches is None:
        k = int(getattr(blocks[0].gate, "top_k", 0) or getattr(blocks[0].block, "top_k", 2))
        protect_fetches = 2 * k
    cache = ExpertCache(
        slot_bytes=expert_bytes,
        host_bytes=host_bytes,
        device_slots=device_slots,
        device=device,
        nvme_path=None if nvme_path is None else os.fspath(nvme_path),
        nvme_capacity=nvme_capacity,
        page_size=page_size,
        eviction=eviction,
        decay=decay,
        layers=len(blocks),
        protect_fetches=protect_fetches,
        nvme_miss_cost=nvme_miss_cost,
        host_cache=host_cache,
        host_in_place=host_in_place,
    )
    layout = {
        "experts": e,
        "hidden": h,
        "intermediate": i,
        "dtype": dtype,
        "elt": elt,
        "down_at": down_at,
        "expert_bytes": expert_bytes,
        "page_size": page_size,
        "layers": len(blocks),
        "transposed": blocks[0].transposed,
        "dense": blocks[0].dense,
        "split": blocks[0].split,
        "grouped": blocks[0].grouped,
        "host_in_place": host_in_place,
    }
    # Everything that can fail comes before the model changes: the biases,
    # the trace file, every expert registered. A failed offload leaves the
    # model as it was.
    biases = {b.index: _biases(b, checkpoint, where, dtype) for b in blocks if b.transposed and not b.dense}
    # Opened to append: a trace already there is replaced only once the
    # offload has succeeded (and a file this call created goes if it fails).
    existed = record_routing is not None and os.path.exists(record_routing)
    writer = open(record_routing, "a") if record_routing is not None else None
    try:
        # Register every expert: [gate_up | pad to a page | down].
        staging = torch.zeros(expert_bytes, dtype=torch.uint8)
        for b in blocks:
            for x in range(e):
                gu, dp = source(b, x)
                staging[:gate_up_bytes] = gu.to(dtype).contiguous().cpu().reshape(-1).view(torch.uint8)
                staging[down_at:] = dp.to(dtype).contiguous().cpu().reshape(-1).view(torch.uint8)
                cache.register(b.index, x, staging.numpy())
                del gu, dp
        if writer is not None:
            writer.truncate(0)
            writer.write(
                f"# strata.moe routing: token layer expert ({len(blocks)} MoE layers, {e} experts; "
                f"a token is {'a token row' if record_per_token else 'a forward step'}"
                f"{'' if record_per_token else '; token layer expert prefetched: the lookahead'})\n"
            )
    except BaseException:
        if writer is not None:
            writer.close()
            if not existed:
                os.unlink(record_routing)
        raise
    state = _State(cache, blocks, prefetch, max_prefetch, writer, record_per_token)
    hooks = []
    for b in blocks:
        new = StrataExperts(state, b.index, b.experts, layout, biases.get(b.index))
        # Frees the original tensors (the model held their only references).
        if b.grouped:
            parent, attr = b.name.rsplit(".", 1)
            wrapper = StrataGroupedMoE(b.block, new)
            setattr(model.get_submodule(parent), attr, wrapper)
            b.block = wrapper
        else:
            b.block.experts = new
        b.experts = new
        if b.norm is not None:

            def capture(module, args, layer=b.index):
                # Only what the lookahead reads: the next block's router's
                # input, let go once it has been read.
                if state.prefetch and layer + 1 < state.layers:
                    state.residual[layer] = args[0]

            hooks.append(b.norm.register_forward_pre_hook(capture))
    return OffloadedMoE(state, layout, hooks, record_routing)
