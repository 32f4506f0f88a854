"""strata.optim.Adam/AdamW against torch.optim.Adam/AdamW(foreach=False).

Skipped, with the reason printed, where torch is not installed; with
STRATA_REQUIRE_TORCH=1 (CI) a missing torch is a failure instead."""

import copy
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

# strata and torch order the update's float32 operations differently (see
# strata/optim.py): equal to within a few rounding steps, not bitwise.
TOL = dict(rtol=1e-5, atol=1e-6)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def groups(m):
    """Two param groups, each with its own hyper-parameters."""
    return [
        {"params": m[0].parameters(), "lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05},
        {"params": m[2].parameters(), "lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    ]


def train(m, opt, steps, seed=1, scaler=None, sched=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if sched is not None:
            sched.step()


def assert_same_params(a, b, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}", **(tol or TOL))


def assert_same_states(sa, sb):
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert float(sa["state"][k]["step"]) == float(sb["state"][k]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa["state"][k][key], sb["state"][k][key], **TOL)


@pytest.mark.parametrize(
    "ours,theirs",
    [(strata.optim.AdamW, torch.optim.AdamW), (strata.optim.Adam, torch.optim.Adam)],
)
def test_matches_torch_element_by_element(ours, theirs):
    a, b = model(), model()
    ta = theirs(groups(a), foreach=False)
    sb = ours(groups(b))
    assert isinstance(sb, torch.optim.Optimizer)
    train(a, ta, 20)
    train(b, sb, 20)
    assert_same_params(a, b)
    assert_same_states(ta.state_dict(), sb.state_dict())
    assert [g["lr"] for g in sb.param_groups] == [1e-2, 3e-3]


def test_tiers_agree_bitwise(tmp_path):
    results = []
    for kw in ({"tier": "host"}, {"tier": "cxl"}, {"tier": "nvme", "nvme_path": str(tmp_path)}):
        m = model()
        train(m, strata.optim.AdamW(groups(m), **kw), 5)
        results.append([p.detach().clone() for p in m.parameters()])
    for other in results[1:]:
        for p, q in zip(results[0], other):
            assert torch.equal(p, q)


def test_state_dict_round_trips_through_torch():
    a, b = model(), model()
    ta = torch.optim.AdamW(groups(a), foreach=False)
    sb = strata.optim.AdamW(groups(b))
    train(a, ta, 5)
    train(b, sb, 5)
    # strata's state into torch, torch's into strata: both continue alike.
    c, d = copy.deepcopy(b), copy.deepcopy(a)
    tc = torch.optim.AdamW(groups(c), foreach=False)
    tc.load_state_dict(sb.state_dict())
    sd = strata.optim.AdamW(groups(d))
    sd.load_state_dict(ta.state_dict())
    assert_same_states(sd.state_dict(), ta.state_dict())
    for m, o in ((a, ta), (b, sb), (c, tc), (d, sd)):
        train(m, o, 5, seed=2)
    assert_same_params(a, d)
    assert_same_params(b, c)
    assert_same_params(a, b)


def test_a_refused_state_dict_leaves_the_state_as_it_was():
    m = model()
    opt = strata.optim.AdamW(groups(m))
    train(m, opt, 2)
    before = opt.state_dict()
    first = next(iter(before["state"]))
    for key, bad in (("exp_avg", torch.zeros(3)), ("step", torch.tensor(-1.0)), ("step", torch.tensor(2.0**70)),
                     ("step", torch.tensor(1.5))):
        sd = copy.deepcopy(before)
        sd["state"][first][key] = bad
        with pytest.raises(strata.InvalidArgumentError, match=key):
            opt.load_state_dict(sd)
        assert_same_states(opt.state_dict(), before)
    # A group's options an Adam step cannot take are refused with the rest.
    for key, bad in (("lr", float("nan")), ("betas", (0.9, 1.5)), ("eps", -1.0), ("lr", None)):
        sd = copy.deepcopy(before)
        sd["param_groups"][-1][key] = bad
        with pytest.raises(strata.InvalidArgumentError, match=f"param group {len(sd['param_groups']) - 1}"):
            opt.load_state_dict(sd)
        assert_same_states(opt.state_dict(), before)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in before["param_groups"]]
    # And the optimizer goes on from where it was, as a twin that was never
    # handed a bad state dict.
    twin_m = copy.deepcopy(m)
    twin = strata.optim.AdamW(groups(twin_m))
    twin.load_state_dict(before)
    train(m, opt, 2, seed=2)
    train(twin_m, twin, 2, seed=2)
    assert_same_params(m, twin_m)


def test_a_refused_step_changes_no_parameter():
    m = model()
    opt = strata.optim.AdamW(groups(m))
    train(m, opt, 1)
    before = [p.detach().clone() for p in m.parameters()]
    m(torch.randn(4, 8)).sum().backward()
    opt.param_groups[-1]["lr"] = float("nan")
    with pytest.raises(strata.InvalidArgumentError, match=f"param group {len(opt.param_groups) - 1}"):
        opt.step()
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q)
    assert len(opt.param_groups) > 1  # the bad group is not the only one


def test_a_step_refused_for_one_parameter_moves_no_other():
    """Every parameter is checked before any steps: a later group's
    parameter that cannot be stepped (not contiguous, another shape or
    dtype than its state was made for) leaves the earlier ones as they
    were, and the step can be retried once it is mended."""
    p = torch.nn.Parameter(torch.ones(4))
    q = torch.nn.Parameter(torch.ones(3, 2))
    opt = strata.optim.AdamW([p], lr=0.1)
    opt.add_param_group({"params": [q]})
    p.grad, q.grad = torch.ones(4), torch.ones(3, 2)
    opt.step()
    after_one = p.detach().clone()
    for bad, grad, error in [
        (torch.ones(2, 3).t(), torch.ones(3, 2), TypeError),  # not contiguous
        (torch.ones(6), torch.ones(6), ValueError),  # another shape
        (torch.ones(3, 2, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64), TypeError),
        (torch.ones(3, 2, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16), TypeError),
    ]:
        q.data, q.grad = bad, grad
        p.grad = torch.ones(4)
        with pytest.raises(error):
            opt.step()
        assert torch.equal(p, after_one)
    # A gradient sharing its parameter's memory is refused the same way.
    base = torch.ones(8)
    for grad in (base[:6].view(3, 2), base[2:].view(3, 2)):  # the same memory, or part of it
        q.data = base[:6].view(3, 2)
        q.grad, p.grad = grad, torch.ones(4)
        with pytest.raises(strata.InvalidArgumentError, match="shares the parameter's memory"):
            opt.step()
        assert torch.equal(p, after_one)
    q.data, q.grad = torch.ones(3, 2), torch.ones(3, 2)
    opt.step()
    assert not torch.equal(p, after_one)


def test_weights_replaced_outside_the_optimizer_are_followed():
    """p.data replaced (which leaves the version counter as it was): the
    fp32 master copy of a bf16 parameter follows it."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = strata.optim.AdamW([p], lr=0.0, weight_decay=0.0)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    p.data = torch.full((4,), 3.0, dtype=torch.bfloat16)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()  # lr 0: the step writes the master copy back
    assert torch.equal(p.detach(), torch.full((4,), 3.0, dtype=torch.bfloat16))


def test_the_binding_refuses_arrays_of_another_element_type():
    """OffloadedAdam reads float32 (or 16-bit) arrays only: a float64 or
    int32 array is refused, not read as float32 bytes."""
    import numpy as np

    with pytest.raises(TypeError, match="float32"):
        strata.OffloadedAdam(np.ones(4))
    a = strata.OffloadedAdam(np.ones(4, np.float32))
    out = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="float32"):
        a.step(np.ones(2, np.float64), out)
    with pytest.raises(TypeError, match="float32"):
        a.step(np.ones(4, np.int32), out)
    with pytest.raises(TypeError, match="float32"):
        a.read_state(0, np.zeros(2, np.float64))
    a.step(np.ones(4, np.float32), out)
    assert (out < 1).all()
    with pytest.raises(strata.InvalidArgumentError, match="chunk_bytes"):
        strata.optim.AdamW([torch.nn.Parameter(torch.ones(2))], chunk_bytes=None)


def test_zero_grad_and_params_without_gradients():
    m = model()
    opt = strata.optim.AdamW(m.parameters())
    frozen = m[2].bias
    before = frozen.detach().clone()
    x = torch.randn(4, 8)
    m(x).sum().backward()
    frozen.grad = None  # no gradient: not stepped, no state
    opt.step()
    assert torch.equal(frozen, before)
    assert len(opt.state_dict()["state"]) == 3
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_lr_schedule_and_outside_weight_changes():
    a, b = model(), model()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    sb = strata.optim.AdamW(b.parameters(), lr=1e-2)
    train(a, ta, 4, sched=torch.optim.lr_scheduler.StepLR(ta, 2, gamma=0.5))
    train(b, sb, 4, sched=torch.optim.lr_scheduler.StepLR(sb, 2, gamma=0.5))
    assert sb.param_groups[0]["lr"] == ta.param_groups[0]["lr"] == 2.5e-3
    # Weights changed in place outside the optimizer: strata follows them.
    with torch.no_grad():
        for m in (a, b):
            m[0].weight.mul_(0.5)
    train(a, ta, 3)
    train(b, sb, 3)
    assert_same_params(a, b)


def test_grad_scaler():
    a, b = model(), model()
    ta = torch.optim.AdamW(groups(a), foreach=False)
    sb = strata.optim.AdamW(groups(b))
    train(a, ta, 5, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    train(b, sb, 5, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert_same_params(a, b)


def test_refusals():
    with pytest.raises(TypeError, match=r"parameter 0 of param group 0 \(shape \(4,\)\): it is torch.float64"):
        strata.optim.AdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))])
    with pytest.raises(NotImplementedError, match="amsgrad"):
        strata.optim.Adam(model().parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="learning rate"):
        strata.optim.AdamW(model().parameters(), lr=-1.0)
    # A tier without its path is refused at construction, not at a step.
    with pytest.raises(strata.InvalidArgumentError, match="needs nvme_path"):
        strata.optim.AdamW(model().parameters(), tier="nvme")
    with pytest.raises(strata.InvalidArgumentError, match="for tier 'nvme'"):
        strata.optim.AdamW(model().parameters(), tier="host", nvme_path="/tmp")
    with pytest.raises(strata.InvalidArgumentError, match="unknown updater 'gpu'"):
        strata.optim.AdamW(model().parameters(), updater="gpu")
    # A chunk a state array cannot stream in is refused at construction, not
    # at the first step of a parameter large enough to use it.
    for bad in (0, 3 << 20, 4 << 20, 2048, 12288):
        with pytest.raises(strata.InvalidArgumentError, match=f"chunk_bytes {bad} is not a power of two"):
            strata.optim.AdamW(model().parameters(), chunk_bytes=bad)


def test_offloaded_adam_directly():
    import numpy as np

    w = np.linspace(-1, 1, 5000, dtype=np.float32)
    adam = strata._strata.OffloadedAdam(w, chunk_bytes=4096, lr=1e-2, weight_decay=0.1)
    assert len(adam) == 5000 and adam.tier == "host" and adam.steps == 0
    out = np.empty_like(w)
    stats = adam.step(np.ones_like(w), out)
    assert set(stats) == {"seconds", "bytes_read", "bytes_written", "io_wait_seconds"}
    assert adam.steps == 1 and (out < w).all()
    m = np.empty_like(w)
    adam.read_state(1, m)
    assert np.allclose(m, 0.1)
    with pytest.raises(strata.InvalidArgumentError, match="gradients for 5000 parameters"):
        adam.step(np.ones(10, dtype=np.float32))
    with pytest.raises(strata.InvalidArgumentError, match="state 3"):
        adam.read_state(3, m)


def test_on_a_shared_runtime_agrees_bitwise_and_uses_its_tiers(rt):
    m = model()
    train(m, strata.optim.AdamW(groups(m), tier="host"), 5)
    want = [p.detach().clone() for p in m.parameters()]
    for tier, index in (("host", 1), ("nvme", 2)):
        before = rt.stats()["tiers"][index]["used_pages"]
        m = model()
        opt = strata.optim.AdamW(groups(m), tier=tier, runtime=rt)
        train(m, opt, 5)
        for p, q in zip(want, m.parameters()):
            assert torch.equal(p, q), tier
        assert rt.stats()["tiers"][index]["tier"] == tier
        assert rt.stats()["tiers"][index]["used_pages"] > before, "the states are in the runtime"
        del opt
    with pytest.raises(ValueError, match="nvme_path"):
        strata.optim.AdamW(groups(model()), tier="nvme", nvme_path="/tmp", runtime=rt)


def test_group_options_strata_does_not_take_are_refused_not_ignored():
    """amsgrad, maximize, capturable and differentiable change torch's
    update: set in a param group (at construction, through add_param_group,
    edited between steps, or in a state dict) they are refused as the
    keyword arguments are, not silently stepped as plain Adam."""
    for option in ("amsgrad", "maximize", "capturable", "differentiable"):
        p = torch.nn.Parameter(torch.ones(4))
        with pytest.raises(NotImplementedError, match=option):
            strata.optim.AdamW([{"params": [p], option: True}])
        opt = strata.optim.AdamW([p], lr=0.1)
        with pytest.raises(NotImplementedError, match=option):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], option: True})
        assert len(opt.param_groups) == 1
        p.grad = torch.ones(4)
        opt.step()
        after_one = p.detach().clone()
        opt.param_groups[0][option] = True
        with pytest.raises(NotImplementedError, match=f"{option}=True \\(param group 0"):
            opt.step()
        assert torch.equal(p, after_one)
        opt.param_groups[0][option] = False
        opt.step()
        assert not torch.equal(p, after_one)
    # torch.optim.Adam with decoupled_weight_decay=True is AdamW: strata's
    # Adam (L2 weight decay) refuses it rather than step it as L2.
    p = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(NotImplementedError, match="decoupled_weight_decay"):
        strata.optim.Adam([{"params": [p], "decoupled_weight_decay": True}])
    q = torch.nn.Parameter(torch.ones(4))
    theirs = torch.optim.AdamW([q], weight_decay=0.1, foreach=False)
    q.grad = torch.ones(4)
    theirs.step()
    with pytest.raises(NotImplementedError, match="decoupled_weight_decay"):
        strata.optim.Adam([p], weight_decay=0.1).load_state_dict(theirs.state_dict())
    strata.optim.AdamW([p], weight_decay=0.1).load_state_dict(theirs.state_dict())


def test_a_parameter_without_elements_counts_its_steps_as_torch_does():
    """A parameter with no elements has no state to stream, but its step
    count is torch's: the state dict loads into torch.optim.AdamW, which
    steps on from it (a step of -1 there made its bias correction 0, and
    its next step divided by it), and back."""
    empty, w = torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.ones(3))
    theirs_e, theirs_w = torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.ones(3))
    ours = strata.optim.AdamW([empty, w], lr=0.1)
    theirs = torch.optim.AdamW([theirs_e, theirs_w], lr=0.1, foreach=False)
    for _ in range(2):
        empty.grad, w.grad = torch.zeros(0, 3), torch.ones(3)
        theirs_e.grad, theirs_w.grad = torch.zeros(0, 3), torch.ones(3)
        ours.step()
        theirs.step()
    assert_same_states(ours.state_dict(), theirs.state_dict())
    again = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.ones(3))])
    again.load_state_dict(ours.state_dict())
    for p in again.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    again.step()
    back = strata.optim.AdamW([torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.ones(3))])
    back.load_state_dict(theirs.state_dict())
    assert_same_states(back.state_dict(), theirs.state_dict())


def test_a_state_without_a_step_loads_at_step_0():
    """The checks before a load take a state without "step" as step 0;
    the load itself did not (a KeyError after the optimizer's states had
    already been dropped)."""
    m = model()
    opt = strata.optim.AdamW(groups(m))
    train(m, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        del st["step"]
    opt.load_state_dict(sd)
    got = opt.state_dict()
    for k, st in sd["state"].items():
        assert float(got["state"][k]["step"]) == 0.0
        assert torch.equal(got["state"][k]["exp_avg"], st["exp_avg"])
    train(m, opt, 1)


def test_options_out_of_range_in_float32_are_refused_before_any_parameter_moves():
    """The step computes in float32: a beta that rounds to 1 there (or an lr
    past float32's range) is refused with the other options, before the
    first group's parameters move, not by the Rust side part-way through."""
    for key, bad in (("betas", (0.9, 0.99999999)), ("lr", 1e39), ("weight_decay", 1e39)):
        p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
        opt = strata.optim.AdamW([{"params": [p]}, {"params": [q], key: bad}], lr=0.1)
        p.grad, q.grad = torch.ones(4), torch.ones(4)
        with pytest.raises(strata.InvalidArgumentError, match="param group 1"):
            opt.step()
        assert torch.equal(p, torch.ones(4)) and torch.equal(q, torch.ones(4))
        assert opt.state_dict()["state"] == {}


def test_load_state_dict_hooks_act_as_on_torchs_optimizers():
    """A load_state_dict pre-hook may return a changed state dict: that is
    the one loaded (strata read the states from the one passed in); a
    post-hook sees the states loaded."""
    for cls, kw in ((torch.optim.AdamW, {"foreach": False}), (strata.optim.AdamW, {})):
        p = torch.nn.Parameter(torch.ones(3))
        opt = cls([p], lr=0.1, **kw)
        p.grad = torch.ones(3)
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
        opt.step()

        def pre(o, sd):
            sd = copy.deepcopy(sd)
            sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"] * 2
            return sd

        seen = []
        opt.register_load_state_dict_pre_hook(pre)
        opt.register_load_state_dict_post_hook(lambda o: seen.append(o.state_dict()["state"][0]))
        opt.load_state_dict(saved)
        got = opt.state_dict()["state"][0]
        assert torch.equal(got["exp_avg"], saved["state"][0]["exp_avg"] * 2), cls
        assert float(seen[0]["step"]) == float(saved["state"][0]["step"]) == 1.0, cls
        assert torch.equal(seen[0]["exp_avg"], got["exp_avg"]), cls
