"""strata.nn.EmbeddingBag against torch.nn.EmbeddingBag, and its fused
updates against the same rules written in plain torch over a dense table.

Skipped, with the reason printed, where torch is not installed; with
STRATA_REQUIRE_TORCH=1 (CI) a missing torch is a failure instead."""

import os

import pytest

if os.environ.get("STRATA_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401  (must be there)
else:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (tests/run.sh installs it unless STRATA_NO_TORCH=1)"
    )

import strata
import strata.nn

PAGE = 4096
# Pooling sums in the same order as torch's CPU kernel only sometimes.
TOL = dict(rtol=1e-5, atol=1e-5)
ROWS, DIM = 3000, 16  # 64 B rows: 64 a page, 47 pages


def table(seed=0, rows=ROWS, dim=DIM):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=g)


def tiered(weight, tmp_path, fast_pages=8, **kw):
    """weight in a runtime whose fast tier holds fast_pages pages, NVMe below."""
    kw.setdefault("mode", "sum")
    return strata.nn.EmbeddingBag(
        weight.shape[0],
        weight.shape[1],
        _weight=weight,
        fast_bytes=fast_pages * PAGE,
        nvme_path=str(tmp_path),
        page_size=PAGE,
        balance="manual",
        **kw,
    )


def bags(seed=1, n=200, b=24, rows=ROWS):
    """Random indices and offsets with empty bags among them (first, middle, last)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows, (n,), generator=g)
    cuts = torch.sort(torch.randint(0, n + 1, (b - 4,), generator=g)).values
    off = torch.cat([torch.tensor([0, 0]), cuts, torch.tensor([cuts[-1].item(), n])])[: b]
    return idx, off


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("where", ["dram", "tiered"])
def test_forward_and_backward_equal_torch(mode, where, tmp_path):
    w = table()
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode=mode)
    if where == "dram":
        emb = strata.nn.EmbeddingBag(ROWS, DIM, mode=mode, _weight=w)
    else:
        emb = tiered(w, tmp_path, mode=mode)
        assert emb.runtime.tiers == ["device", "host", "nvme"]
        # Rows in every tier: the first write filled the fast tier first.
        assert {emb.tier_of(r) for r in range(0, ROWS, 8)} == {"device", "host", "nvme"}
    idx, off = bags()
    assert (off[1:] == off[:-1]).any() and off[0] == off[1]  # empty bags
    out, expect = emb(idx, off), ref(idx, off)
    torch.testing.assert_close(out, expect, **TOL)
    g = torch.Generator().manual_seed(5)
    up = torch.randn(out.shape, generator=g)
    (out * up).sum().backward()
    (expect * up).sum().backward()
    assert emb.grad.is_sparse
    torch.testing.assert_close(emb.grad.to_dense(), ref.weight.grad, **TOL)
    # Only the touched rows have a gradient.
    assert set(emb.grad.coalesce().indices()[0].tolist()) == set(idx.tolist())


def test_per_sample_weights_and_their_gradient(tmp_path):
    w = table()
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum")
    emb = tiered(w, tmp_path)
    idx, off = bags(seed=3)
    psw = torch.rand(idx.shape, generator=torch.Generator().manual_seed(4))
    p1, p2 = psw.clone().requires_grad_(), psw.clone().requires_grad_()
    out, expect = emb(idx, off, p1), ref(idx, off, per_sample_weights=p2)
    torch.testing.assert_close(out, expect, **TOL)
    out.pow(2).sum().backward()
    expect.pow(2).sum().backward()
    torch.testing.assert_close(p1.grad, p2.grad, **TOL)
    torch.testing.assert_close(emb.grad.to_dense(), ref.weight.grad, **TOL)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_2d_input_include_last_offset_and_padding_idx(mode, tmp_path):
    w = table()
    ref = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=7)
    emb = strata.nn.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=7)
    # Both zero the padding row at construction; copy the rest across.
    with torch.no_grad():
        w[7] = 0
        ref.weight.copy_(w)
    emb._table.write_rows(0, w.numpy())
    x = torch.randint(0, ROWS, (6, 5), generator=torch.Generator().manual_seed(2))
    x[0, :2] = 7
    x[3, :] = 7  # a bag of padding only
    out, expect = emb(x), ref(x)
    torch.testing.assert_close(out, expect, **TOL)
    out.sum().backward()
    expect.sum().backward()
    torch.testing.assert_close(emb.grad.to_dense(), ref.weight.grad, **TOL)
    assert 7 not in emb.grad.coalesce().indices()[0].tolist()
    # include_last_offset: the CSR form of the same bags.
    emb2 = strata.nn.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=7, include_last_offset=True, _weight=w)
    csr = torch.arange(0, 31, 5)
    torch.testing.assert_close(emb2(x.reshape(-1), csr), expect, **TOL)


def sgd_reference(w, batches, lr, mode):
    w = w.clone()
    for idx, off in batches:
        ref = torch.nn.EmbeddingBag.from_pretrained(w, freeze=False, mode=mode)
        loss = (ref(idx, off) ** 2).sum()
        loss.backward()
        w = (w - lr * ref.weight.grad).detach()
    return w


def adagrad_reference(w, batches, lr, eps, mode):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD, dense: rows without a gradient keep
    their values and accumulators (their update is zero)."""
    w = w.clone()
    state = torch.zeros(w.shape[0])
    for idx, off in batches:
        ref = torch.nn.EmbeddingBag.from_pretrained(w, freeze=False, mode=mode)
        loss = (ref(idx, off) ** 2).sum()
        loss.backward()
        g = ref.weight.grad
        state = state + (g * g).mean(1)
        w = (w - (lr / (state.sqrt() + eps)).unsqueeze(1) * g).detach()
    return w, state


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("row_cache", [0, 128])
def test_training_steps_equal_a_plain_torch_reference(optimizer, mode, row_cache, tmp_path):
    w = table(seed=9)
    batches = [bags(seed=10 + s) for s in range(4)]
    emb = tiered(
        w, tmp_path, mode=mode, optimizer=optimizer, lr=0.05, eps=1e-6, row_cache=row_cache
    )
    for i, (idx, off) in enumerate(batches):
        (emb(idx, off) ** 2).sum().backward()
        if i == 1:
            emb.balance()  # pages move between steps; values must not care
    assert emb.grad is None  # the update consumed it
    if optimizer == "sgd":
        expect = sgd_reference(w, batches, 0.05, mode)
    else:
        expect, state = adagrad_reference(w, batches, 0.05, 1e-6, mode)
        torch.testing.assert_close(emb.momentum, state, **TOL)
    torch.testing.assert_close(emb.weight, expect, **TOL)
    # The table's own pages hold every update once the row cache's
    # changed rows are written back.
    emb.flush()
    raw = emb._table.buffer.read(0, w.numel() * 4)
    torch.testing.assert_close(torch.frombuffer(bytearray(raw), dtype=torch.float32).view_as(w), expect, **TOL)


