"""strata.moe.offload on tiny randomly initialised transformers MoE models
(nothing is downloaded), and the ExpertCache binding under it.

Skipped, with the reason printed, where torch or transformers is not
installed; with STRATA_REQUIRE_TORCH=1 (CI) a missing one is a failure."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

if os.environ.get("STRATA_REQUIRE_TORCH") == "1":
    import accelerate  # noqa: F401  (must be there)
    import torch
    import transformers  # noqa: F401
else:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (tests/run.sh installs it unless STRATA_NO_TORCH=1)"
    )
    pytest.importorskip(
        "transformers",
        reason="transformers is not installed (tests/run.sh installs it unless STRATA_NO_TORCH=1)",
    )

from transformers import MixtralConfig, MixtralForCausalLM

import strata
import strata.moe

ROOT = Path(__file__).resolve().parents[2]

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER, VOCAB = 3, 6, 2, 64, 128, 128


def mixtral(seed=0, implementation="eager", **kw):
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=256,
        # At the default (0.02) a random model routes nearly every token to
        # the same experts and repeats one token.
        initializer_range=0.1,
        pad_token_id=0,
        **kw,
    )
    m = MixtralForCausalLM(cfg).eval()
    m.set_experts_implementation(implementation)
    return m


def prompts(seed=1, batch=2, length=10):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


def logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


def generate(m, ids, n=8):
    with torch.no_grad():
        return m.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )


# One expert: gate_up [2I, H] and down [H, I] float32.
EXPERT_BYTES = 3 * INTER * HIDDEN * 4
ALL = LAYERS * EXPERTS


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("page_size", [None, 4096])
def test_offloaded_logits_and_tokens_equal_the_original(prefetch, page_size):
    """Fewer slots than one layer's experts: every forward evicts. With
    4 KiB pages an expert spans many pages, scattered in device memory."""
    ref = mixtral()
    ids = prompts()
    want_logits, want_tokens = logits(ref, ids), generate(ref, ids)
    m = mixtral()
    moe = strata.moe.offload(
        m, device_slots=EXPERTS - 1, prefetch=prefetch, page_size=page_size, host_in_place=False
    )
    assert not any("experts.gate_up_proj" in k for k in m.state_dict())
    # The same expert loop in the same order over the same float32 values:
    # equal to the eager implementation bit for bit. Over scattered pages a
    # matrix is multiplied a run of pages at a time: the same sums, within
    # float32 rounding.
    tol = dict(rtol=0, atol=0) if page_size is None else {}
    torch.testing.assert_close(logits(m, ids), want_logits, **tol)
    assert torch.equal(generate(m, ids), want_tokens)
    s = moe.stats()
    t = s["total"]
    assert t["evictions"] > 0 and t["fetches"] > t["hits"]
    assert 0.0 <= t["hit_rate"] <= 1.0
    if prefetch:
        assert t["prefetches"] > 0
        # A prefetch pays only if its expert is fetched before it leaves.
        assert t["moves"] - t["moves_paid"] == t["prefetches"] - t["prefetches_used"]
    else:
        assert t["prefetches"] == 0 and t["prefetch_accuracy"] == 0.0
        # Every move is a miss's, and its own fetch uses it.
        assert t["moves_paid"] == t["moves"] == t["fetches"] - t["hits"] > 0
    # The per-layer counters add up to the total and to the cache's own.
    c = moe.cache.stats()
    for k in ("fetches", "hits", "prefetches", "prefetches_used", "bytes_moved", "evictions", "moves", "moves_paid"):
        assert sum(layer[k] for layer in s["layers"]) == t[k] == c[k], k
    assert t["bytes_moved"] >= (t["fetches"] - t["hits"]) * s["expert_bytes"]
    # The forward above, then generate's prefill and its 7 one-token steps.
    assert s["tokens"] == 2 * ids.numel() + 7 * ids.shape[0]
    assert t["bytes_moved_per_token"] == t["bytes_moved"] / s["tokens"]
    # Misses are read while the layer computes on the experts it has: the
    # modelled link may finish each read before its fetch (no modelled
    # stall), the measured fetches still wait for the pin.
    assert t["stall_seconds"] > 0 and t["modelled_stall_seconds"] >= 0
    assert t["reads_ahead"] > 0 and t["fetches"] == t["hits"] + t["reads_ahead"]
    b = moe.stats()["breakdown"]
    assert b["wall_seconds"] > 0 and b["compute_seconds"] > 0
    parts = b["compute_seconds"] + b["stall_seconds"] + b["submit_seconds"] + b["other_seconds"]
    assert abs(parts - b["wall_seconds"]) < 1e-6 and t["compute_seconds"] == b["compute_seconds"]
    assert s["modelled"] is True


def test_close_to_the_default_grouped_implementation():
    ref = mixtral(implementation=None)
    ids = prompts(seed=3)
    want = logits(ref, ids)
    m = mixtral(implementation=None)
    strata.moe.offload(m, device_slots=4)
    torch.testing.assert_close(logits(m, ids), want)


def test_lookahead_prefetch_is_used_with_room_to_spare():
    """With slots for every expert but one layer's, the lookahead through
    the next router finds experts before the block asks for them."""
    m = mixtral()
    moe = strata.moe.offload(m, device_slots=ALL - EXPERTS, host_in_place=False)
    generate(m, prompts(batch=1), n=16)
    t = moe.stats()["total"]
    assert t["prefetches"] > 0 and t["prefetches_used"] > 0
    assert 0.0 < t["prefetch_accuracy"] <= 1.0
    assert t["hit_rate"] > 0.5


def test_lookahead_asks_only_for_experts_that_need_a_read(tmp_path):
    """A prediction already in a slot costs nothing, so the lookahead's cap
    goes to the next-voted ones that need a read: with a slot for every
    expert (none leaves but a prefetch cancelled unfinished), each expert
    of layers 1 and up is predicted once, however many steps run."""
    m = mixtral()
    trace = tmp_path / "steps.txt"
    moe = strata.moe.offload(m, device_slots=ALL, host_in_place=False, record_routing=trace)
    generate(m, prompts(batch=2), n=12)
    moe.close()
    guesses = [tuple(line.split()[1:3]) for line in trace.read_text().splitlines() if line.endswith(" prefetched")]
    t = moe.stats()["total"]
    assert moe.stats()["steps"] == 12 and guesses
    assert len(set(guesses)) <= (LAYERS - 1) * EXPERTS
    assert len(guesses) <= len(set(guesses)) + t["prefetches_cancelled"]
    assert t["prefetches"] == len(guesses)


@pytest.mark.parametrize(
    "nvme_miss_cost,host_cache,in_place",
    [(4.0, False, False), (1.0, False, False), (4.0, True, False), (4.0, False, True), (4.0, True, True)],
)
def test_experts_beyond_host_bytes_go_to_nvme(tmp_path, nvme_miss_cost, host_cache, in_place):
    ref = mixtral(seed=4)
    ids = prompts(seed=4)
    want = logits(ref, ids)
    m = mixtral(seed=4)
    page = 64 << 10  # each of an expert's two slices in a page (the default here)
    moe = strata.moe.offload(
        m,
        device_slots=4,
        host_bytes=(ALL // 2) * 2 * page,
        nvme_path=tmp_path,
        nvme_miss_cost=nvme_miss_cost,
        host_cache=host_cache,
        host_in_place=in_place,
    )
    nvme = [t for t in json.loads(moe.cache.runtime_stats_json())["tiers"] if t["tier"] == "nvme"]
    assert nvme and nvme[0]["used_pages"] > 0

    def written():
        links = json.loads(moe.cache.runtime_stats_json())["links"]
        return sum(x["bytes"] for x in links if x["to"] == "nvme")

    before = written()
    reads0 = moe.cache.nvme_stats()
    torch.testing.assert_close(logits(m, ids), want, rtol=0, atol=0)
    assert torch.equal(generate(m, ids), generate(ref, ids))
    # The disk's counters: the experts read from it, and the time reads
    # were in flight (what the peers script's model takes as its rate).
    reads = moe.cache.nvme_stats()
    assert reads["bytes_read"] > reads0["bytes_read"] and reads["busy_seconds"] > reads0["busy_seconds"]
    assert reads["errors"] == 0
    # Read-only experts are never written back: an eviction drops the
    # device copy onto the clean copy it was read from.
    t = moe.stats()["total"]
    assert t["evictions"] > 0 and t["reads_ahead"] > 0
    assert written() == before
    if in_place:
        # The experts in host memory are read there: every move into a
        # device slot reads the disk.
        assert t["served_in_place"] > 0 and 0 < t["moves_from_nvme"] == t["moves"]
        assert t["fetches"] == t["hits"] + t["served_in_place"] + t["reads_ahead"]
    else:
        # Half the experts are on NVMe: some moves read the disk, not all.
        assert t["served_in_place"] == 0 and 0 < t["moves_from_nvme"] < t["moves"]
    # A host tier that keeps its experts swaps none.
    if not host_cache:
        assert t["host_swaps"] == 0


def test_on_the_simulated_device_experts_in_host_memory_are_read_in_place():
    """The default on a CPU: every expert fits in host memory, so every
    fetch reads it there (the slot's tier "host"), nothing moves, and the
    logits are the original's bit for bit."""
    ref = mixtral()
    ids = prompts()
    want_logits, want_tokens = logits(ref, ids), generate(ref, ids)
    m = mixtral()
    moe = strata.moe.offload(m, device_slots=EXPERTS - 1)
    torch.testing.assert_close(logits(m, ids), want_logits, rtol=0, atol=0)
    assert torch.equal(generate(m, ids), want_tokens)
    t = moe.stats()["total"]
    assert t["fetches"] > 0 and t["served_in_place"] == t["fetches"]
    assert t["hits"] == t["moves"] == t["bytes_moved"] == t["evictions"] == t["prefetches"] == 0
    slot = moe.cache.fetch(0, 0)
    assert slot.tier == "host" and moe.cache.is_ready(0, 0) and not moe.cache.is_resident(0, 0)
    slot.release()


def test_experts_read_from_the_checkpoint_of_an_empty_model(tmp_path):
    """The whole model never in memory: built on the meta device, its other
    weights loaded, its experts read from the safetensors one at a time."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    from safetensors.torch import load_file

    ref = mixtral(seed=7)
    ids = prompts(seed=7)
    want = logits(ref, ids)
    ref.save_pretrained(tmp_path, save_original_format=False)
    with accelerate.init_empty_weights():
        m = mixtral(seed=7)
    sd = {k: v for k, v in load_file(tmp_path / "model.safetensors").items() if ".mlp.experts." not in k}
    missing, unexpected = m.load_state_dict(sd, strict=False, assign=True)
    assert not unexpected and missing and all(".mlp.experts." in k for k in missing)
    with pytest.raises(strata.InvalidArgumentError, match="meta device: pass checkpoint="):
        strata.moe.offload(m)
    with pytest.raises(strata.InvalidArgumentError, match="no .safetensors file"):
        strata.moe.offload(m, checkpoint=tmp_path / "nothing-here")
    strata.moe.offload(m, device_slots=4, checkpoint=tmp_path)
    torch.testing.assert_close(logits(m, ids), want, rtol=0, atol=0)


def test_an_empty_model_takes_its_experts_dtype_from_the_checkpoint(tmp_path):
    """A model built under init_empty_weights has float32 experts on the meta
    device whatever the checkpoint holds: a bf16 checkpoint's experts are
    registered in bf16 (half the bytes), not widened."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    from safetensors.torch import load_file

    ref = mixtral(seed=8).to(torch.bfloat16)
    ids = prompts(seed=8)
    want = logits(ref, ids)
    ref.save_pretrained(tmp_path, save_original_format=False)
    with accelerate.init_empty_weights():
        m = mixtral(seed=8)
    assert m.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    sd = {k: v for k, v in load_file(tmp_path / "model.safetensors").items() if ".mlp.experts." not in k}
    m.load_state_dict(sd, strict=False, assign=True)
    # The buffers (rotary frequencies) as the bf16 reference has them.
    for mod in m.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_floating_point():
                setattr(mod, name, buf.to(torch.bfloat16))
    moe = strata.moe.offload(m, device_slots=4, checkpoint=tmp_path)
    assert moe.layout["dtype"] == torch.bfloat16 and moe.layout["expert_bytes"] == EXPERT_BYTES // 2
    torch.testing.assert_close(logits(m, ids), want, rtol=0, atol=0)


def test_qwen2_moe_blocks():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    def model():
        torch.manual_seed(5)
        cfg = Qwen2MoeConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=128,
            initializer_range=0.1,
        )
        m = Qwen2MoeForCausalLM(cfg).eval()
        m.set_experts_implementation("eager")
        return m

    ids = prompts(seed=6)
    want = logits(model(), ids)
    m = model()
    moe = strata.moe.offload(m, device_slots=3)
    assert moe.layers == 2
    torch.testing.assert_close(logits(m, ids), want, rtol=0, atol=0)


