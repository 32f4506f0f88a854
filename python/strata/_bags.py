"""The pooling's pieces that strata.nn and its sharded collection share:
bags concatenated, and the backward of a table's pooling."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def _concat_bags(bags) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Bags (ids, offsets with one entry more than the bags, weights or
    None) one after another, as one list of bags."""
    ids = torch.cat([b[0] for b in bags])
    offs, base = [torch.zeros(1, dtype=torch.int64)], 0
    for b in bags:
        offs.append(b[1][1:] + base)
        base += int(b[1][-1])
    weights = None if bags[0][2] is None else torch.cat([b[2] for b in bags]).contiguous()
    return ids.contiguous(), torch.cat(offs), weights


def _bag_backward(module, idx, off, w, grad_out, rows_grad=True, weights_grad=False, rows=None):
    """The backward of module's pooling of bags (idx, off, weights w) for
    grad_out, the bags' gradient: the touched rows' gradient applied to
    the table (by its optimizer, or into module.grad); returns the
    per-sample weights' gradient where weights_grad, from rows (the rows
    the forward pooled, read then: another backward may have updated the
    table since), else from the table as it is now."""
    grad_out = grad_out.detach().to("cpu", torch.float32).contiguous()
    if rows_grad and not weights_grad and module.optimizer is not None and idx.numel() > 0:
        # The table's fused backward: the rows' gradients summed and the
        # update applied in one call (the same sums as below, in Rust).
        module._table.bag_backward(
            idx.numpy(),
            off.numpy(),
            grad_out.numpy(),
            weights=None if w is None else w.numpy(),
            mean=module.mode == "mean",
            padding_idx=module.padding_idx,
            optimizer=module.optimizer,
            lr=module.lr,
            eps=module.eps,
            state=module.momentum.numpy() if module.optimizer == "rowwise_adagrad" else None,
        )
        return None
    lengths = off[1:] - off[:-1]
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    keep = None if module.padding_idx is None else idx != module.padding_idx
    # Each lookup's share of its bag's gradient.
    scale = torch.ones(idx.numel(), dtype=torch.float32)
    if keep is not None:
        scale = scale * keep
    if module.mode == "mean":
        counts = torch.zeros(lengths.numel(), dtype=torch.float32).index_add_(0, bag, scale)
        scale = scale / counts.clamp(min=1)[bag]
    grad_w = None
    if weights_grad:
        # d out[bag] / d w[i] = row[i]: the rows the forward pooled.
        if rows is None:
            rows = torch.empty(idx.numel(), module.embedding_dim, dtype=torch.float32)
            module._table.read_rows(idx.numpy(), rows.numpy())
        grad_w = (grad_out[bag] * rows).sum(1)
        if keep is not None:
            grad_w = grad_w * keep
    if w is not None:
        scale = scale * w
    if idx.numel() > 0 and rows_grad:
        per = grad_out.index_select(0, bag) * scale.unsqueeze(1)
        uniq, inverse = torch.unique(idx, return_inverse=True)
        g = torch.zeros(uniq.numel(), module.embedding_dim, dtype=torch.float32)
        g.index_add_(0, inverse, per)
        if module.padding_idx is not None:
            # The padding row never changes (torch leaves its gradient 0).
            kept = uniq != module.padding_idx
            uniq, g = uniq[kept].contiguous(), g[kept].contiguous()
        module._apply_grad(uniq, g)
    return grad_w
