"""Embedding tables sharded over torch.distributed: what each rank owns, and
the all-to-all exchanges of a sharded collection's forward and backward.

Table-wise, table k lives whole on rank k % world; row-wise, every table's
rows are cut into world contiguous blocks and rank r owns block r. Either
way one exchange serves both: each rank sends, to every owner, the bags of
its batch restricted to the ids that owner holds (lengths per bag, the ids
local to the owner's shard, their weights); the owner pools them (sums) and
sends the partial sums back; the rank that asked adds up its owners'
partial sums (row-wise) and divides by the bag's length for a mean. In
backward each rank sends its bags' gradient to the same owners, which turn
it into their rows' gradient and update them (the table's optimizer, as in
one process); the gradient is the mean over the ranks by default, as DDP
makes the dense one (gradient_division=False: the sum). Every exchange is
an ``all_to_all_single`` (gloo on CPU, NCCL where the tensors are on
GPUs)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._bags import _bag_backward, _concat_bags

Bag = Tuple[Tensor, Tensor, Optional[Tensor]]


def _exchange(send: List[Tensor], group, dtype) -> List[Tensor]:
    """send[o] to rank o, for every o; returns what every rank sent here."""
    world = len(send)
    sizes = torch.tensor([t.numel() for t in send], dtype=torch.int64)
    got = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(got, sizes, group=group)
    flat = torch.cat([t.reshape(-1).to(dtype) for t in send]) if send else torch.zeros(0, dtype=dtype)
    out = torch.empty(int(got.sum()), dtype=dtype)
    dist.all_to_all_single(
        out, flat, output_split_sizes=got.tolist(), input_split_sizes=sizes.tolist(), group=group
    )
    return list(out.split(got.tolist()))


class Plan:
    """Which rank owns what, and the exchanges (see the module's docs)."""

    def __init__(self, specs, sharding: str, group, kwargs, divide: bool = True) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f'sharding="{sharding}" needs torch.distributed initialised (init_process_group)')
        if kwargs.get("padding_idx") is not None:
            raise ValueError("a sharded collection takes no padding_idx")
        self.specs = specs
        self.sharding = sharding
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # Row-wise: each table's block of rows per rank.
        self.block = [-(-s.rows // self.world) for s in specs]
        self.anchor = torch.zeros((), requires_grad=True)
        # The collection's requires_grad_(False): no backward, no update
        # (every rank freezes alike, or the all-to-alls of backward hang).
        self.frozen = False
        self.divide = divide

    def _rows_on(self, k: int, r: int) -> Tuple[int, int]:
        """Table k's rows [lo, hi) on rank r."""
        if self.sharding == "table":
            return (0, self.specs[k].rows) if k % self.world == r else (0, 0)
        lo = min(self.specs[k].rows, r * self.block[k])
        return lo, min(self.specs[k].rows, lo + self.block[k])

    def local_tables(self) -> List[Tuple[int, int]]:
        """(table, rows) of this rank's shards, in table order."""
        out = []
        for k in range(len(self.specs)):
            lo, hi = self._rows_on(k, self.rank)
            if hi > lo:
                out.append((k, hi - lo))
        self.module_of = {k: i for i, (k, _) in enumerate(out)}
        return out

    def local_rows(self, k: int, weight: Tensor) -> Tensor:
        """This rank's rows of table k's initial weight."""
        lo, hi = self._rows_on(k, self.rank)
        return weight[lo:hi]

    def served(self, features, r: int) -> List[int]:
        """Positions (in the collection's features) of the features rank r
        pools: those of the tables it holds rows of."""
        return [i for i, (_, k) in enumerate(features) if self._rows_on(k, r)[1] > self._rows_on(k, r)[0]]

    def pool(self, coll, batch: int, bags: List[Bag]) -> Tensor:
        anchor = self.anchor.detach() if self.frozen else self.anchor
        return _Route.apply(anchor, self, coll, batch, bags)

    def route(self, features, batch: int, bags: List[Bag], weighted: bool):
        """Per owner: the lengths, local ids and weights of this rank's bags
        of the features it serves."""
        lengths, ids, weights = [], [], []
        for o in range(self.world):
            ls, vs, ws = [], [], []
            for i in self.served(features, o):
                idx, off, w = bags[i]
                k = features[i][1]
                counts = off[1:] - off[:-1]
                if self.sharding == "table":
                    keep = None
                    ls.append(counts)
                    vs.append(idx)
                else:
                    lo, hi = self._rows_on(k, o)
                    keep = (idx >= lo) & (idx < hi)
                    bag = torch.repeat_interleave(torch.arange(batch), counts)
                    ls.append(torch.bincount(bag[keep], minlength=batch))
                    vs.append(idx[keep] - lo)
                if weighted:
                    ws.append(w if keep is None else w[keep])
            lengths.append(torch.cat(ls) if ls else torch.zeros(0, dtype=torch.int64))
            ids.append(torch.cat(vs) if vs else torch.zeros(0, dtype=torch.int64))
            weights.append(torch.cat(ws) if ws else torch.zeros(0))
        return lengths, ids, weights


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, plan: Plan, coll, batch: int, bags: List[Bag]):  # noqa: D401
        features, group, world = coll._features, plan.group, plan.world
        weighted = coll.is_weighted
        lengths, ids, weights = plan.route(features, batch, bags, weighted)
        batches = _exchange([torch.tensor([batch]) for _ in range(world)], group, torch.int64)
        batches = [int(b) for b in batches]
        got_lengths = _exchange(lengths, group, torch.int64)
        got_ids = _exchange(ids, group, torch.int64)
        got_weights = _exchange(weights, group, torch.float32) if weighted else None
        # The owner's pooling: every source's bags of each feature it
        # serves, one call per table (its features' updates then come as
        # one, as in one process).
        mine = plan.served(features, plan.rank)
        segments = {}  # (feature j, source s) -> its bags
        start = [0] * world  # each source's next id
        for j in range(len(mine)):
            for s in range(world):
                n = batches[s]
                seg = got_lengths[s][j * n : (j + 1) * n]
                take = int(seg.sum())
                idx = got_ids[s][start[s] : start[s] + take]
                w = got_weights[s][start[s] : start[s] + take] if weighted else None
                start[s] += take
                off = torch.cat([torch.zeros(1, dtype=torch.int64), seg.cumsum(0)])
                segments[(j, s)] = (idx, off, w)
        saved = []
        rows = {}  # (feature j, source s) -> its pooled rows
        for k in sorted({features[i][1] for i in mine}):
            module = coll.tables[plan.module_of[k]]
            order = [(j, s) for j, i in enumerate(mine) if features[i][1] == k for s in range(world)]
            idx, off, w = _concat_bags([segments[o] for o in order])
            out = torch.empty(off.numel() - 1, module.embedding_dim, dtype=torch.float32)
            module._table.bag(
                idx.numpy(), off.numpy(), out.numpy(),
                weights=None if w is None else w.numpy(), mean=False, padding_idx=None,
            )
            row = 0
            for o in order:
                rows[o] = out[row : row + batches[o[1]]]
                row += batches[o[1]]
            saved.append((module, idx, off, w, order))
        # Back to the ranks that asked: each source's rows of every feature.
        back = []
        for s in range(world):
            cols = [rows[(j, s)] for j in range(len(mine))]
            back.append(torch.cat(cols, dim=1) if cols else torch.zeros(batches[s], 0))
        partial = _exchange(back, group, torch.float32)
        dims = [coll._specs[k].dim for _, k in features]
        at = [0]
        for d in dims:
            at.append(at[-1] + d)
        values = torch.zeros(batch, at[-1])
        for o in range(world):
            served = plan.served(features, o)
            # The width known, not inferred: a batch of 0 has none to infer.
            width = sum(dims[i] for i in served)
            block = partial[o].reshape(batch, width) if served else None
            col = 0
            for i in served:
                values[:, at[i] : at[i + 1]] += block[:, col : col + dims[i]]
                col += dims[i]
        # Means: divided by the whole bag's length here, where it is known.
        scale = torch.ones(batch, len(features))
        for i, (_, k) in enumerate(features):
            if coll._specs[k].mode == "mean":
                counts = (bags[i][1][1:] - bags[i][1][:-1]).clamp(min=1).to(torch.float32)
                scale[:, i] = 1.0 / counts
                values[:, at[i] : at[i + 1]] *= scale[:, i : i + 1]
        ctx.plan, ctx.coll, ctx.saved_bags = plan, coll, saved
        ctx.batch, ctx.batches, ctx.at, ctx.scale = batch, batches, at, scale
        return values

    @staticmethod
    def backward(ctx, grad):
        plan, coll, features = ctx.plan, ctx.coll, ctx.coll._features
        at, world = ctx.at, plan.world
        grad = grad.detach().to("cpu", torch.float32).clone()
        for i in range(len(features)):
            grad[:, at[i] : at[i + 1]] *= ctx.scale[:, i : i + 1]
        if plan.divide:
            # Averaged over the ranks, as DDP averages the dense gradients
            # (TorchRec's sharded modules divide likewise).
            grad /= world
        send = []
        for o in range(world):
            cols = [grad[:, at[i] : at[i + 1]] for i in plan.served(features, o)]
            send.append(torch.cat(cols, dim=1) if cols else torch.zeros(ctx.batch, 0))
        got = _exchange(send, plan.group, torch.float32)
        mine = plan.served(features, plan.rank)
        width = sum(at[i + 1] - at[i] for i in mine)
        blocks = [got[s].reshape(ctx.batches[s], width) for s in range(world)]
        cols, col = [], 0
        for i in mine:
            cols.append(col)
            col += at[i + 1] - at[i]
        for module, idx, off, w, order in ctx.saved_bags:
            d = module.embedding_dim
            g = torch.cat([blocks[s][:, cols[j] : cols[j] + d] for j, s in order])
            _bag_backward(module, idx, off, w, g)
        return None, None, None, None, None