def test_budgets_in_accelerates_words(tmp_path):
    ref = mixtral(seed=4)
    ids = prompts(seed=4)
    want = logits(ref, ids)
    m = mixtral(seed=4)
    page = 64 << 10
    host = f"{(ALL // 2) * 2 * page // 1024}KiB"
    moe = strata.moe.offload(m, max_memory={"cpu": host, 0: 4 * 2 * page, "disk": "1TB"}, offload_folder=tmp_path)
    tiers = {t["tier"]: t for t in json.loads(moe.cache.runtime_stats_json())["tiers"]}
    assert tiers["nvme"]["used_pages"] > 0
    assert tiers["host"]["used_pages"] + tiers["host"]["free_pages"] == ALL // 2 * 2
    torch.testing.assert_close(logits(m, ids), want, rtol=0, atol=0)
    for bad, match in (
        (dict(max_memory={"cpu": "lots"}), "not a size"),
        (dict(max_memory={1: "1GiB"}), "one device"),
        (dict(max_memory={"cpu": "1GiB"}, host_bytes=1 << 30), "not both"),
        (dict(offload_folder=tmp_path, nvme_path=tmp_path), "not both"),
    ):
        with pytest.raises(strata.InvalidArgumentError, match=match):
            strata.moe.offload(mixtral(), **bad)


