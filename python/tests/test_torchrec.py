"""strata.nn.EmbeddingBagCollection in TorchRec's shape: EmbeddingBagConfigs
in, a KeyedJaggedTensor in, a KeyedTensor out, outputs and gradients equal
to torchrec.EmbeddingBagCollection's for the same weights, TorchRec's DLRM
built over it, clear errors naming the feature, and the table- and
row-wise sharded collection (two gloo processes) against one process.

Skipped, with the reason printed, where TorchRec is not installed (it pins
its own torch; tests/run.sh installs it with STRATA_TORCHREC=1); with
STRATA_REQUIRE_TORCHREC=1 (CI) a missing TorchRec is a failure."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("STRATA_REQUIRE_TORCHREC") == "1":
    import torchrec  # noqa: F401  (must be there)
else:
    torchrec = pytest.importorskip(
        "torchrec", reason="TorchRec is not installed (tests/run.sh installs it with STRATA_TORCHREC=1)"
    )

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

import strata
import strata.nn

sys.path.insert(0, str(Path(__file__).parent))
import ebc_worker  # noqa: E402  (the collection and batches the workers use)

TOL = dict(rtol=1e-5, atol=1e-6)


def _pair(weighted=False, **kw):
    cfgs = ebc_worker.configs()
    if weighted:
        # Weighted pooling is a sum.
        cfgs[1] = EmbeddingBagConfig(num_embeddings=25, embedding_dim=4, name="t1", feature_names=["c"])
    ref = torchrec.EmbeddingBagCollection(tables=cfgs, is_weighted=weighted, device=torch.device("cpu"))
    ours = strata.nn.EmbeddingBagCollection(
        cfgs, is_weighted=weighted, weights=[ref.embedding_bags[c.name].weight.detach() for c in cfgs], **kw
    )
    return cfgs, ref, ours


def _weighted(kjt):
    g = torch.Generator().manual_seed(9)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
        weights=torch.rand(kjt.values().numel(), generator=g),
    )


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("tiered", [False, True])
def test_outputs_and_gradients_equal_torchrecs(weighted, tiered, tmp_path):
    # tiered: one page of fast tier, the rest on NVMe (the tables then
    # gather at once, on threads of their own).
    kw = dict(fast_bytes=4096, nvme_path=str(tmp_path)) if tiered else {}
    cfgs, ref, ours = _pair(weighted, **kw)
    if tiered:
        assert "nvme" in ours.runtime.tiers
    kjt, mix = ebc_worker.batch(0)
    if weighted:
        kjt = _weighted(kjt)
    a, b = ref(kjt), ours(kjt)
    assert isinstance(b, KeyedTensor)
    assert b.keys() == a.keys() == ebc_worker.FEATURES
    assert b.length_per_key() == a.length_per_key()
    torch.testing.assert_close(b.values(), a.values(), **TOL)
    (a.values() * mix).sum().backward()
    (b.values() * mix).sum().backward()
    for k, c in enumerate(cfgs):
        torch.testing.assert_close(ours.tables[k].grad.to_dense(), ref.embedding_bags[c.name].weight.grad, **TOL)


def test_default_rows_are_torchrecs_uniform_range():
    cfg = EmbeddingBagConfig(num_embeddings=400, embedding_dim=8, name="t", feature_names=["f"])
    w = strata.nn.EmbeddingBagCollection([cfg]).tables[0].weight
    bound = (1.0 / 400) ** 0.5
    assert float(w.min()) >= -bound and float(w.max()) <= bound
    assert float(w.std()) > bound / 3  # not all zeros


def test_initial_rows_are_the_same_however_drawn():
    cfg = EmbeddingBagConfig(num_embeddings=40_000, embedding_dim=4, name="t", feature_names=["f"])
    b = (1.0 / 40_000) ** 0.5
    whole = strata.nn.initial_rows(5, 0, 4, 0, 40_000, -b, b)
    assert torch.equal(strata.nn.EmbeddingBagCollection([cfg], seed=5).tables[0].weight, whole)
    assert torch.equal(strata.nn.initial_rows(5, 0, 4, 20_000, 40_000, -b, b), whole[20_000:])
    assert not torch.equal(strata.nn.initial_rows(5, 1, 4, 0, 40_000, -b, b), whole)


def test_drops_into_torchrecs_dlrm_and_trains():
    from torchrec.models.dlrm import DLRM

    cfgs = [EmbeddingBagConfig(num_embeddings=40, embedding_dim=4, name=f"t{k}", feature_names=[f])
            for k, f in enumerate(ebc_worker.FEATURES)]
    ebc = strata.nn.EmbeddingBagCollection(cfgs, optimizer="rowwise_adagrad", lr=0.05)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=5,
                 dense_arch_layer_sizes=[16, 4], over_arch_layer_sizes=[8, 1])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(8, 5, generator=g)
    target = torch.randint(0, 2, (8, 1), generator=g).float()
    kjt, _ = ebc_worker.batch(1)
    before = ebc.tables[0].weight.clone()
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(before, ebc.tables[0].weight)  # the tables trained too


def test_bad_input_names_the_feature_and_changes_nothing():
    _, _, ours = _pair(optimizer="sgd", lr=0.1)
    before = [t.weight.clone() for t in ours.tables]
    kjt, _ = ebc_worker.batch(0)
    keys, vals, lens = kjt.keys(), kjt.values().clone(), kjt.lengths()
    # An id out of range.
    bad = vals.clone()
    bad[-1] = 7
    with pytest.raises(IndexError, match="feature 'd'.*id 7"):
        ours(KeyedJaggedTensor.from_lengths_sync(keys=keys, values=bad, lengths=lens))
    # A negative offset (a bag of negative length).
    off = kjt.offsets().clone()
    off[3] = -1
    with pytest.raises(ValueError, match="feature 'a'"):
        ours(KeyedJaggedTensor.from_offsets_sync(keys=keys, values=vals, offsets=off))
    # Keys that do not match the configs.
    with pytest.raises(ValueError, match="no feature 'd'"):
        ours(KeyedJaggedTensor.from_lengths_sync(keys=keys[:3], values=vals[: int(lens[:24].sum())], lengths=lens[:24]))
    with pytest.raises(ValueError, match="no feature 'd'"):
        ours(KeyedJaggedTensor.from_lengths_sync(keys=keys[:3] + ["z"], values=vals, lengths=lens))
    # A feature given twice (its first ids would be dropped).
    with pytest.raises(ValueError, match="feature 'a' appears 2 times"):
        ours(KeyedJaggedTensor.from_lengths_sync(keys=["a"] + keys[1:3] + ["a"], values=vals, lengths=lens))
    for t, w in zip(ours.tables, before):
        assert torch.equal(t.weight, w)
    # A table too large for the tiers it is given.
    rt = strata.Runtime(device=None, host_capacity=1 << 16, page_size=4096)
    big = EmbeddingBagConfig(num_embeddings=100_000, embedding_dim=16, name="huge", feature_names=["h"])
    with pytest.raises(strata.OutOfCapacityError, match="table 'huge'"):
        strata.nn.EmbeddingBagCollection([big], runtime=rt)
    # Mean pooling with weights, and a KJT given to a collection of pairs.
    with pytest.raises(ValueError, match="weighted"):
        strata.nn.EmbeddingBagCollection(ebc_worker.configs(), is_weighted=True)
    with pytest.raises(TypeError, match="EmbeddingBagConfigs"):
        strata.nn.EmbeddingBagCollection([(10, 4)])(kjt)


def _run_ranks(tmp_path, sharding, world=2):
    out = tmp_path / sharding
    rendezvous = tmp_path / f"{sharding}.rendezvous"
    script = Path(__file__).with_name("ebc_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(rendezvous), str(out), sharding],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} ({sharding}) failed:\n{log}"
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("sharding", ["table", "row"])
def test_sharded_collection_matches_one_process(tmp_path, sharding):
    single = ebc_worker.collection()
    outs = ebc_worker.train(single)
    ranks = _run_ranks(tmp_path, sharding)
    per = ebc_worker.BATCH // len(ranks)
    for step, whole in enumerate(outs):
        got = torch.cat([r["outs"][step] for r in ranks])
        torch.testing.assert_close(got, whole, **TOL)
    # Every row of every table, from the rank that owns it, as trained in one process.
    for k, t in enumerate(single.tables):
        rows = torch.full_like(t.weight, float("nan"))
        for r in ranks:
            if k in r["shards"]:
                lo, w = r["shards"][k]
                rows[lo : lo + w.shape[0]] = w
        torch.testing.assert_close(rows, t.weight, **TOL)
    # Rows drawn by each rank for its shards are the one process's rows.
    drawn = strata.nn.EmbeddingBagCollection(ebc_worker.configs(), seed=7)
    for k, t in enumerate(drawn.tables):
        rows = torch.cat([r["initial"][k] for r in ranks if k in r["initial"]])
        assert torch.equal(rows, t.weight)
    if sharding == "table":
        # Each table lives on one rank: table k on rank k % 2.
        assert sorted(ranks[0]["shards"]) == [0, 2] and sorted(ranks[1]["shards"]) == [1]
    else:
        assert all(sorted(r["shards"]) == [0, 1, 2] for r in ranks)
    del per


def test_weighted_batches_get_torchrecs_weight_gradient_and_init_fn_is_used():
    cfgs, ref, ours = _pair(weighted=True)
    kjt, mix = ebc_worker.batch(0)
    wk = _weighted(kjt)
    got = []
    for m in (ref, ours):
        w = wk.weights().detach().clone().requires_grad_()
        # A feature no table serves rides along, as TorchRec allows.
        batch = KeyedJaggedTensor.from_lengths_sync(
            keys=wk.keys() + ["unserved"],
            values=torch.cat([wk.values(), torch.full((int(wk.stride()),), 3)]),
            lengths=torch.cat([wk.lengths(), torch.ones(int(wk.stride()), dtype=torch.int64)]),
            weights=torch.cat([w, torch.ones(int(wk.stride()))]),
        )
        (m(batch).values() * mix).sum().backward()
        got.append(w.grad)
    torch.testing.assert_close(got[1], got[0], **TOL)
    # A config's own init_fn fills its table (TorchRec's default keeps the
    # seeded draw: test_initial_rows_are_the_same_however_drawn).
    cfg = EmbeddingBagConfig(num_embeddings=300, embedding_dim=4, name="z", feature_names=["f"],
                             init_fn=torch.nn.init.ones_)
    assert torch.equal(strata.nn.EmbeddingBagCollection([cfg]).tables[0].weight, torch.ones(300, 4))


def test_state_dicts_load_between_torchrec_and_strata():
    cfgs, ref, ours = _pair()
    assert set(ours.state_dict()) == set(ref.state_dict())
    fresh = torchrec.EmbeddingBagCollection(tables=ebc_worker.configs(), device=torch.device("cpu"))
    fresh.load_state_dict(ours.state_dict())
    mine = strata.nn.EmbeddingBagCollection(ebc_worker.configs(), seed=3)
    mine.load_state_dict(ref.state_dict())
    for c in cfgs:
        assert torch.equal(fresh.embedding_bags[c.name].weight, ref.embedding_bags[c.name].weight)
    for k, c in enumerate(cfgs):
        assert torch.equal(mine.tables[k].weight, ref.embedding_bags[c.name].weight.detach())
    # Inside a model, under its prefix; and the names of earlier versions.
    outer = torch.nn.ModuleDict({"ebc": strata.nn.EmbeddingBagCollection(ebc_worker.configs(), seed=4)})
    outer.load_state_dict({f"ebc.{k}": v for k, v in ref.state_dict().items()})
    old = {f"tables.{k}.weight": ref.embedding_bags[c.name].weight.detach() for k, c in enumerate(cfgs)}
    again = strata.nn.EmbeddingBagCollection(ebc_worker.configs(), seed=5)
    again.load_state_dict(old)
    for k, c in enumerate(cfgs):
        assert torch.equal(outer["ebc"].tables[k].weight, again.tables[k].weight)