@pytest.mark.parametrize("row_cache", [0, 128])
def test_state_dict_saves_and_restores_the_table(row_cache, tmp_path):
    """state_dict() holds the table as torch's "weight" (and the
    accumulators): trained rows, rows changed only in the row cache
    included, load into a fresh table exactly; a table of another shape is
    refused by load_state_dict, and a state dict without the table is
    missing a key."""
    w = table(seed=4)
    a = tiered(w, tmp_path / "a", optimizer="rowwise_adagrad", lr=0.05, row_cache=row_cache)
    for seed in (20, 21):
        idx, off = bags(seed=seed)
        (a(idx, off) ** 2).sum().backward()
    sd = a.state_dict()
    assert set(sd) == {"momentum", "weight"}
    assert not torch.equal(sd["weight"], w)  # trained
    b = tiered(table(seed=5), tmp_path / "b", optimizer="rowwise_adagrad", lr=0.05)
    b.load_state_dict(sd)
    assert torch.equal(b.weight, a.weight)
    assert torch.equal(b.momentum, a.momentum)
    idx, off = bags(seed=22)
    assert torch.equal(b(idx, off), a(idx, off))
    c = tiered(table(seed=5, rows=ROWS - 1), tmp_path / "c", optimizer="rowwise_adagrad")
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        c.load_state_dict(sd)
    with pytest.raises(RuntimeError, match='Missing key.*"weight"'):
        b.load_state_dict({"momentum": sd["momentum"]})