def test_without_a_host_budget_the_host_holds_what_the_machine_can_spare(tmp_path, monkeypatch):
    page = 64 << 10
    spare = (ALL // 3) * 2 * page
    monkeypatch.setattr(strata.moe, "_spare_bytes", lambda: spare + 100)
    ref = mixtral(seed=5)
    ids = prompts(seed=5)
    want = logits(ref, ids)
    m = mixtral(seed=5)
    moe = strata.moe.offload(m, device_slots=4, nvme_path=tmp_path)
    tiers = {t["tier"]: t for t in json.loads(moe.cache.runtime_stats_json())["tiers"]}
    # The simulated device's 4 slots (2 pages each) come out of the same
    # spare memory.
    assert tiers["host"]["used_pages"] + tiers["host"]["free_pages"] == spare // page - 4 * 2
    assert tiers["nvme"]["used_pages"] > 0
    torch.testing.assert_close(logits(m, ids), want, rtol=0, atol=0)
    with pytest.raises(strata.InvalidArgumentError, match="can spare"):
        strata.moe.offload(mixtral(), device_slots=4)


def skip_unless_family(model_type):
    """Skips where the installed transformers has no such family; any other
    failure to build one is the test's."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")


def tiny_family(model_type, dtype=torch.float32, seed=0):
    """A tiny random model of a transformers MoE family, eager experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type == "dbrx":
        # Its attention and experts take their sizes from dicts of their own.
        cfg = AutoConfig.for_model(
            "dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=VOCAB, initializer_range=0.1,
            attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=128, moe_num_experts=EXPERTS, moe_top_k=TOP_K),
        )
    else:
        cfg = AutoConfig.for_model(model_type)
    small = dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=EXPERTS,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=16, max_position_embeddings=64,
        shared_expert_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=0, initializer_range=0.1,
        n_routed_experts=EXPERTS, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    )
    for k, v in small.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    if model_type.startswith("deepseek"):
        cfg.head_dim = cfg.qk_rope_head_dim  # its rotary part
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).eval().to(dtype)
    m.set_experts_implementation("eager")
    if model_type == "jetmoe":
        # Its blocks' output biases start at zero: random ones are seen.
        with torch.no_grad():
            for layer in m.model.layers:
                layer.mlp.bias.normal_(0.0, 0.1)
    return m


