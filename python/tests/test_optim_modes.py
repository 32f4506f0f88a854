"""strata.optim's modes beyond plain Adam: importance-aware steps against
their definition, exact resume mid-window, torch.compile'd models, shape
changes and unusable paths, and torch.distributed (DDP and shard=True, two
gloo processes) against single-process training.

Skipped, with the reason printed, where torch is not installed; with
STRATA_REQUIRE_TORCH=1 (CI) a missing torch is a failure instead."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("STRATA_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401  (must be there)
else:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (tests/run.sh installs it unless STRATA_NO_TORCH=1)"
    )

import strata
import strata.optim

sys.path.insert(0, str(Path(__file__).parent))
import ddp_worker  # noqa: E402  (the model and batches the workers use)

TOL = dict(rtol=1e-5, atol=1e-6)


class ReferenceImportance:
    """The importance-aware mode as strata's docs define it, in plain
    torch, for parameters of one chunk each: every `every` steps (and at
    the first) a flush updates every element once (resident ones with this
    step's gradient, the others with the mean of the gradients they
    accumulated over the window) and picks the `fraction` of elements with
    the largest |g| (at least one; ties at the threshold kept) as the next
    window's resident set; between flushes only those update."""

    def __init__(self, params, lr, betas, eps, weight_decay, fraction, every):
        self.params = list(params)
        self.lr, self.eps, self.wd = (torch.tensor(x, dtype=torch.float32) for x in (lr, eps, weight_decay))
        self.b1, self.b2 = (torch.tensor(b, dtype=torch.float32) for b in betas)
        self.fraction, self.every = fraction, every
        self.t = 0
        self.deferred = 0
        self.state = {
            p: dict(
                m=torch.zeros(p.numel()),
                v=torch.zeros(p.numel()),
                acc=torch.zeros(p.numel()),
                resident=None,
            )
            for p in self.params
        }

    def _update(self, w, m, v, g, bc1, bc2):
        m.copy_(self.b1 * m + (1 - self.b1) * g)
        v.copy_(self.b2 * v + (1 - self.b2) * (g * g))
        step = torch.tensor(float(self.lr) / float(bc1), dtype=torch.float32)
        rs = torch.tensor(1.0 / math.sqrt(float(bc2)), dtype=torch.float32)
        w.sub_(step * (m / (v.sqrt() * rs + self.eps)) + (self.lr * self.wd) * w)

    @torch.no_grad()
    def step(self):
        self.t += 1
        self.deferred += 1
        bc1 = torch.tensor(1 - float(self.b1) ** self.t, dtype=torch.float32)
        bc2 = torch.tensor(1 - float(self.b2) ** self.t, dtype=torch.float32)
        flush = self.state[self.params[0]]["resident"] is None or self.deferred >= self.every
        for p in self.params:
            st, w, g = self.state[p], p.view(-1), p.grad.view(-1)
            r = st["resident"]
            if flush:
                eff = (st["acc"] + g) / self.deferred
                if r is not None:
                    eff[r] = g[r]
                self._update(w, st["m"], st["v"], eff, bc1, bc2)
                st["acc"].zero_()
                n = g.numel()
                keep = min(n, max(1, math.ceil(n * self.fraction)))
                if keep >= n:
                    st["resident"] = torch.ones(n, dtype=torch.bool)
                else:
                    threshold = g.abs().kthvalue(n - keep + 1).values
                    st["resident"] = g.abs() >= threshold
            else:
                wr, mr, vr = w[r], st["m"][r], st["v"][r]
                self._update(wr, mr, vr, g[r], bc1, bc2)
                w[r], st["m"][r], st["v"][r] = wr, mr, vr
                st["acc"][~r] += g[~r]
        if flush:
            self.deferred = 0

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def train(m, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()


def assert_same_params(a, b, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=lambda msg: f"{name}: {msg}", **(tol or TOL))


@pytest.mark.parametrize("fraction,every", [(0.25, 3), (0.1, 4), (1.0, 2)])
def test_importance_mode_matches_its_definition(fraction, every):
    a, b = ddp_worker.model(), ddp_worker.model()
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    ref = ReferenceImportance(a.parameters(), fraction=fraction, every=every, **hyper)
    ours = strata.optim.AdamW(b.parameters(), importance=(fraction, every), **hyper)
    data = ddp_worker.batches(10)
    for k in range(len(data)):
        train(a, ref, data[k : k + 1])
        train(b, ours, data[k : k + 1])
        assert_same_params(a, b)
    # The moments too, as state_dict reads them back (resident ones merged).
    st = ours.state_dict()["state"]
    for i, p in enumerate(a.parameters()):
        torch.testing.assert_close(st[i]["exp_avg"].view(-1), ref.state[p]["m"], **TOL)
        torch.testing.assert_close(st[i]["exp_avg_sq"].view(-1), ref.state[p]["v"], **TOL)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_importance_mode_resumes_exactly_mid_window(tier, tmp_path):
    kw = dict(lr=1e-2, weight_decay=0.05, importance=(0.25, 4), tier=tier)
    if tier == "nvme":
        kw["nvme_path"] = str(tmp_path)
    data = ddp_worker.batches(12)
    a = ddp_worker.model()
    oa = strata.optim.AdamW(a.parameters(), **kw)
    train(a, oa, data[:6])  # flushes at 1 and 5: step 6 is inside a window
    saved = torch.load(_save(oa.state_dict(), tmp_path), weights_only=True)
    b = ddp_worker.model()
    with torch.no_grad():
        for p, q in zip(b.parameters(), a.parameters()):
            p.copy_(q)
    ob = strata.optim.AdamW(b.parameters(), **kw)
    ob.load_state_dict(saved)
    train(a, oa, data[6:])
    train(b, ob, data[6:])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    # Plain torch AdamW takes the same state dict (extra keys ignored).
    torch.optim.AdamW(ddp_worker.model().parameters()).load_state_dict(saved)


def _save(state, tmp_path):
    path = tmp_path / "optimizer.pt"
    torch.save(state, path)
    return path


def test_importance_mode_with_weights_changed_mid_window():
    a, b = ddp_worker.model(), ddp_worker.model()
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref = ReferenceImportance(a.parameters(), fraction=0.25, every=3, **hyper)
    ours = strata.optim.AdamW(b.parameters(), importance=(0.25, 3), **hyper)
    data = ddp_worker.batches(6)
    train(a, ref, data[:2])
    train(b, ours, data[:2])
    with torch.no_grad():
        for m in (a, b):
            m[0].weight.mul_(0.5)
    train(a, ref, data[2:])
    train(b, ours, data[2:])
    assert_same_params(a, b)


def test_compiled_model():
    # aot_eager: dynamo's graph capture and AOTAutograd's joint graph, as
    # torch.compile's default does, without generating C++ (slow on CI).
    a, b = ddp_worker.model(), ddp_worker.model()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    sb = strata.optim.AdamW(b.parameters(), lr=1e-2)
    ca = torch.compile(a, backend="aot_eager")
    cb = torch.compile(b, backend="aot_eager")
    data = ddp_worker.batches(5)
    train(ca, ta, data)
    train(cb, sb, data)
    assert_same_params(a, b)


def test_bad_input_leaves_the_state_readable(tmp_path):
    m = ddp_worker.model()
    opt = strata.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, opt, ddp_worker.batches(2))
    before = opt.state_dict()
    # A parameter that changed shape between steps.
    w = m[0].weight
    with torch.no_grad():
        w.set_(torch.zeros(16, 8))
    w.grad = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="may not change shape"):
        opt.step()
    after = opt.state_dict()
    for k in before["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(before["state"][k][key], after["state"][k][key])
    # Hyper-parameters and paths.
    for bad in ((0.0, 2), (1.5, 2), (0.5, 0), (0.5, 1.5), "half"):
        with pytest.raises(ValueError, match="importance"):
            strata.optim.AdamW(m.parameters(), importance=bad)
    with pytest.raises(RuntimeError, match="init_process_group"):
        strata.optim.AdamW(m.parameters(), shard=True)
    # A state directory that is not there is refused at construction.
    missing = tmp_path / "no" / "such" / "dir"
    m2 = ddp_worker.model()
    with pytest.raises(strata.NotFoundError, match="no/such"):
        strata.optim.AdamW(m2.parameters(), tier="nvme", nvme_path=str(missing))
    with pytest.raises(FileNotFoundError):
        strata.optim.AdamW(m2.parameters(), tier="nvme", nvme_path=str(missing))
    with pytest.raises(ValueError, match="tier 'tape'"):
        strata.optim.AdamW(m2.parameters(), tier="tape")


def _run_ranks(tmp_path, mode, world=2):
    out = tmp_path / f"{mode}.pt"
    rendezvous = tmp_path / f"{mode}.rendezvous"
    script = Path(__file__).with_name("ddp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(rendezvous), str(out), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} ({mode}) failed:\n{log}"
    return torch.load(out, weights_only=True)


def test_distributed_ddp_and_shard_equal_single_process(tmp_path):
    # Single process, whole batches: the gradient DDP averages.
    single = ddp_worker.model()
    opt = strata.optim.AdamW(single.parameters(), lr=1e-2, weight_decay=0.05)
    train(single, opt, ddp_worker.batches())
    ddp = _run_ranks(tmp_path, "ddp")
    shard = _run_ranks(tmp_path, "shard")
    for p, q, r in zip(single.parameters(), ddp["params"], shard["params"]):
        # DDP's all-reduce sums in another order: a few rounding steps.
        torch.testing.assert_close(p, q, **TOL)
        # Sharding changes only where each element's update runs.
        assert torch.equal(q, r)
    # The sharded state_dict is whole and equal to the unsharded one.
    for k, st in ddp["state"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], shard["state"]["state"][k][key])
        assert float(st["step"]) == float(shard["state"]["state"][k]["step"]) == ddp_worker.STEPS
    # It loads into a single-process optimizer, which continues as one.
    resumed = ddp_worker.model()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), shard["params"]):
            p.copy_(q)
    o2 = strata.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.05)
    o2.load_state_dict(shard["state"])
    more = ddp_worker.batches(3, seed=5)
    train(resumed, o2, more)
    train(single, opt, more)
    assert_same_params(single, resumed)