def test_row_table_calls_write_into_memory_the_runtime_lent_out():
    """A RowTable's output given as strata's own memory (a DLPack view of a
    pinned page of the same runtime) is filled through a copy: the rows
    come out right even where the output is the page being read."""
    rt = strata.Runtime(device=None, host_capacity=8 << 20, page_size=PAGE)
    tb = strata.nn.RowTable(rt, 1024, 4)
    tb.write_rows(0, torch.arange(4096, dtype=torch.float32).numpy())
    out = torch.from_dlpack(tb.buffer.pin((0, 32), "host", dtype="float32")).numpy()
    tb.read_rows(torch.tensor([1, 0]).numpy(), out)
    assert out.tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    tb.bag(torch.tensor([2, 3]).numpy(), torch.tensor([0, 2]).numpy(), out[:4])
    assert out[:4].tolist() == [8 + 12, 9 + 13, 10 + 14, 11 + 15]


def test_a_row_cache_serves_the_hot_rows_and_pools_as_torch(tmp_path):
    w = table(seed=3)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), mode="sum")
    emb = tiered(w, tmp_path, row_cache=256, row_cache_policy="lru")
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        # Half the lookups on 100 hot rows spread over the table.
        hot = torch.randint(0, 100, (200,), generator=g) * 29
        cold = torch.randint(0, ROWS, (200,), generator=g)
        idx = torch.cat([hot, cold])[torch.randperm(400, generator=g)]
        off = torch.arange(0, 400, 8)
        torch.testing.assert_close(emb(idx, off), ref(idx, off), **TOL)
    s = emb.stats()
    assert s["lookups"] == 2000
    assert s["cache_hits"] > 800, s  # the hot rows, after their first look
    assert 0 < s["cache_fills"] <= s["lookups"] - s["cache_hits"], s
    assert s["fast_hits"] >= s["cache_hits"]
    with pytest.raises(ValueError, match="row_cache"):
        tiered(w, tmp_path, row_cache=-1)
    with pytest.raises(strata.InvalidArgumentError, match="mru"):
        tiered(w, tmp_path, row_cache=8, row_cache_policy="mru")


def test_collection_shares_one_runtime_and_concatenates(tmp_path):
    shapes = [(200, 8), (500, 16), (64, 4)]
    ws = [table(seed=i, rows=n, dim=d) for i, (n, d) in enumerate(shapes)]
    coll = strata.nn.EmbeddingBagCollection(
        shapes,
        mode="sum",
        concat=True,
        weights=ws,
        fast_bytes=4 * PAGE,
        nvme_path=str(tmp_path),
        balance="manual",
        optimizer="sgd",
        lr=0.1,
    )
    assert all(t.runtime is coll.runtime for t in coll.tables)
    inputs = [torch.randint(0, n, (10, 3), generator=torch.Generator().manual_seed(i)) for i, (n, _) in enumerate(shapes)]
    out = coll(inputs)
    expect = torch.cat([torch.nn.functional.embedding_bag(x, w, mode="sum") for x, w in zip(inputs, ws)], 1)
    assert out.shape == (10, 28)
    torch.testing.assert_close(out, expect, **TOL)
    out.sum().backward()
    for t, x, w in zip(coll.tables, inputs, ws):
        counts = torch.bincount(x.reshape(-1), minlength=w.shape[0]).float()
        torch.testing.assert_close(t.weight, w - 0.1 * counts.unsqueeze(1), **TOL)
    assert coll.stats()["lookups"] == 90


def test_hot_rows_end_up_in_the_fast_tier(tmp_path):
    # 4096 rows of 16 floats: 64 pages; a fast tier of 8 pages.
    w = table(rows=4096)
    emb = tiered(w, tmp_path, fast_pages=8)
    per_page = PAGE // (DIM * 4)
    # One row in each of six pages that the initial write left below the
    # fast tier (the write may run in parallel: which pages land first
    # is not fixed).
    rows = [r * per_page + 3 for r in range(64)]
    hot = [r for r in rows if emb.tier_of(r) != "device"][-6:]
    assert len(hot) == 6 and sum(emb.tier_of(r) == "device" for r in rows) <= 8
    cold = torch.arange(0, 4096, 97)
    for _ in range(6):
        idx = torch.tensor(hot * 20 + cold.tolist())
        emb(idx, torch.tensor([0]))
        emb.balance()
    assert all(emb.tier_of(r) == "device" for r in hot)
    emb.reset_stats()
    idx = torch.tensor(hot * 10)
    out = emb(idx, torch.tensor([0]))
    s = emb.stats()
    assert s["lookups"] == 60 and s["hit_rate"] == 1.0
    torch.testing.assert_close(out[0], w[hot].sum(0) * 10, **TOL)