# Families whose experts are fused gate_up_proj/down_proj tensors under a
# block with a router named `gate` or `router`.
# GPT-OSS: transposed experts with biases and its own clamped gate;
# Llama 4: transposed experts given every token, and a shared expert.
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax", "phimoe", "granitemoe",
            "granitemoeshared", "hunyuan_v1_moe", "ernie4_5_moe", "dots1", "afmoe", "deepseek_v2", "deepseek_v3",
            "gpt_oss", "llama4_text", "dbrx", "jetmoe"]


# Each dtype the default way (on a CPU every expert is read in place from
# host memory), and bf16 through the device slots too (the GPU's way).
@pytest.mark.parametrize(
    "dtype,in_place",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, False)],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_fused_family_offloads_with_identical_logits_and_tokens(family, dtype, in_place, tmp_path):
    skip_unless_family(family)
    ref = tiny_family(family, dtype)
    ids = prompts(seed=3)
    want, tokens = logits(ref, ids), generate(ref, ids, n=4)
    m = tiny_family(family, dtype)
    trace = tmp_path / "route.txt"
    moe = strata.moe.offload(m, device_slots=2, host_in_place=in_place, record_routing=trace)
    assert torch.equal(logits(m, ids), want)
    assert torch.equal(generate(m, ids, n=4), tokens)
    t = moe.stats()["total"]
    assert (t["served_in_place"] == t["fetches"]) if in_place is None else (t["served_in_place"] == 0 < t["moves"])
    if in_place is False and moe.layers > 1:
        # Through the slots, the lookahead finds each family's router and
        # asks for experts of the next layer (its trace's `prefetched`).
        moe.flush()
        lines = trace.read_text().splitlines()
        assert any(line.endswith(" prefetched") for line in lines if not line.startswith("#"))


def test_llama4_records_the_experts_its_tokens_chose(tmp_path):
    m = tiny_family("llama4_text", seed=4)
    trace = tmp_path / "route.txt"
    moe = strata.moe.offload(m, device_slots=2, record_routing=trace, record_per_token=True)
    ids = prompts(seed=4, batch=1, length=5)
    logits(m, ids)
    moe.flush()
    lines = [line.split() for line in trace.read_text().splitlines() if not line.startswith("#")]
    # Each of the 5 tokens, in each of the 2 layers, chose its top-2 experts.
    assert len(lines) == 5 * 2 * TOP_K
    assert {int(layer) for _, layer, _ in lines} == {0, 1}


def empty_beside_its_checkpoint(ref, family, path, is_expert, seed=2):
    """`ref` saved to `path`, and a model of its family built on the meta
    device with everything but its experts (the keys `is_expert` names)
    loaded from that checkpoint."""
    import accelerate
    from safetensors.torch import load_file

    ref.save_pretrained(path, save_original_format=False)
    with accelerate.init_empty_weights():
        m = tiny_family(family, seed=seed)
    sd = {k: v for k, v in load_file(path / "model.safetensors").items() if not is_expert(k)}
    m.load_state_dict(sd, strict=False, assign=True)
    m.tie_weights()  # a tied lm_head is the embedding's (assign=True replaced that one alone)
    return m


def test_gpt_oss_experts_over_small_pages_and_from_a_checkpoint(tmp_path):
    """Its matrices over many 4 KiB pages of the device slots (x @ W
    copied whole where the pages are apart), and its experts and biases
    read from the checkpoint of a model built on the meta device."""
    pytest.importorskip("accelerate", reason="accelerate is not installed")

    ref = tiny_family("gpt_oss", seed=2)
    ids = prompts(seed=2)
    want = logits(ref, ids)
    m = tiny_family("gpt_oss", seed=2)
    strata.moe.offload(m, device_slots=3, page_size=4096, host_in_place=False)
    assert torch.equal(logits(m, ids), want)
    m = empty_beside_its_checkpoint(ref, "gpt_oss", tmp_path, lambda k: ".mlp.experts." in k)
    strata.moe.offload(m, device_slots=3, checkpoint=tmp_path)
    assert torch.equal(logits(m, ids), want)


def test_gpt_oss_biases_from_a_bf16_checkpoint_take_the_experts_dtype(tmp_path):
    """A model built on the meta device has float32 there; the experts and
    their biases both come in the checkpoint's bfloat16."""
    pytest.importorskip("accelerate", reason="accelerate is not installed")

    ref = tiny_family("gpt_oss", torch.bfloat16, seed=2)
    ids = prompts(seed=2)
    want = logits(ref, ids)
    m = empty_beside_its_checkpoint(ref, "gpt_oss", tmp_path, lambda k: ".mlp.experts." in k)
    # The shell's buffers (not in the checkpoint) as the reference has them.
    m.model.rotary_emb.to(torch.bfloat16)
    assert m.model.layers[0].mlp.experts.down_proj_bias.dtype == torch.float32  # on the meta device
    moe = strata.moe.offload(m, device_slots=3, checkpoint=tmp_path)
    assert moe.layout["dtype"] == torch.bfloat16
    assert torch.equal(logits(m, ids), want)


