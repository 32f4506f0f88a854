"""strata.optim with bf16 and fp16 parameters (fp32 master weights in the
tier) against torch.optim.AdamW stepping fp32 masters of its own.

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
import strata.optim


def model(dtype, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return m.to(dtype)


def data(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        out.append((x, torch.tanh(x @ w)))
    return out


class MasterReference:
    """What mixed-precision training does with torch's own optimizer: fp32
    master copies of a low-precision model's parameters, stepped by
    torch.optim.AdamW, rounded back into the model after each step."""

    def __init__(self, m, **kw):
        self.m = m
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in m.parameters()]
        self.opt = torch.optim.AdamW(self.masters, foreach=False, **kw)

    def step(self, unscale=1.0):
        for p, w in zip(self.m.parameters(), self.masters):
            w.grad = p.grad.float() * unscale
        self.opt.step()
        with torch.no_grad():
            for p, w in zip(self.m.parameters(), self.masters):
                p.copy_(w)

    def zero_grad(self):
        self.m.zero_grad()


def losses(m, opt, batches, dtype):
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = ((m(x.to(dtype)).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_training_matches_fp32_masters_in_torch(dtype, tmp_path):
    """200 steps: the loss within 1% of torch.optim.AdamW over fp32 masters
    at every 20th step, and the parameters a rounding of the same masters."""
    batches = data(200)
    kw = dict(lr=3e-3, weight_decay=0.01)
    ref_m = model(dtype)
    ref = losses(ref_m, MasterReference(ref_m, **kw), batches, dtype)
    for tier in ("host", "nvme"):
        m = model(dtype)
        extra = {"nvme_path": str(tmp_path)} if tier == "nvme" else {}
        opt = strata.optim.AdamW(m.parameters(), tier=tier, **kw, **extra)
        got = losses(m, opt, batches, dtype)
        for i in range(0, 200, 20):
            assert abs(got[i] - ref[i]) <= 0.01 * abs(ref[i]), (tier, i, got[i], ref[i])
        assert ref[-1] < 0.5 * ref[0], "the model trains"
        # Each parameter is its fp32 master rounded to nearest even.
        masters = opt.state_dict()["state"]
        for i, p in enumerate(m.parameters()):
            assert p.dtype == dtype and masters[i]["master"].dtype == torch.float32
            assert torch.equal(p.detach(), masters[i]["master"].to(dtype))


def test_gradients_in_fp32_for_bf16_parameters_use_them_unrounded():
    m, r = model(torch.bfloat16), model(torch.bfloat16)
    opt = strata.optim.AdamW(m.parameters(), lr=1e-2)
    ref = MasterReference(r, lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p, q in zip(m.parameters(), r.parameters()):
            grad = torch.randn(p.shape, generator=g) * 1e-3
            for t in (p, q):
                t.grad_dtype = None  # torch then lets a gradient differ in dtype
                t.grad = grad.clone()  # fp32 gradients
        opt.step()
        ref.step()
    for p, w in zip(m.parameters(), ref.masters):
        assert torch.allclose(p.float(), w.detach().to(torch.bfloat16).float(), rtol=1e-2, atol=1e-5)
    masters = opt.state_dict()["state"]
    for i, w in enumerate(ref.masters):
        assert torch.allclose(masters[i]["master"], w.detach(), rtol=1e-5, atol=1e-7)


def test_grad_scaler_with_fp16_unscales_in_the_step_and_skips_overflow():
    dtype = torch.float16
    batches = data(10)
    m, r = model(dtype), model(dtype)
    opt = strata.optim.AdamW(m.parameters(), lr=1e-3)
    ref = MasterReference(r, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    for x, y in batches:
        for mm, o in ((m, opt), (r, None)):
            mm.zero_grad()
            loss = ((mm(x.to(dtype)).float() - y) ** 2).mean()
            (loss * 256.0).backward() if o is None else scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        ref.step(unscale=1.0 / 256.0)
    for p, q in zip(m.parameters(), r.parameters()):
        assert torch.allclose(p.float(), q.float(), rtol=2e-3, atol=1e-4)
    # A scale that overflows fp16's gradients: the step is skipped (nothing
    # changes, no state is touched) and the scaler backs off.
    before = [p.detach().clone() for p in m.parameters()]
    steps = opt.state_dict()["state"][0]["step"]
    big = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x, y = batches[0]
    opt.zero_grad()
    big.scale(((m(x.to(dtype)).float() - y) ** 2).mean()).backward()
    big.step(opt)
    big.update()
    assert big.get_scale() < 2.0**40
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q)
    assert opt.state_dict()["state"][0]["step"] == steps


def test_autocast_bf16_on_cpu_with_fp32_parameters():
    batches = data(20)
    a, b = model(torch.float32), model(torch.float32)
    ta = torch.optim.AdamW(a.parameters(), lr=3e-3, foreach=False)
    sb = strata.optim.AdamW(b.parameters(), lr=3e-3)
    got = {}
    for m, o in ((a, ta), (b, sb)):
        got[o] = []
        for x, y in batches:
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
            assert out.dtype == torch.bfloat16
            loss = ((out.float() - y) ** 2).mean()
            loss.backward()
            o.step()
            got[o].append(loss.item())
    # bf16 forwards round a few-ulp difference in the fp32 updates up to
    # bf16's precision: the runs agree to that, not bitwise.
    for u, v in zip(got[ta], got[sb]):
        assert abs(u - v) <= 0.01 * abs(u)
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.dtype == torch.float32
        assert torch.allclose(p, q, rtol=1e-2, atol=1e-3)


def test_resuming_from_a_state_dict_is_exact_for_bf16(tmp_path):
    """The checkpoint holds the fp32 masters: a resumed run is bitwise the
    uninterrupted one (restarting from the bf16 parameters would not be)."""
    dtype = torch.bfloat16
    batches = data(12)
    whole = model(dtype)
    losses(whole, strata.optim.AdamW(whole.parameters(), lr=1e-2), batches, dtype)

    m = model(dtype)
    opt = strata.optim.AdamW(m.parameters(), lr=1e-2)
    losses(m, opt, batches[:6], dtype)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    for st in saved["opt"]["state"].values():
        assert st["master"].dtype == st["exp_avg"].dtype == torch.float32

    resumed = model(dtype, seed=5)
    resumed.load_state_dict(saved["model"])
    opt2 = strata.optim.AdamW(resumed.parameters(), lr=1e-2, tier="nvme", nvme_path=str(tmp_path))
    opt2.load_state_dict(saved["opt"])
    losses(resumed, opt2, batches[6:], dtype)
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_errors_name_the_parameter_and_what_would_work():
    m = model(torch.float32)
    base = torch.zeros(8, 4)
    view = torch.nn.Parameter(base.t())  # non-contiguous
    with pytest.raises(TypeError, match=r"parameter 'skewed'.*not contiguous"):
        strata.optim.AdamW([("w", m[0].weight), ("skewed", view)])
    with pytest.raises(TypeError, match=r"parameter 1 of param group 0 \(shape \(4, 8\)\).*not contiguous"):
        strata.optim.AdamW([m[0].weight, view])
    with pytest.raises(TypeError, match="torch.int64; use float32, bfloat16 or float16"):
        strata.optim.AdamW([torch.zeros(3, dtype=torch.int64)])
    # Gradients: sparse, or of a third dtype.
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = strata.optim.AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradients are not supported"):
        opt.step()
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16))
    opt = strata.optim.AdamW([p])
    p.grad_dtype = None
    p.grad = torch.zeros(6, dtype=torch.float16)
    with pytest.raises(TypeError, match="its gradient is torch.float16 .*use torch.bfloat16 or torch.float32"):
        opt.step()
    # A state directory that cannot take the states: at construction.
    with pytest.raises(strata.NotFoundError, match="not a directory"):
        strata.optim.AdamW([p], tier="nvme", nvme_path="/proc/no-such-dir")


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_fp32_parameters_are_their_own_master(tier, tmp_path):
    """The parameter is updated in place as the master (no copy in the
    tier; on NVMe only the moments stream): training still matches torch,
    a state_dict round trip resumes it, and weights changed outside the
    optimizer are simply the master."""
    kw = dict(tier=tier, nvme_path=str(tmp_path)) if tier == "nvme" else {}
    a, b = model(torch.float32), model(torch.float32)
    ta = torch.optim.AdamW(a.parameters(), lr=3e-3, foreach=False)
    sb = strata.optim.AdamW(b.parameters(), lr=3e-3, **kw)
    batches = data(10)
    losses(a, ta, batches[:5], torch.float32)
    losses(b, sb, batches[:5], torch.float32)
    with torch.no_grad():
        a[0].weight.mul_(0.5)
        b[0].weight.mul_(0.5)
    sd = sb.state_dict()
    assert "master" not in sd["state"][0]
    sb2 = strata.optim.AdamW(b.parameters(), lr=3e-3, **kw)
    sb2.load_state_dict(sd)
    losses(a, ta, batches[5:], torch.float32)
    losses(b, sb2, batches[5:], torch.float32)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_masters_older_than_the_parameter_are_not_loaded_over_it():
    """strata's state dict loads into torch.optim.AdamW and back: the
    "master" torch carries along (unused, and not stepped) is then older
    than the parameter torch stepped. Loading it put the parameter back to
    where strata left it at the next step; the parameter, newer, is kept."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64).bfloat16())
    ours = strata.optim.AdamW([p], lr=0.1)
    for _ in range(3):
        p.grad = torch.randn(64).bfloat16()
        ours.step()
    theirs = torch.optim.AdamW([p], lr=0.1, foreach=False)
    theirs.load_state_dict(ours.state_dict())
    for _ in range(3):
        p.grad = torch.randn(64).bfloat16()
        theirs.step()
    after_torch = p.detach().clone()
    back = strata.optim.AdamW([p])
    back.load_state_dict(theirs.state_dict())
    back.param_groups[0]["lr"] = 0.0
    p.grad = torch.randn(64).bfloat16()
    back.step()  # lr 0: the parameter is its master rounded
    assert torch.equal(p.detach(), after_torch)
    # A master the parameter is still the rounding of is loaded (the
    # resumed run is exact: test_resuming_from_a_state_dict_is_exact_for_bf16).
    sd = back.state_dict()
    again = strata.optim.AdamW([p])
    sd["state"][0]["master"] = sd["state"][0]["master"] * (1 + 2**-10)  # rounds to the same bf16
    assert torch.equal(sd["state"][0]["master"].bfloat16(), p.detach())
    again.load_state_dict(sd)
    assert torch.equal(again.state_dict()["state"][0]["master"], sd["state"][0]["master"])