def test_bad_input_raises_before_any_work(tmp_path):
    w = table()
    emb = tiered(w, tmp_path, optimizer="sgd", lr=1.0)
    with pytest.raises(IndexError, match=f"index {ROWS} is out of range for an embedding table of {ROWS} rows"):
        emb(torch.tensor([1, ROWS]), torch.tensor([0]))
    with pytest.raises(IndexError, match="index -1 is out of range"):
        emb(torch.tensor([[1, -1]]))
    assert emb.stats()["lookups"] == 0
    with pytest.raises(ValueError, match="offsets must start at 0"):
        emb(torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="non-decreasing"):
        emb(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    # An offset past the indices is named as such, not as a decrease to the
    # end the caller never passed.
    with pytest.raises(ValueError, match="offsets run past the 3 indices .the largest is 5."):
        emb(torch.tensor([1, 2, 3]), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="offsets is required"):
        emb(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="integer tensor"):
        emb(torch.tensor([1.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match='only offered with mode="sum"'):
        strata.nn.EmbeddingBag(10, 4, mode="mean")(torch.tensor([[1]]), per_sample_weights=torch.ones(1, 1))
    with pytest.raises(ValueError, match="mode 'max' is not offered"):
        strata.nn.EmbeddingBag(10, 4, mode="max")
    torch.testing.assert_close(emb.weight, w)  # nothing was updated
    # The binding refuses directly too, before reading anything.
    t = emb._table
    out = torch.zeros(1, DIM)
    with pytest.raises(strata.InvalidArgumentError, match="last offset 1 is not the number of indices 2"):
        t.bag(torch.tensor([0, 1]).numpy(), torch.tensor([0, 1]).numpy(), out.numpy())
    with pytest.raises(strata.InvalidArgumentError, match="rows repeat"):
        t.sgd(torch.tensor([3, 3]).numpy(), torch.zeros(2, DIM).numpy(), 0.1)
    with pytest.raises(IndexError, match=f"index {ROWS + 5} is out of range"):
        t.sgd(torch.tensor([ROWS + 5]).numpy(), torch.zeros(1, DIM).numpy(), 0.1)


def test_bad_budgets_and_nvme_path_raise_strata_errors(tmp_path):
    with pytest.raises(strata.InvalidArgumentError, match="fast_bytes 100 must be an int of at least one page"):
        strata.nn.EmbeddingBag(1000, 16, fast_bytes=100, nvme_path=str(tmp_path))
    with pytest.raises(strata.InvalidArgumentError, match="nvme_path needs fast_bytes"):
        strata.nn.EmbeddingBag(1000, 16, nvme_path=str(tmp_path))
    with pytest.raises(strata.NotFoundError, match="does not exist"):
        strata.nn.EmbeddingBag(1000, 16, fast_bytes=PAGE, nvme_path=str(tmp_path / "no" / "such" / "dir"))
    # NVMe too small for what does not fit above: the allocation is refused.
    with pytest.raises(strata.OutOfCapacityError):
        strata.nn.EmbeddingBag(100_000, 16, fast_bytes=PAGE, nvme_path=str(tmp_path), nvme_bytes=2 * PAGE)
    for page in (0, 3000):
        with pytest.raises(strata.InvalidArgumentError, match="page_size"):
            strata.nn.EmbeddingBag(1000, 16, page_size=page)
    # An init function's rows are taken by value, whatever their float type;
    # rows of the wrong shape are refused by name.
    rows = torch.arange(40, dtype=torch.float64).reshape(10, 4)
    emb = strata.nn.EmbeddingBag(10, 4, init=lambda a, b: rows[a:b])
    torch.testing.assert_close(emb.weight, rows.float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"init\(0, 10\) gave \(10, 3\)"):
        strata.nn.EmbeddingBag(10, 4, init=lambda a, b: torch.zeros(b - a, 3))


def test_frozen_from_pretrained_never_changes(tmp_path):
    w = table()
    emb = strata.nn.EmbeddingBag.from_pretrained(w, mode="sum", optimizer="sgd", lr=1.0)
    x = torch.tensor([[1, 2, 3]])
    psw = torch.ones(1, 3, requires_grad=True)
    emb(x, per_sample_weights=psw).sum().backward()
    assert psw.grad is not None and emb.grad is None
    torch.testing.assert_close(emb.weight, w)


def test_binding_maps_each_refusal_of_the_table_to_its_exception():
    emb = strata.nn.EmbeddingBag(100, 4, mode="sum")
    t = emb._table
    before = emb.weight.clone()
    with pytest.raises(IndexError, match="rows 99..101 are out of range for an embedding table of 100 rows"):
        t.write_rows(99, torch.zeros(2, 4).numpy())
    with pytest.raises(strata.InvalidArgumentError, match="weights holds 1 values, not 2"):
        t.bag(torch.tensor([0, 1]).numpy(), torch.tensor([0, 2]).numpy(), torch.zeros(1, 4).numpy(),
              weights=torch.ones(1).numpy())
    with pytest.raises(strata.InvalidArgumentError, match="out holds 4 values, not 8"):
        t.bag(torch.tensor([0, 1]).numpy(), torch.tensor([0, 1, 2]).numpy(), torch.zeros(1, 4).numpy())
    with pytest.raises(strata.InvalidArgumentError, match="state holds 3 values, not 100"):
        t.rowwise_adagrad(torch.tensor([1]).numpy(), torch.zeros(1, 4).numpy(), torch.zeros(3).numpy(), 0.1, 1e-8)
    with pytest.raises(strata.InvalidArgumentError, match="lr NaN is not a finite number"):
        t.sgd(torch.tensor([1]).numpy(), torch.zeros(1, 4).numpy(), float("nan"))
    with pytest.raises(IndexError, match="index 100 is out of range"):
        t.tier_of_row(100)
    with pytest.raises(strata.InvalidArgumentError, match="threads 0 is not in 1..=1024"):
        strata.nn.RowTable(emb.runtime, 10, 4, threads=0)
    # Arrays of another element type are refused by name, not read as
    # float32 or int64 bytes.
    import numpy as np

    with pytest.raises(TypeError, match='data holds elements of format "d"; it must be float32'):
        t.write_rows(0, np.ones((1, 4)))
    with pytest.raises(TypeError, match="indices .* must be int64"):
        t.read_rows(np.array([0, 0, 1, 0], np.int32), np.zeros((2, 4), np.float32))
    with pytest.raises(TypeError, match="out .* must be float32"):
        t.read_rows(np.array([0]), np.zeros((1, 4)))
    with pytest.raises(TypeError, match="weights .* must be float32"):
        t.bag(np.array([2, 3]), np.array([0, 2]), np.zeros((1, 4), np.float32), weights=np.ones(1))
    assert t.stats()["lookups"] == 0
    torch.testing.assert_close(emb.weight, before)
    # An empty batch gives no rows, as torch's does.
    out = emb(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    assert out.shape == (0, 4)
    t.read_rows(np.zeros(0, np.int64), np.zeros((0, 4), np.float32))


def test_weights_gradient_uses_the_rows_the_forward_pooled(tmp_path):
    """The table pooled twice in one graph, trained by sgd: the weights'
    gradients are torch's, though the later backward updates the rows
    before the earlier one runs."""
    w = table(seed=8)
    ours = tiered(w, tmp_path, optimizer="sgd", lr=1.0)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum")
    idx, off = bags(seed=9)
    grads = []
    for m in (ours, ref):
        p1 = torch.rand(idx.numel(), generator=torch.Generator().manual_seed(1)).requires_grad_()
        p2 = p1.detach().clone().requires_grad_()
        (m(idx, off, p1) + 2 * m(idx, off, p2)).pow(2).sum().backward()
        grads.append((p1.grad, p2.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(ours.weight, w - ref.weight.grad, **TOL)


def test_requires_grad_false_freezes_the_table(tmp_path):
    w = table(seed=10)
    emb = tiered(w, tmp_path, optimizer="sgd", lr=0.5)
    idx, off = bags(seed=11)
    assert emb.requires_grad_(False) is emb
    psw = torch.rand(idx.numel(), requires_grad=True)
    emb(idx, off, psw).sum().backward()
    assert torch.equal(emb.weight, w) and emb.grad is None
    assert psw.grad is not None  # the rest of the graph still differentiates
    emb.requires_grad_(True)
    emb(idx, off).sum().backward()
    assert not torch.equal(emb.weight, w)
    # A collection freezes every table.
    coll = strata.nn.EmbeddingBagCollection([(50, 4), (60, 4)], optimizer="sgd", lr=0.5)
    before = [t.weight for t in coll.tables]
    coll.requires_grad_(False)
    x = [torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6], [7, 8]])]
    sum(o.sum() for o in coll(x)).requires_grad_().backward()
    assert all(torch.equal(t.weight, b) for t, b in zip(coll.tables, before))


def test_state_dicts_load_between_torch_and_strata(tmp_path):
    """torch's EmbeddingBag saves only "weight": a table without an
    optimizer (or with sgd) saves the same keys, each loads the other's, and
    rowwise_adagrad's accumulators start at zero from torch's dict."""
    w = table(seed=12)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum")
    for optimizer in (None, "sgd"):
        ours = tiered(table(seed=13), tmp_path / str(optimizer), optimizer=optimizer)
        assert set(ours.state_dict()) == {"weight"}
        ours.load_state_dict(ref.state_dict())
        assert torch.equal(ours.weight, w)
        back = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
        back.load_state_dict(ours.state_dict())
        assert torch.equal(back.weight, w)
    ada = tiered(table(seed=14), tmp_path / "ada", optimizer="rowwise_adagrad", lr=0.1)
    idx, off = bags(seed=15)
    ada(idx, off).sum().backward()
    assert float(ada.momentum.abs().sum()) > 0
    ada.load_state_dict(ref.state_dict())
    assert torch.equal(ada.weight, w) and float(ada.momentum.abs().sum()) == 0
    # The empty accumulators earlier versions saved for every optimizer load.
    plain = tiered(table(seed=13), tmp_path / "plain")
    plain.load_state_dict({"weight": w, "momentum": torch.zeros(0)})
    assert torch.equal(plain.weight, w)


def test_moving_or_casting_the_module_keeps_training(tmp_path):
    """.half() and .to() leave the table and its accumulators float32 on
    the CPU: backward after them trains as before."""
    w = table(seed=16)
    a = tiered(w, tmp_path / "a", optimizer="rowwise_adagrad", lr=0.05)
    b = tiered(w, tmp_path / "b", optimizer="rowwise_adagrad", lr=0.05)
    b.half().to(torch.float64).to("cpu")
    assert b.momentum.dtype == torch.float32
    for seed in (17, 18):
        idx, off = bags(seed=seed)
        for m in (a, b):
            (m(idx, off) ** 2).sum().backward()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.momentum, b.momentum)


def test_offsets_as_torch_reads_them(tmp_path):
    """include_last_offset with indices past the last offset pools up to
    it, as torch does; empty offsets are no bags."""
    w = table(seed=19)
    ours = tiered(w, tmp_path)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), mode="sum", include_last_offset=True)
    ilo = tiered(w, tmp_path / "ilo", include_last_offset=True)
    idx, off = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 3])
    psw = torch.rand(5)
    torch.testing.assert_close(ilo(idx, off, psw), ref(idx, off, psw), **TOL)
    plain = torch.nn.EmbeddingBag.from_pretrained(w.clone(), mode="sum")
    empty = torch.zeros(0, dtype=torch.int64)
    assert ours(idx, empty).shape == plain(idx, empty).shape == (0, DIM)


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_only_a_pass_that_wants_the_tables_gradient_changes_it(optimizer, tmp_path):
    """torch.autograd.grad for the weights alone, and backward(inputs=...)
    without the table, leave the table (and grad) alone; the next full
    backward applies its own update once, as torch's EmbeddingBag with SGD."""
    w = table(seed=20)
    ours = tiered(w, tmp_path, optimizer=optimizer, lr=1.0)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum")
    idx, off = bags(seed=21)
    psw = torch.rand(idx.numel(), requires_grad=True)
    (g,) = torch.autograd.grad(ours(idx, off, psw).pow(2).sum(), [psw])
    (r,) = torch.autograd.grad(ref(idx, off, psw).pow(2).sum(), [psw])
    torch.testing.assert_close(g, r, **TOL)
    ours(idx, off, psw).pow(2).sum().backward(inputs=[psw])
    assert torch.equal(ours.weight, w) and ours.grad is None
    ours(idx, off).pow(2).sum().backward()
    ref(idx, off).pow(2).sum().backward()
    if optimizer is None:
        torch.testing.assert_close(ours.grad.to_dense(), ref.weight.grad, **TOL)
    else:
        torch.testing.assert_close(ours.weight, w - ref.weight.grad, **TOL)