def test_a_failed_offload_leaves_the_model_and_no_trace(tmp_path):
    """A checkpoint missing the last layer's biases is found out before any
    block is replaced: the model keeps its own experts, no hook, no trace
    file."""
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    from safetensors.torch import load_file, save_file

    ref = tiny_family("gpt_oss", seed=2)
    m = empty_beside_its_checkpoint(ref, "gpt_oss", tmp_path, lambda k: ".mlp.experts." in k)
    ckpt = tmp_path / "model.safetensors"
    sd = load_file(ckpt)
    last = max(int(k.split(".")[2]) for k in sd if ".mlp.experts." in k)
    save_file({k: v for k, v in sd.items() if not (f"layers.{last}.mlp.experts." in k and k.endswith("_bias"))}, ckpt)
    kinds = [type(mod).__name__ for mod in m.modules()]
    trace = tmp_path / "route.txt"
    with pytest.raises(strata.InvalidArgumentError, match="bias"):
        strata.moe.offload(m, device_slots=3, checkpoint=tmp_path, record_routing=trace)
    assert [type(mod).__name__ for mod in m.modules()] == kinds
    assert not any(mod._forward_pre_hooks for mod in m.modules())
    assert not trace.exists()


def test_experts_that_gate_their_own_way_are_refused():
    """An experts class with its own _apply_gate (a clamped SwiGLU, as
    DeepSeek-V4's) or a norm after each expert computes what strata's
    act_fn(gate) * up would not: refused, naming the class, the model left
    as it was."""
    m = mixtral()
    experts = m.model.layers[0].mlp.experts

    class ClampedExperts(type(experts)):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=0.05)) * up

    experts.__class__ = ClampedExperts
    with pytest.raises(strata.InvalidArgumentError, match="ClampedExperts.*_apply_gate"):
        strata.moe.offload(m, device_slots=2)
    assert type(m.model.layers[1].mlp.experts).__name__ == "MixtralExperts"


def test_an_error_inside_the_experts_arithmetic_releases_their_pins():
    """An exception raised in the experts' arithmetic, kept alive (as a
    notebook keeps the last one): the slots' pins go with the slots, and
    the next forward runs and gives the model's own logits."""
    ids = prompts()
    want = logits(mixtral(), ids)
    m = mixtral()
    strata.moe.offload(m, device_slots=1, host_in_place=False, prefetch=False)
    real = strata.moe.F

    def failing_linear(*args):
        raise RuntimeError("a failure inside F.linear")

    strata.moe.F = types.SimpleNamespace(linear=failing_linear)
    try:
        with pytest.raises(RuntimeError, match="inside F.linear") as kept:
            logits(m, ids)
    finally:
        strata.moe.F = real
    assert kept.value is not None  # the traceback is still held
    assert torch.equal(logits(m, ids), want)


def test_a_failed_offload_keeps_a_trace_already_there(tmp_path):
    """record_routing naming an existing trace: an offload that fails (here
    the NVMe tier is too small for the experts) leaves that file as it was;
    one that succeeds replaces it."""
    m = mixtral()
    trace = tmp_path / "route.txt"
    trace.write_text("0 0 1\n0 0 2\n")
    with pytest.raises(strata.OutOfCapacityError):
        strata.moe.offload(m, device_slots=2, host_bytes=4 * EXPERT_BYTES, nvme_path=tmp_path,
                           nvme_capacity=1 << 20, record_routing=trace)
    assert trace.read_text() == "0 0 1\n0 0 2\n"
    moe = strata.moe.offload(m, device_slots=2, record_routing=trace)
    moe.close()
    assert trace.read_text().startswith("# strata.moe routing")


def test_registering_experts_while_another_thread_uses_the_cache():
    """ExpertCache.register from one thread while another calls the cache:
    both finish (the registering thread once held the cache's lock while it
    waited for the interpreter, which the other held while it waited for the
    lock). Run apart, so a deadlock fails the test instead of hanging it."""
    script = """
import threading, numpy as np, strata
c = strata.ExpertCache(slot_bytes=1 << 20, host_bytes=64 << 20, device_slots=2, device="sim", page_size=1 << 20)
w = np.ones(1 << 20, np.uint8)
t = threading.Thread(target=lambda: [c.register(0, i, w) for i in range(48)])
t.start()
calls = 0
while t.is_alive():
    c.stats(); calls += 1
t.join()
c.fetch(0, 47).release()  # every expert registered
print("ok", calls)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")


def test_dbrx_experts_from_a_checkpoint_with_the_lookahead(tmp_path):
    """DBRX keeps its experts as w1, v1 and w2 [E * I, H] under the
    experts' mlp: read from the checkpoint of a model built on the meta
    device, one expert's rows at a time, and prefetched through its
    router's linear layer with room to spare."""
    pytest.importorskip("accelerate", reason="accelerate is not installed")

    skip_unless_family("dbrx")
    ref = tiny_family("dbrx", seed=2)
    ids = prompts(seed=2, batch=1)
    want, tokens = logits(ref, ids), generate(ref, ids, n=8)
    m = empty_beside_its_checkpoint(ref, "dbrx", tmp_path, lambda k: ".experts." in k)
    moe = strata.moe.offload(m, device_slots=EXPERTS, checkpoint=tmp_path, host_in_place=False)
    assert torch.equal(logits(m, ids), want)
    assert torch.equal(generate(m, ids, n=8), tokens)
    t = moe.stats()["total"]
    assert t["prefetches"] > 0 and t["prefetches_used"] > 0


