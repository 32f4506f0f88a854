"""One rank of test_optim_modes.py's torch.distributed tests (gloo, CPU).

    python ddp_worker.py RANK WORLD RENDEZVOUS_FILE OUT_FILE MODE

MODE: "ddp" (each rank steps its own whole copy), "shard" (ZeRO-1-style
shard=True), "shard-importance" or "fsdp2" (the model under FSDP2's
fully_shard: each rank steps its local shards of DTensor parameters). Trains the tests' model under DDP on
this rank's share of each global batch, then rank 0 saves the parameters
and the (collective) state_dict to OUT_FILE."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import strata.optim

STEPS = 6
BATCH = 16


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batches(steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(steps)]


def main() -> None:
    rank, world, rendezvous, out, mode = sys.argv[1:6]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        m = model()
        for layer in m:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(m)
    else:
        m = DistributedDataParallel(model())
    kw = dict(lr=1e-2, weight_decay=0.05)
    if mode.startswith("shard"):
        kw["shard"] = True
    if mode.endswith("importance"):
        kw["importance"] = (0.25, 3)
    opt = strata.optim.AdamW(m.parameters(), **kw)
    per = BATCH // world
    for x, y in batches():
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad()
        ((m(xs) - ys) ** 2).mean().backward()  # DDP and FSDP2 average over ranks
        opt.step()
    state = opt.state_dict()  # collective in shard mode
    if mode == "fsdp2":
        # The shards put together (collectives, on every rank).
        params = [p.full_tensor().detach().clone() for p in m.parameters()]
        for st in state["state"].values():
            for key in ("exp_avg", "exp_avg_sq"):
                st[key] = st[key].full_tensor()
    else:
        params = [p.detach().clone() for p in m.module.parameters()]
    if rank == 0:
        torch.save({"params": params, "state": state}, out)
    dist.barrier()
    del opt, m
    dist.destroy_process_group()
    # Skip the interpreter's teardown: gloo's worker threads can still be
    # alive there and abort the process (std::terminate) after every result
    # is saved, a torch shutdown race that says nothing about the optimizer.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