def test_fsdp2_steps_each_ranks_shards_as_single_process_training(tmp_path):
    # Single process, whole batches: the gradient FSDP2's reduce-scatter
    # averages over the ranks' halves.
    single = ddp_worker.model()
    opt = strata.optim.AdamW(single.parameters(), lr=1e-2, weight_decay=0.05)
    train(single, opt, ddp_worker.batches())
    fsdp = _run_ranks(tmp_path, "fsdp2")
    for p, q in zip(single.parameters(), fsdp["params"]):
        torch.testing.assert_close(p, q, **TOL)
    # The states, put together from the ranks' DTensor shards, are the
    # single process's.
    whole = opt.state_dict()["state"]
    for k, st in fsdp["state"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[key], whole[k][key], **TOL)
        assert float(st["step"]) == ddp_worker.STEPS


def test_distributed_shard_with_importance(tmp_path):
    got = _run_ranks(tmp_path, "shard-importance")
    st = got["state"]["state"]
    assert len(st) == 4
    for k, p in enumerate(got["params"]):
        assert st[k]["importance_resident"].shape == p.shape
        assert st[k]["importance_resident"].any()
        assert torch.isfinite(p).all()


def test_importance_state_dict_before_any_step_and_mismatched_windows():
    # Loaded from plain AdamW (no window yet), saved again before a step.
    a = ddp_worker.model()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2)
    train(a, ta, ddp_worker.batches(2))
    opt = strata.optim.AdamW(a.parameters(), lr=1e-2, importance=(0.25, 4))
    opt.load_state_dict(ta.state_dict())
    st = opt.state_dict()["state"]
    assert all(not s["importance_started"] and not s["importance_resident"].any() for s in st.values())
    # A window longer than this optimizer's is refused before anything changes.
    train(a, opt, ddp_worker.batches(3))
    saved = opt.state_dict()
    short = strata.optim.AdamW(a.parameters(), lr=1e-2, importance=(0.25, 2))
    train(a, short, ddp_worker.batches(1))
    before = short.state_dict()
    with pytest.raises(ValueError, match="windows are 2 steps"):
        short.load_state_dict(saved)
    after = short.state_dict()
    for k in before["state"]:
        assert torch.equal(before["state"][k]["exp_avg"], after["state"][k]["exp_avg"])