def test_jetmoe_experts_from_a_checkpoint_with_the_lookahead_and_its_attention_experts_kept(tmp_path):
    """JetMoE's MoE blocks (input_linear and output_linear, called with
    the rows grouped by expert) are replaced whole: read from the
    checkpoint of a model built on the meta device, prefetched through
    its router's linear layer, the routing recorded per token; the
    experts of its attention stay in the model."""
    pytest.importorskip("accelerate", reason="accelerate is not installed")

    skip_unless_family("jetmoe")
    ref = tiny_family("jetmoe", seed=2)
    ids = prompts(seed=2, batch=1)
    want, tokens = logits(ref, ids), generate(ref, ids, n=8)
    m = empty_beside_its_checkpoint(
        ref, "jetmoe", tmp_path, lambda k: ".mlp.input_linear." in k or ".mlp.output_linear." in k
    )
    trace = tmp_path / "route.txt"
    moe = strata.moe.offload(m, device_slots=EXPERTS, checkpoint=tmp_path, host_in_place=False,
                             record_routing=trace, record_per_token=True)
    assert isinstance(m.model.layers[0].mlp, strata.moe.StrataGroupedMoE)
    assert m.model.layers[0].self_attention.experts.input_linear.weight.device.type == "cpu"
    assert torch.equal(logits(m, ids), want)
    assert torch.equal(generate(m, ids, n=8), tokens)
    t = moe.stats()["total"]
    assert t["prefetches"] > 0 and t["prefetches_used"] > 0
    moe.flush()
    # The first forward's tokens chose, in each layer, the experts its own
    # router picks in the original model.
    picks = {}

    def pick(i):
        def hook(module, args, out):
            picks.setdefault(i, out[4].topk(TOP_K).indices.tolist())

        return hook

    hooks = [ref.model.layers[i].mlp.router.register_forward_hook(pick(i)) for i in range(2)]
    logits(ref, ids)
    for h in hooks:
        h.remove()
    lines = [line.split() for line in trace.read_text().splitlines() if not line.startswith("#")]
    for layer in range(2):
        got = [sorted(int(e) for tok, lay, e in lines if (int(tok), int(lay)) == (t, layer)) for t in range(len(ids[0]))]
        assert got == [sorted(w) for w in picks[layer]]


def test_an_unsupported_experts_module_is_named():
    class ListedExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.ModuleList(torch.nn.Linear(4, 8) for _ in range(2))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 2)
            self.experts = ListedExperts()

    model = torch.nn.Sequential(Block())
    with pytest.raises(strata.InvalidArgumentError, match="cannot offload ListedExperts at 0.experts"):
        strata.moe.offload(model)


