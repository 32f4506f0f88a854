"""One rank of test_torchrec.py's sharded-collection tests (gloo, CPU).

    python ebc_worker.py RANK WORLD RENDEZVOUS_FILE OUT_PREFIX SHARDING

Builds the tests' collection sharded by SHARDING ("table" or "row") with
the shared initial weights, trains it for STEPS steps on this rank's half
of each global batch (a fixed linear loss, fused row-wise Adagrad), and
saves this rank's outputs and its shards' final rows to OUT_PREFIX.RANK."""

import os
import sys

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import strata.nn

STEPS = 4
BATCH = 8
FEATURES = ["a", "b", "c", "d"]


def configs():
    return [
        EmbeddingBagConfig(num_embeddings=40, embedding_dim=4, name="t0", feature_names=["a", "b"]),
        EmbeddingBagConfig(num_embeddings=25, embedding_dim=4, name="t1", feature_names=["c"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t2", feature_names=["d"]),
    ]


def weights():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(c.num_embeddings, c.embedding_dim, generator=g) for c in configs()]


def batch(step, lo=0, hi=BATCH):
    """Global batch `step`, samples [lo, hi): a KJT and the loss's weights."""
    g = torch.Generator().manual_seed(100 + step)
    rows = {"a": 40, "b": 40, "c": 25, "d": 7}
    lengths = {f: torch.randint(0, 4, (BATCH,), generator=g) for f in FEATURES}
    ids = {f: torch.randint(0, rows[f], (int(lengths[f].sum()),), generator=g) for f in FEATURES}
    mix = torch.randn(BATCH, 16, generator=g)
    vals, lens = [], []
    for f in FEATURES:
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[f].cumsum(0)])
        vals.append(ids[f][off[lo] : off[hi]])
        lens.append(lengths[f][lo:hi])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=torch.cat(vals), lengths=torch.cat(lens))
    return kjt, mix[lo:hi]


def collection(**kw):
    return strata.nn.EmbeddingBagCollection(
        configs(), weights=weights(), optimizer="rowwise_adagrad", lr=0.1, **kw
    )


def train(ebc, lo=0, hi=BATCH, world=1):
    """STEPS steps of samples [lo, hi) of each batch; each rank's loss is
    its share times world, so the ranks' averaged gradient is the one
    process's."""
    outs = []
    for step in range(STEPS):
        kjt, mix = batch(step, lo, hi)
        out = ebc(kjt).values()
        outs.append(out.detach().clone())
        ((out * mix).sum() * world).backward()
    return outs


def main() -> None:
    rank, world, rendezvous, out, sharding = sys.argv[1:6]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    ebc = collection(sharding=sharding)
    per = BATCH // world
    outs = train(ebc, rank * per, (rank + 1) * per, world)
    shards = {}
    for k, _ in ebc._shard.local_tables():
        lo, hi = ebc._shard._rows_on(k, rank)
        shards[k] = (lo, ebc.tables[ebc._shard.module_of[k]].weight)
    # Drawn here, not given: the same initial rows as in one process.
    drawn = strata.nn.EmbeddingBagCollection(configs(), seed=7, sharding=sharding)
    initial = {k: drawn.tables[drawn._shard.module_of[k]].weight for k, _ in drawn._shard.local_tables()}
    torch.save({"outs": outs, "shards": shards, "initial": initial, "stats": ebc.stats()}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