def test_bad_input_raises_clear_errors(tmp_path, monkeypatch):
    m = mixtral()
    with pytest.raises(strata.InvalidArgumentError, match="holds no expert"):
        strata.moe.offload(m, device_bytes=EXPERT_BYTES // 2)
    with pytest.raises(strata.InvalidArgumentError, match="give nvme_path"):
        strata.moe.offload(m, host_bytes=2 * EXPERT_BYTES)
    with pytest.raises(strata.InvalidArgumentError, match="host budget .* holds no expert"):
        strata.moe.offload(m, max_memory={"cpu": "0GiB"}, offload_folder=tmp_path)
    with pytest.raises(strata.InvalidArgumentError, match="not both"):
        strata.moe.offload(m, device_slots=2, max_memory={0: 1})
    for page in (0, 3000, "64K", 1 << 30, 2048):
        with pytest.raises(strata.InvalidArgumentError, match="page_size"):
            strata.moe.offload(m, page_size=page)
    # Counts that are not whole numbers are refused up front, naming the
    # argument, rather than in the first forward.
    for name, bad in (("max_prefetch", -1), ("max_prefetch", 1.5), ("max_prefetch", "2"), ("device_slots", True),
                      ("device_slots", 0), ("protect_fetches", 1.5)):
        with pytest.raises(strata.InvalidArgumentError, match=f"{name} {bad!r} is not a whole number"):
            strata.moe.offload(m, **{name: bad})
    with pytest.raises(strata.InvalidArgumentError, match="nvme_capacity -5000 is not a size"):
        strata.moe.offload(m, host_bytes=EXPERT_BYTES * 2, nvme_path=tmp_path, nvme_capacity=-5000)
    # The simulated device's slots are host memory: more than the machine
    # can spare is refused up front.
    with pytest.raises(strata.InvalidArgumentError, match="simulated device's 10000000 slots take"):
        strata.moe.offload(m, device_slots=10**7, host_bytes=EXPERT_BYTES * 2, nvme_path=tmp_path)
    with pytest.raises(strata.InvalidArgumentError, match="names the device 2 times"):
        strata.moe.offload(m, max_memory={0: "1MiB", "cuda": "1GiB"})
    with pytest.raises(strata.InvalidArgumentError, match="host_bytes 'lots' is not a size"):
        strata.moe.offload(m, host_bytes="lots")
    with pytest.raises(strata.StrataError, match="missing"):
        strata.moe.offload(m, host_bytes=EXPERT_BYTES * 2, nvme_path=tmp_path / "missing" / "swap")
    with pytest.raises(strata.InvalidArgumentError, match="nvme_miss_cost"):
        strata.moe.offload(m, host_bytes=EXPERT_BYTES * 2, nvme_path=tmp_path, nvme_miss_cost=0.0)
    # The slots go where the model is computed, or the call is refused
    # before the model changes (not in the first forward, with the model's
    # experts already gone).
    with pytest.raises(strata.InvalidArgumentError, match="the model is on cpu, and device='cuda'"):
        strata.moe.offload(m, device="cuda")
    with pytest.raises(strata.InvalidArgumentError, match="device must be 'sim', 'cuda' or 'auto', not 'gpu'"):
        strata.moe.offload(m, device="gpu")
    # A failed offload leaves the model as it was.
    assert m.model.layers[0].mlp.experts.gate_up_proj.shape == (EXPERTS, 2 * INTER, HIDDEN)
    # Sizes as accelerate reads them, a lower-case b in bits.
    assert strata.moe._bytes("5Gb", "x") == 625_000_000
    assert strata.moe._bytes("5GB", "x") == strata.moe._bytes("5gb".upper(), "x") == 5_000_000_000
    assert strata.moe._bytes("2GiB", "x") == strata.moe._bytes("2gib", "x") == 2 << 30
    # A device budget counts the slots' page padding: never more slots
    # than it holds.
    m2 = mixtral()
    moe = strata.moe.offload(m2, device_slots=1)
    page = moe.layout["page_size"]
    padded = -(-moe.layout["expert_bytes"] // page) * page
    assert padded > EXPERT_BYTES
    assert strata.moe.offload(mixtral(), device_bytes=3 * padded - 1).cache.device_slots == 2
    # A size in accelerate's words for the NVMe tier too.
    m3 = mixtral()
    moe3 = strata.moe.offload(m3, host_bytes=2 * padded, nvme_path=tmp_path, nvme_capacity="64MiB")
    assert moe3.cache.device_slots == max(1, EXPERTS * LAYERS // 4)
    moe3.close()
    # The eviction's name in any case gets that eviction's default decay.
    seen = []

    def spy(**kw):
        seen.append((kw["eviction"], kw["decay"]))
        return strata.ExpertCache(**kw)

    monkeypatch.setattr(strata.moe, "ExpertCache", spy)
    strata.moe.offload(mixtral(), eviction="LRFU")
    strata.moe.offload(mixtral(), eviction="lrfu")
    assert seen[0] == seen[1] and seen[0][0] == "lrfu"
    monkeypatch.undo()
    # Offloading twice is refused as such.
    with pytest.raises(strata.InvalidArgumentError, match="offloaded already"):
        strata.moe.offload(m2)
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(strata.InvalidArgumentError, match="no MoE block"):
        strata.moe.offload(dense)


def test_recorded_routing_parses_as_the_bench_reads_it(tmp_path):
    m = mixtral()
    ids = prompts()
    step_trace, token_trace = tmp_path / "steps.txt", tmp_path / "tokens.txt"
    moe = strata.moe.offload(m, device_slots=EXPERTS - 1, record_routing=step_trace, host_in_place=False)
    generate(m, ids, n=6)
    moe.close()
    routes, layers, experts = strata.parse_moe_trace(step_trace.read_text(), str(step_trace))
    s = moe.stats()
    assert (len(routes), layers) == (s["steps"], LAYERS) and experts <= EXPERTS
    # One line per fetch, in fetch order.
    assert sum(len(es) for tok in routes for es in tok) == s["total"]["fetches"]
    # The lookahead beside it: what was prefetched for layers 1 and up.
    guesses = [line.split() for line in step_trace.read_text().splitlines() if line.endswith(" prefetched")]
    assert guesses and all(int(layer) >= 1 for _, layer, _, _ in guesses)
    assert len(guesses) >= s["total"]["prefetches"] > 0

    m = mixtral()
    moe = strata.moe.offload(
        m, device_slots=EXPERTS - 1, record_routing=token_trace, record_per_token=True, host_in_place=False
    )
    generate(m, ids, n=6)
    moe.close()
    routes, layers, _ = strata.parse_moe_trace(token_trace.read_text())
    assert len(routes) == moe.stats()["tokens"] == ids.numel() + 5 * ids.shape[0]
    assert all(len(es) == TOP_K for tok in routes for es in tok)


def test_bad_trace_lines_are_named():
    with pytest.raises(strata.InvalidArgumentError, match=r"t\.txt:2: tokens must not decrease"):
        strata.parse_moe_trace("1 0 0\n0 0 1\n", "t.txt")
    with pytest.raises(strata.InvalidArgumentError, match="expected `token layer expert`"):
        strata.parse_moe_trace("0 0\n")


def strata_cli():
    for p in (os.environ.get("STRATA_BIN"), ROOT / "target/release/strata", ROOT / "target/debug/strata"):
        if p and Path(p).is_file():
            return str(p)
    return shutil.which("strata")


def test_recorded_routing_replays_in_strata_bench(tmp_path):
    cli = strata_cli()
    if cli is None:
        msg = "the strata CLI is not built (cargo build -p strata-bench, or STRATA_BIN)"
        if os.environ.get("STRATA_REQUIRE_TORCH") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    m = mixtral()
    trace = tmp_path / "route.txt"
    moe = strata.moe.offload(m, device_slots=LAYERS + 1, record_routing=trace, record_per_token=True)
    generate(m, prompts(), n=4)
    moe.close()
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [cli, "bench", "moe", "--routing", f"file:{trace}", "--expert-bytes", str(EXPERT_BYTES),
         "--device-slots", str(LAYERS + 1), "--quiet", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["layers"] == LAYERS and rep["tokens"] == moe.stats()["tokens"]
    assert rep["results"][0]["fetches"] == moe.stats()["tokens"] * LAYERS * TOP_K


# -- the binding ---------------------------------------------------------


def test_cancel_prefetches_keeps_the_routers_picks():
    """cancel_prefetches(layer, keep=...) drops the layer's other guesses
    still on their way (on the modelled link, none has arrived yet) and
    leaves the picked ones to be hits; bad arguments are exceptions."""
    import numpy as np

    c = strata.ExpertCache(slot_bytes=8192, host_bytes=1 << 20, device_slots=2, page_size=4096)
    for e in range(3):
        c.register(1, e, np.full(2048, e, dtype=np.float32))
    assert c.prefetch(1, [0, 1]) == 2
    assert c.cancel_prefetches(1, keep=[1, 2]) == 1
    assert not c.is_resident(1, 0) and c.is_resident(1, 1)
    hits = c.stats()["hits"]
    with c.fetch(1, 1):
        pass
    assert c.stats()["hits"] == hits + 1 and c.stats()["prefetches_cancelled"] == 1
    assert c.cancel_prefetches(1) == 0
    with pytest.raises(strata.InvalidArgumentError, match="expert -1"):
        c.cancel_prefetches(1, keep=[-1])
    with pytest.raises(strata.NotFoundError, match="expert \\(1, 7\\)"):
        c.cancel_prefetches(1, keep=[7])
    with pytest.raises(TypeError):
        c.cancel_prefetches(1, keep=["a"])


def test_expert_cache_binding_round_trip():
    import numpy as np

    c = strata.ExpertCache(slot_bytes=8192, host_bytes=1 << 20, device_slots=2, page_size=4096)
    data = {(l, e): np.full(2048, l * 10 + e, dtype=np.float32) for l in range(2) for e in range(3)}
    for (l, e), a in data.items():
        c.register(l, e, a)
    with pytest.raises(strata.InvalidArgumentError, match="a slot holds 1 to 8192"):
        c.register(0, 9, np.zeros(8193, dtype=np.uint8))
    with pytest.raises(strata.InvalidArgumentError, match="registered already"):
        c.register(0, 0, data[(0, 0)])
    with pytest.raises(strata.NotFoundError):
        c.fetch(5, 0)
    assert c.prefetch(0, [0, 1]) == 2
    for (l, e), a in data.items():
        with c.fetch(l, e) as slot:
            assert slot.nbytes == 8192 and len(slot.addresses) == 2
            with pytest.raises(strata.InvalidArgumentError, match="while a fetched ExpertSlot is held"):
                c.register(3, 0, a)
            for p in range(2):
                pin = slot.pin((p * 4096, (p + 1) * 4096), "float32")
                t = torch.from_dlpack(pin)
                pin.unpin()
                assert torch.equal(t, torch.from_numpy(a[p * 1024 : (p + 1) * 1024]))
                del t
        with pytest.raises(strata.ClosedError):
            slot.pin(None, "float32")
    s = c.stats()
    assert s["fetches"] == 6 and s["prefetches_used"] == 2 and s["evictions"] >= 4
    assert s["stall_modelled"] is True and s["hit_rate"] == s["hits"] / 6
    assert c.nvme_stats() is None  # no NVMe tier
    # The modelled clock takes durations, and none that would overrun it.
    now = c.modelled_now()
    for bad in (-1.0, float("nan"), 1.7e308):
        with pytest.raises(strata.InvalidArgumentError, match="advance"):
            c.advance(bad)
    assert c.modelled_now() == now
    with pytest.raises(strata.InvalidArgumentError, match="exactly one"):
        strata.ExpertCache(slot_bytes=8192, host_bytes=1 << 20)


def test_expert_cache_on_a_shared_runtime(rt):
    import numpy as np

    mine = rt.alloc(8 * 4096)
    mine.write(0, bytes([3]) * (8 * 4096))
    c = strata.ExpertCache(slot_bytes=8192, device_slots=2, runtime=rt)
    assert c.page_size == 4096
    host_before = rt.stats()["tiers"][1]["used_pages"]
    for e in range(3):
        c.register(0, e, np.full(2048, e + 1, dtype=np.float32))
    assert rt.stats()["tiers"][1]["used_pages"] == host_before + 6, "the experts share the host tier"
    for e in (0, 1, 2, 0):
        with c.fetch(0, e) as slot:
            t = torch.from_dlpack(slot.pin((0, 4096), "float32"))
            assert torch.all(t == e + 1)
            del t
    assert c.stats()["fetches"] == 4 and c.stats()["displaced"] == 0
    assert mine.read(0) == bytes([3]) * (8 * 4096)
    with pytest.raises(strata.InvalidArgumentError, match="host_bytes"):
        strata.ExpertCache(slot_bytes=8192, device_slots=2, host_bytes=1 << 20, runtime=rt)
    with pytest.raises(strata.InvalidArgumentError, match="host_bytes is needed"):
        strata.ExpertCache(slot_bytes=8192, device_slots=2)
    with pytest.raises(strata.OutOfCapacityError):
        strata.ExpertCache(slot_bytes=8192, device_slots=64, runtime=rt)


def test_the_gpu_script_runs_dry_on_the_cpu(tmp_path):
    """benches/peers/moe_gpu.py, which a lent GPU runs (benches/gpu-check.sh),
    dry-run on the CPU at a tiny size: every configuration generates the
    device run's tokens, and the report carries the roofline; its traces'
    temporary folder is gone after."""
    out = tmp_path / "gpu.json"
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("strata-moe-gpu-*"))
    p = subprocess.run(
        [sys.executable, str(ROOT / "benches/peers/moe_gpu.py"), "--device", "cpu", "--dtype", "float32",
         "--hidden", "64", "--intermediate", "128", "--layers", "3", "--experts", "6", "--vocab", "128",
         "--new-tokens", "4", "--trials", "1", "--fractions", "0.5", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    runs = {x["config"]: x for x in r["runs"]}
    assert set(runs) == {"device", "strata", "strata-nopf", "accelerate"}
    for c in ("strata", "strata-nopf", "accelerate"):
        assert "error" not in runs[c], runs[c]
        assert runs[c]["tokens_identical"], c
    assert runs["strata"]["device_slots"] == 9
    assert r["roofline"]["0.5"]["belady_misses"] > 0
    assert set(tmp.glob("strata-moe-gpu-*")) <= before
