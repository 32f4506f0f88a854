"""strata.moe against the engines a user would pick to run a MoE model
whose experts do not fit in the memory given: accelerate's disk offload,
the experts memory-mapped from their safetensors file (the page cache as
the cache, what llama.cpp does by default) and llama.cpp itself, on a tiny
random Mixtral, at the disk's roofline.

Configurations, each generating --new-tokens greedy tokens for the same
batch of prompts, each in its own process and memory cgroup, interleaved
over --trials (a different order each trial):
  dram          the whole model in DRAM (transformers' from_pretrained, no
                limit): the torch engines' ceiling;
  accelerate@F  accelerate's load_checkpoint_and_dispatch (strict=True),
                the experts of the first F of the layers on "cpu", the rest
                on "disk" (its offload folder), main device cpu;
  mmap@F        the model without its experts loaded from the checkpoint,
                each layer's expert tensors views of the safetensors file
                memory-mapped read-only (no copy, no advice): every expert
                read is a page-cache hit or a fault;
  strata@F      the model without its experts, then strata.moe.offload(
                checkpoint=..., max_memory={0: slots, "cpu": host},
                offload_folder=...): F of the experts' bytes as simulated
                device slots, the slack less --strata-buffers MiB as the
                host tier (whole experts, at least one), the rest on NVMe;
                lookahead prefetch. The 176 MiB left by default hold the
                runtime's own buffers (about 16 MiB) and what torch's expert
                arithmetic needs beyond the probe's footprint (about 60 MiB
                in bfloat16), with room to spare: at a slack of 256 MiB a
                host tier leaving 64 MiB (float32) or 128 MiB (bfloat16)
                thrashed the process's own pages;
  strata-nopf@F the same without the lookahead;
  strata-slots@F strata with every expert read through a device slot
                (host_in_place=False: an expert in the host tier is
                copied into a slot, as on a GPU), to compare with strata,
                which reads the host tier's experts where they are (the
                default on a CPU);
  llama-dram    llama.cpp (llama-cpp-python, benches/peers/moe_llamacpp.py)
                on a GGUF of the same checkpoint (f32 for float32, f16 for
                bfloat16), mmap as llama.cpp's default, no limit;
  llama@F       the same under the limit.

The limit of an F configuration is the same for every engine: its engine's
non-expert footprint (the torch probe: a process that loads everything but
the experts and generates with their output zeroed, its cgroup's rss +
mapped_file after generating, in the second of two probes: the first,
on a cold machine, charges torch's libraries to its own cgroup, which no
later run does; for llama.cpp, llama-dram's rss +
mapped_file less the GGUF's expert bytes), plus F of the experts' bytes,
plus --slack MiB for the engine's own buffers (stated once, the same for
all; an engine caching through the page cache uses what its buffers leave
of it as cache; strata's host tier may, with --strata-buffers). The process sets it on its own cgroup once it has loaded (loaders
read whole files and are killed under the limit while loading). The page
cache is not dropped between runs unless --drop-caches.

Reported per configuration: tokens/s (median of the trials, the spread as
(max - min) / median, flagged above 30%, i.e. beyond +-15%), the fraction
of the roofline and of the engine's own in-DRAM speed, bytes read and
written per generated token (/proc/self/io over generate), the cgroup's
failcnt, major faults and file refaults over generate, a thrash flag (strata,
which reads its experts with O_DIRECT, taking major faults all the same:
the limit evicted the process's own pages; "—" for the engines whose
expert reads are page faults: accelerate's disk offload through
np.memmap, the memory-mapped experts, llama.cpp), strata's hit
rate, reads ahead, stall and per-step breakdown, and whether the tokens
equal the engine's in-DRAM tokens.

The roofline, measured in the same run: each trial first measures the
disk's read bandwidth at the runtime's page size (`strata bench io
--pattern randread --bs PAGE --qd 8` on a file of the experts' size in
DIR) and the rate of a copy between host buffers of an expert's size
(numpy, sources not in cache); the routing strata@F recorded in its first
trial is replayed with `strata bench moe --routing file: --device-slots S
--host-experts H --nvme-gbps BW --link-gbps COPY`: the library's own cache
on strata's device slots and host tier (the experts registered first, the
rest on NVMe), a move from NVMe modelled at the disk's bandwidth and one
from host memory at the copy's — the model's stall — and Belady's misses
(and its stall bound) with as many slots as strata holds experts in DRAM,
the device slots and the host tier (an expert in either is no disk read).
The roofline at the device slots alone, as F of the experts would give
it, is reported beside it. The same replay runs again on each strata@F run's
own rates — the disk as strata's reads got it (the bytes its NVMe tier
read over the time it had reads in flight: ExpertCache.nvme_stats()) and
each layer's time between fetches as that run spent it — against that
run's measured stall (every trial records its routing): the disk's rate drifts within a run by more than the
model's error, and this replay separates the two. A step's roofline time
is the in-DRAM step (dram's median) overlapped with reading Belady's
misses at that bandwidth: the larger of the two; tokens/s of the roofline
= batch / that.

Set-up (not run by CI): as root on Linux with the cgroup v1 memory
controller mounted at /sys/fs/cgroup/memory; a Python with torch,
transformers, accelerate and safetensors (tests/run.sh makes target/pyenv)
and the strata package importable (`pip install ./python`); `cargo build
--release -p strata-bench` for target/release/strata; for the llama.cpp
configurations, the venv moe_llamacpp.py's docstring makes (--llama-python;
they are skipped without it). Run from the repository root:
  python benches/peers/moe_vs_peers.py --work DIR [--dtype float32|bfloat16]
      [--trials 3] [--slack 256] [--fractions 0.25,0.5] [--new-tokens 32]
      [--layers 8 --experts 8 --hidden 1024 --intermediate 512] [--json OUT]
Every torch configuration runs with --torch-threads threads (1 by default:
on a 2-core machine torch's default of one per core is slower for this
small batch even in DRAM, and a core is left for I/O, to every engine
alike); llama.cpp runs with one thread per core, its default.
DIR holds the checkpoint (about 0.5 GB in float32 at the defaults: 64
experts of 6 MiB), the GGUF, the offload folders, the io file and the
traces.
"""

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cgroups import Group, apply_limit, cgroup_stat, drop_caches, memory_counters, proc_io

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float32": "f32", "bfloat16": "f16"}  # the GGUF llama.cpp gets for each
MIB = 1 << 20


# -- worker side (one configuration, its own process) ----------------------


def config_of(meta):
    from transformers import MixtralConfig

    return MixtralConfig(**meta["config"])


def torch_dtype(meta):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[meta["dtype"]]


def load_prompts(work):
    import torch

    p = json.loads((work / "prompts.json").read_text())
    return torch.tensor(p, dtype=torch.long)


def checkpoint_files(ckpt):
    return sorted(ckpt.glob("*.safetensors"))


def non_expert_state(ckpt):
    from safetensors import safe_open

    sd = {}
    for f in checkpoint_files(ckpt):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if ".mlp.experts." not in k:
                    sd[k] = h.get_tensor(k)
    return sd


def empty_model(meta, ckpt):
    """The model without its experts' weights (on the meta device)."""
    import accelerate
    from transformers import MixtralForCausalLM

    import torch

    # Built in the checkpoint's dtype, as from_pretrained builds it.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(meta))
    try:
        with accelerate.init_empty_weights():
            m = MixtralForCausalLM(config_of(meta))
    finally:
        torch.set_default_dtype(default)
    m.set_experts_implementation("eager")
    missing, unexpected = m.load_state_dict(non_expert_state(ckpt), strict=False, assign=True)
    # Not a silent strict=False: exactly the experts are left out.
    bad = [k for k in missing if ".mlp.experts." not in k]
    if bad or unexpected:
        raise SystemExit(f"checkpoint mismatch: missing {bad[:3]}, unexpected {unexpected[:3]}")
    return m.eval()


def mapped_experts(m, ckpt):
    """Sets every experts module's tensors to read-only views of the
    safetensors file, memory-mapped (no copy: reads fault pages in through
    the page cache). Returns the maps (kept open while the model runs)."""
    import warnings

    import torch
    from torch import nn

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    maps, views = [], {}
    for f in checkpoint_files(ckpt):
        with open(f, "rb") as h:
            n = int.from_bytes(h.read(8), "little")
            header = json.loads(h.read(n))
            mm = mmap.mmap(h.fileno(), 0, access=mmap.ACCESS_READ)
        maps.append(mm)
        base = 8 + n
        for name, info in header.items():
            if ".mlp.experts." not in name:
                continue
            a, b = info["data_offsets"]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only buffer: torch warns, we never write
                t = torch.frombuffer(mm, dtype=dtypes[info["dtype"]], count=(b - a) // dtypes[info["dtype"]].itemsize,
                                     offset=base + a)
            views[name] = t.view(info["shape"])
    for i, layer in enumerate(m.model.layers):
        ex = layer.mlp.experts
        for part in ("gate_up_proj", "down_proj"):
            setattr(ex, part, nn.Parameter(views[f"model.layers.{i}.mlp.experts.{part}"], requires_grad=False))
    return maps


class ExpertTimer:
    """Wall time inside the experts modules (the model's own, in DRAM)."""

    def __init__(self, m):
        self.seconds = 0.0
        self._t = 0.0
        for layer in m.model.layers:
            layer.mlp.experts.register_forward_pre_hook(self._pre)
            layer.mlp.experts.register_forward_hook(self._post)

    def _pre(self, *_):
        self._t = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._t


def generate(m, ids, n):
    import torch

    before, mem0 = proc_io(), memory_counters()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = m.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    dt = time.perf_counter() - t0
    after, mem1 = proc_io(), memory_counters()
    new = out[:, ids.shape[1] :]
    return {
        "seconds": dt,
        "tokens": new.tolist(),
        "generated": new.numel(),
        "steps": n,
        "tokens_per_s": new.numel() / dt,
        "read_bytes": after["read_bytes"] - before["read_bytes"],
        "write_bytes": after["write_bytes"] - before["write_bytes"],
        **{k: mem1[k] - mem0[k] for k in mem0},
    }


def prepare(args, work, ckpt):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        # At the default 0.02 a random model repeats one token and
        # routes nearly every step to the same experts.
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    m = MixtralForCausalLM(MixtralConfig(**cfg)).to({"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype])
    # Fused expert tensors under their module names, which accelerate's
    # loader maps (the original format splits them per expert).
    m.save_pretrained(ckpt, save_original_format=False)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=g)
    (work / "prompts.json").write_text(json.dumps(ids.tolist()))
    elt = 4 if args.dtype == "float32" else 2
    eb = 3 * args.hidden * args.intermediate * elt
    meta = {"config": cfg, "dtype": args.dtype, "expert_bytes": eb, "experts_total": args.layers * args.experts,
            "batch": args.batch}
    (work / "meta.json").write_text(json.dumps(meta))
    print(json.dumps({"ok": True}))


def worker(args):
    import torch

    work = Path(args.work)
    ckpt = work / "ckpt"
    torch.manual_seed(0)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.worker == "prepare":
        return prepare(args, work, ckpt)
    meta = json.loads((work / "meta.json").read_text())
    dtype = torch_dtype(meta)
    ids = load_prompts(work)
    name, frac = args.worker, args.fraction
    t_load = time.perf_counter()
    extra, timer, moe, maps = {}, None, None, None
    if name == "probe":
        m = empty_model(meta, ckpt)

        class Zero(torch.nn.Module):
            def forward(self, h, idx, w):
                return torch.zeros_like(h)

        for layer in m.model.layers:
            layer.mlp.experts = Zero()
    elif name == "dram":
        from transformers import MixtralForCausalLM

        m = MixtralForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
        m.set_experts_implementation("eager")
        timer = ExpertTimer(m)
    elif name == "mmap":
        m = empty_model(meta, ckpt)
        maps = mapped_experts(m, ckpt)
    elif name == "accelerate":
        import accelerate
        from transformers import MixtralForCausalLM

        with accelerate.init_empty_weights():
            m = MixtralForCausalLM(config_of(meta))
        m.set_experts_implementation("eager")
        layers = meta["config"]["num_hidden_layers"]
        in_dram = round(frac * layers)
        dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        for i in range(layers):
            for part in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate"):
                dmap[f"model.layers.{i}.{part}"] = "cpu"
            dmap[f"model.layers.{i}.mlp.experts"] = "cpu" if i < in_dram else "disk"
        off = work / f"offload-{os.getpid()}"
        m = accelerate.load_checkpoint_and_dispatch(
            m, str(ckpt), device_map=dmap, offload_folder=str(off), strict=True, dtype=dtype
        ).eval()
        extra["experts_in_dram_layers"] = in_dram
    elif name in ("strata", "strata-nopf", "strata-slots"):
        import strata.moe

        m = empty_model(meta, ckpt)
        eb = meta["expert_bytes"]
        slots = int(frac * meta["experts_total"])
        nvme = work / f"nvme-{os.getpid()}"
        nvme.mkdir(exist_ok=True)
        trace = work / f"route-{name}-{frac}-{args.trial}.txt"
        # One budget in accelerate's words: F of the experts as device slots,
        # the limit's slack less strata's own buffers as the host tier.
        moe = strata.moe.offload(
            m,
            max_memory={0: slots * eb, "cpu": max(eb, args.strata_host)},
            offload_folder=nvme,
            checkpoint=ckpt,
            prefetch=(name != "strata-nopf"),
            max_prefetch=args.max_prefetch or None,
            record_routing=trace,
            host_in_place=False if name == "strata-slots" else None,
        )
        page, expert = moe.layout["page_size"], moe.layout["expert_bytes"]
        extra.update(device_slots=moe.cache.device_slots, trace=str(trace) if trace else None,
                     layout_expert_bytes=expert, page_size=page,
                     host_in_place=moe.layout["host_in_place"],
                     host_experts=max(eb, args.strata_host) // (-(-expert // page) * page))
    else:
        raise SystemExit(f"unknown configuration {name}")
    load_s = time.perf_counter() - t_load
    if args.limit:
        extra.update(apply_limit(args.limit))
    nvme0 = moe.cache.nvme_stats() if moe is not None else None
    r = generate(m, ids, args.new_tokens)
    if nvme0 is not None:
        # The disk's rate as strata's reads got it during the run: the
        # bytes read over the time its NVMe tier had reads in flight.
        nvme1 = moe.cache.nvme_stats()
        r.update(nvme_read_bytes=nvme1["bytes_read"] - nvme0["bytes_read"],
                 nvme_busy_seconds=nvme1["busy_seconds"] - nvme0["busy_seconds"])
    if name == "probe":
        # What the process holds once it has run: its anonymous memory and
        # the file pages it maps (torch's libraries), not the page cache it
        # left behind, which the kernel reclaims under a limit.
        st = cgroup_stat()
        r["resident_bytes"] = st["rss"] + st["mapped_file"]
    if timer is not None:
        r["expert_seconds"] = timer.seconds
    r.update(extra, config=name, fraction=frac, load_seconds=load_s)
    if moe is not None:
        moe.close()
        s = moe.stats()
        t = s["total"]
        r.update(
            hit_rate=t["hit_rate"],
            reads_ahead=t["reads_ahead"],
            prefetch_accuracy=t["prefetch_accuracy"],
            stall_seconds=t["stall_seconds"],
            prefetch_call_seconds=t["prefetch_call_seconds"],
            modelled_stall_seconds=t["modelled_stall_seconds"],
            bytes_moved_per_token=t["bytes_moved"] / s["tokens"],
            fetches=t["fetches"],
            moves=t["moves"],
            moves_from_nvme=t["moves_from_nvme"],
            host_swaps=t["host_swaps"],
            served_in_place=t["served_in_place"],
            breakdown=s["breakdown"],
            layer_stall_seconds=[x["stall_seconds"] for x in s["layers"]],
            layer_moves_from_nvme=[x["moves_from_nvme"] for x in s["layers"]],
            strata_steps=s["steps"],
            strata_tokens=s["tokens"],
        )
    del maps
    print("RESULT " + json.dumps(r))


# -- driver side -----------------------------------------------------------


def llama_cmd(args, work, meta, limit):
    gguf = work / f"model-{DTYPES[meta['dtype']]}.gguf"
    return [args.llama_python, str(Path(__file__).with_name("moe_llamacpp.py")), "--ckpt", str(work / "ckpt"),
            "--meta", str(work / "meta.json"), "--prompts", str(work / "prompts.json"), "--gguf", str(gguf),
            "--dtype", DTYPES[meta["dtype"]], "--new-tokens", str(args.new_tokens), "--threads", str(os.cpu_count()),
            "--limit", str(limit or 0)]


def run_worker(args, work, meta, name, frac, trial, limit):
    if name.startswith("llama"):
        cmd = llama_cmd(args, work, meta, limit)
    else:
        cmd = [sys.executable, __file__, "--worker", name, "--fraction", str(frac), "--trial", str(trial),
               "--work", str(work), "--new-tokens", str(args.new_tokens), "--limit", str(limit or 0),
               "--torch-threads", str(args.torch_threads), "--max-prefetch", str(args.max_prefetch),
               "--strata-host", str(max(0, (args.slack - args.strata_buffers) * MIB))]
    # Every configuration in a cgroup of its own (for its peak); the worker
    # sets the limit once it has loaded.
    dropped = drop_caches() if args.drop_caches else False
    # The model files leave the page cache first: a page is charged to the
    # cgroup that faults it in, so pages cached by an earlier process would
    # serve a memory-mapped engine outside its limit.
    for f in list((work / "ckpt").glob("*.safetensors")) + list(work.glob("*.gguf")):
        uncache(f)
    with Group(f"strata-moe-peer-{os.getpid()}-{name}-{frac}-{trial}") as group:
        t0 = time.perf_counter()
        p = subprocess.run(group.wrap(cmd), capture_output=True, text=True)
        wall = time.perf_counter() - t0
    res = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    if res is None:
        res = {"error": f"rc {p.returncode}: {p.stderr.strip()[-800:]}"}
    res.update(config=name, fraction=frac, trial=trial, limit_bytes=limit, cgroup_peak_bytes=group.peak,
               cgroup_failcnt=group.failcnt, process_wall_seconds=wall, page_cache_dropped=dropped)
    # Cleaned up after each run: they are made afresh by the next.
    for d in work.glob("nvme-*"):
        subprocess.run(["rm", "-rf", str(d)])
    for d in work.glob("offload-*"):
        subprocess.run(["rm", "-rf", str(d)])
    return res


def uncache(path):
    """Drops `path`'s clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def median_of(runs, key):
    """The median of `key` over runs, None where any run lacks it."""
    values = [r.get(key) for r in runs]
    return None if any(v is None for v in values) else statistics.median(values)


def strata_page(meta):
    """The page strata.moe picks for these experts (by its own rule), at
    which the disk's bandwidth is measured."""
    from strata.moe import _page_for

    elt = 4 if meta["dtype"] == "float32" else 2
    h, i = meta["config"]["hidden_size"], meta["config"]["intermediate_size"]
    return _page_for(2 * i * h * elt, i * h * elt)


def disk_bandwidth(args, work, experts_bytes, page):
    """The disk's random read bandwidth at the runtime's page, bytes/s, on
    a file of the experts' size in `work` (strata bench io, O_DIRECT)."""
    out = work / "io.json"
    size = max(64, -(-experts_bytes // MIB))
    cmd = [args.strata_bin, "bench", "io", "--path", str(work / "io.bin"), "--size", f"{size}M", "--pattern", "randread",
           "--bs", f"{page // 1024}k", "--qd", "8", "--seconds", str(args.io_seconds), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return {"error": p.stderr.strip()[-300:], "command": " ".join(cmd)}
    bw = json.loads(out.read_text())["bytes_per_sec"]
    return {"bytes_per_second": bw, "command": " ".join(cmd)}


def host_copy_rate(expert_bytes, n=16, repeats=5):
    """Bytes/s of a copy of an expert between host buffers (numpy; each
    source copied once a round, the sources together beyond the CPU's
    caches): the link a move from strata's host tier into a simulated
    device slot crosses."""
    import numpy as np
    src = [np.full(expert_bytes, i, dtype=np.uint8) for i in range(n)]
    dst = [np.zeros(expert_bytes, dtype=np.uint8) for _ in range(n)]
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for a, b in zip(src, dst):
            np.copyto(b, a)
        rates.append(n * expert_bytes / (time.perf_counter() - t))
    return statistics.median(rates)


def label(r):
    return r["config"] if r["config"] in ("dram", "llama-dram") else f"{r['config']}@{r['fraction']:g}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--slack", type=int, default=256, help="MiB over each engine's footprint and budget, for all alike")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--configs", default="accelerate,mmap,strata,strata-nopf,llama")
    ap.add_argument("--strata-bin", default=str(ROOT / "target/release/strata"))
    ap.add_argument("--llama-python", default=str(ROOT / "target/llamaenv/bin/python"))
    ap.add_argument("--io-seconds", type=int, default=3)
    ap.add_argument("--strata-buffers", type=int, default=176,
                    help="MiB of the slack strata leaves for its own buffers; the rest is its host tier")
    ap.add_argument("--strata-host", type=int, default=0)
    ap.add_argument("--max-prefetch", type=int, default=0,
                    help="experts strata prefetches per layer (0: strata.moe's default, the router's top-k)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's threads in every torch configuration, DRAM included (0: torch's default); "
                         "on a 2-core machine one is faster for this model in DRAM too")
    ap.add_argument("--json")
    ap.add_argument("--resume", action="store_true",
                    help="keep DIR/runs.jsonl and the probes' limits; run only what is missing")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before each run (then every run re-reads torch's libraries)")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the report from DIR/runs.jsonl (runs finished so far)")
    ap.add_argument("--worker")
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--trial", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "meta.json").exists():
        p = subprocess.run([sys.executable, __file__, "--worker", "prepare", "--work", str(work), "--dtype", args.dtype,
                            "--layers", str(args.layers), "--experts", str(args.experts),
                            "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
                            "--vocab", str(args.vocab), "--batch", str(args.batch),
                            "--prompt-len", str(args.prompt_len), "--seed", str(args.seed)])
        if p.returncode:
            raise SystemExit("prepare failed")
    meta = json.loads((work / "meta.json").read_text())
    if meta["dtype"] != args.dtype:
        raise SystemExit(f"{work} holds a {meta['dtype']} model; use another --work for {args.dtype}")
    experts_bytes = meta["expert_bytes"] * meta["experts_total"]
    fractions = [float(f) for f in args.fractions.split(",")]
    configs = args.configs.split(",")
    unknown = set(configs) - {"accelerate", "mmap", "strata", "strata-nopf", "strata-slots", "llama"}
    if unknown:
        raise SystemExit(f"unknown configurations: {', '.join(sorted(unknown))}")
    if "llama" in configs and not Path(args.llama_python).exists():
        print(f"no {args.llama_python}: the llama.cpp configurations are skipped", flush=True)
        configs.remove("llama")
    llama = "llama" in configs
    runs_path, probe_path = work / "runs.jsonl", work / "probes.json"
    if args.report_only:
        runs = [json.loads(x) for x in runs_path.read_text().splitlines()]
        return report(args, work, meta, json.loads(probe_path.read_text()), runs, fractions, experts_bytes)
    if args.resume and probe_path.exists():
        probes = json.loads(probe_path.read_text())
        done = [json.loads(x) for x in runs_path.read_text().splitlines()]
    else:
        # Twice: the first run of a cold machine reads torch's libraries
        # into the page cache itself, and their pages are charged to its
        # cgroup (its mapped_file); every later run finds them charged to
        # another. The second probe measures what the runs will hold.
        probes = {"torch": run_worker(args, work, meta, "probe", 1.0, -1, None)}
        if "error" not in probes["torch"]:
            probes["torch"] = run_worker(args, work, meta, "probe", 1.0, 0, None)
        if "error" in probes["torch"]:
            raise SystemExit(f"probe failed: {probes['torch']['error']}")
        probes["torch_base_bytes"] = probes["torch"]["resident_bytes"]
        if llama:
            # llama.cpp's own footprint: its in-DRAM run holds the whole GGUF
            # mapped; less the experts' bytes in it, what it needs besides.
            lp = run_worker(args, work, meta, "llama-dram", 1.0, -1, None)
            if "error" in lp:
                raise SystemExit(f"llama.cpp probe failed: {lp['error']}")
            # The GGUF's experts take the checkpoint's bytes (f32 for float32,
            # f16 for bfloat16).
            gguf_expert_bytes = experts_bytes
            probes["llama"] = lp
            probes["llama_base_bytes"] = max(0, lp["rss_bytes"] - gguf_expert_bytes)
        probes["slack_bytes"] = args.slack * MIB
        probe_path.write_text(json.dumps(probes))
        runs_path.write_text("")
        done = []
    slack = probes["slack_bytes"]
    print(f"{meta['dtype']}: {meta['experts_total']} experts x {meta['expert_bytes'] / MIB:.1f} MiB = "
          f"{experts_bytes / MIB:.0f} MiB; torch footprint {probes['torch_base_bytes'] / MIB:.0f} MiB"
          + (f", llama.cpp footprint {probes['llama_base_bytes'] / MIB:.0f} MiB" if llama else "")
          + f"; slack {slack / MIB:.0f} MiB", flush=True)
    runs = list(done)

    def record(r):
        runs.append(r)
        with open(runs_path, "a") as f:
            f.write(json.dumps(r) + "\n")

    for trial in range(args.trials):
        if not any(r["config"] == "io" and r["trial"] == trial for r in done):
            io = disk_bandwidth(args, work, experts_bytes, strata_page(meta))
            io.update(config="io", fraction=1.0, trial=trial,
                      copy_bytes_per_second=host_copy_rate(meta["expert_bytes"]))
            record(io)
            print(f"trial {trial} disk: " + (f"{io['bytes_per_second'] / 1e9:.2f} GB/s" if "error" not in io
                                              else io["error"]), flush=True)
        order = [("dram", 1.0)] + ([("llama-dram", 1.0)] if llama else [])
        order += [(c, f) for f in fractions for c in configs]
        # Interleaved, in a different order each trial.
        order = order[trial % len(order):] + order[: trial % len(order)]
        for name, frac in order:
            if any(r["config"] == name and r["fraction"] == frac and r["trial"] == trial for r in done):
                continue
            base = probes["llama_base_bytes"] if name.startswith("llama") else probes["torch_base_bytes"]
            limit = None if name.endswith("dram") else base + int(frac * experts_bytes) + slack
            r = run_worker(args, work, meta, name, frac, trial, limit)
            record(r)
            msg = r.get("error") or (f"{r['tokens_per_s']:.2f} tok/s, read {r['read_bytes'] / r['generated'] / MIB:.1f} "
                                     f"MiB/token, wrote {r.get('write_bytes', 0) / r['generated'] / MIB:.1f}, "
                                     f"majflt {r.get('major_faults')}, failcnt {r['cgroup_failcnt']}")
            print(f"trial {trial} {label(r)}: {msg}", flush=True)

    report(args, work, meta, probes, runs, fractions, experts_bytes)


def belady(args, work, meta, r, bw, layer_seconds, slots, host=0, copy_bw=None, tag="", other_seconds=0.0):
    """strata bench moe on the routing `r` recorded, each layer's experts'
    compute `layer_seconds` after `other_seconds` of the layer's attention
    and router (before its experts are known): with a host tier of `host` experts, the
    library's cache on `slots` device slots and that host tier, a move from
    NVMe at the measured disk bandwidth `bw` and one from host memory at
    `copy_bw` (the model), and Belady's misses at slots + host read at
    `bw`; without one, both at `slots` with every move at `bw`."""
    out = work / (Path(r["trace"]).stem + f"-bench-{slots}" + (f"-host-{host}" if host else "") + tag + ".json")
    if host:
        nvme = work / "bench-nvme"
        nvme.mkdir(exist_ok=True)
        links = ["--host-experts", str(host), "--nvme-gbps", f"{bw / 1e9:.3f}", "--path", str(nvme),
                 "--link-gbps", f"{copy_bw / 1e9:.3f}"]
    else:
        links = ["--link-gbps", f"{bw / 1e9:.3f}"]
    if host and r.get("host_in_place"):
        links.append("--host-in-place")
    cmd = [args.strata_bin, "bench", "moe", "--routing", f"file:{r['trace']}",
           "--expert-bytes", str(r["layout_expert_bytes"]), "--device-slots", str(slots), *links,
           "--page-size", str(r["page_size"]),
           "--layer-compute-us", f"{layer_seconds * 1e6:.1f}",
           "--layer-other-us", f"{other_seconds * 1e6:.1f}",
           # strata.moe's default: a prefetch is protected for twice the
           # router's top-k fetches (the trace's steps route more experts).
           "--protect-fetches", str(2 * meta["config"]["num_experts_per_tok"]),
           "--quiet", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return {"error": p.stderr.strip()[-500:], "command": " ".join(cmd)}
    b = json.loads(out.read_text())
    res, bd = b["results"][0], b["bounds"]
    steps = len({line.split()[0] for line in Path(r["trace"]).read_text().splitlines() if line and line[0] != "#"})
    fetches = res.get("fetches") or r["fetches"]
    misses = fetches * (1.0 - bd["belady_hit_rate"])
    return {
        "command": " ".join(cmd),
        "slots": slots + host,
        "steps": steps,
        "belady_hit_rate": bd["belady_hit_rate"],
        "belady_miss_bytes_per_step": misses * r["layout_expert_bytes"] / steps,
        "belady_stall_seconds": bd["belady_stall_seconds"],
        "belady_prefetch_stall_floor_seconds": bd["belady_prefetch_stall_floor_seconds"],
        "bench_modelled_stall_seconds": res["stall_seconds"],
        "bench_hit_rate": res["hit_rate"],
    }


def step_bound(batch, dram, bw, b):
    """A step's roofline: the in-DRAM step or reading Belady's misses `b`,
    whichever is longer."""
    read = b["belady_miss_bytes_per_step"] / bw
    step = max(batch / dram, read)
    return {"tokens_per_s": batch / step, "dram_step_seconds": batch / dram, "read_step_seconds": read,
            "slots": b["slots"], "belady_hit_rate": b["belady_hit_rate"],
            "bound": "compute" if batch / dram >= read else "disk"}


def spread(xs):
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else 0.0


def report(args, work, meta, probes, runs, fractions, experts_bytes):
    ios = [r["bytes_per_second"] for r in runs if r["config"] == "io" and "bytes_per_second" in r]
    bw = statistics.median(ios) if ios else None
    copies = [r["copy_bytes_per_second"] for r in runs if r["config"] == "io" and "copy_bytes_per_second" in r]
    copy_bw = statistics.median(copies) if copies else host_copy_rate(meta["expert_bytes"])
    groups = {}
    for r in runs:
        if r["config"] != "io":
            groups.setdefault(label(r), []).append(r)
    ref = {}
    for eng, key in (("torch", "dram"), ("llama", "llama-dram")):
        ok = [r for r in groups.get(key, []) if "error" not in r]
        ref[eng] = ok[0]["tokens"] if ok else None
    table = {}
    for k, rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        row = {"trials": len(rs), "failed": len(rs) - len(ok)}
        if ok:
            tps = [r["tokens_per_s"] for r in ok]
            eng = "llama" if k.startswith("llama") else "torch"
            # strata reads its experts with O_DIRECT reads; accelerate's
            # disk offload (np.memmap), the memory-mapped experts and
            # llama.cpp read theirs through page faults.
            reads_experts = k.split("@")[0] in ("strata", "strata-nopf", "strata-slots")
            row.update(
                tokens_per_s=statistics.median(tps),
                tokens_per_s_all=[round(x, 3) for x in tps],
                spread=spread(tps),
                read_mib_per_token=statistics.median(r["read_bytes"] / r["generated"] for r in ok) / MIB,
                write_mib_per_token=(statistics.median(r["write_bytes"] / r["generated"] for r in ok) / MIB
                                     if all(r.get("write_bytes") is not None for r in ok) else None),
                tokens_identical=all(r["tokens"] == ref[eng] for r in ok) if ref[eng] else None,
                limit_mib=ok[0]["limit_bytes"] / MIB if ok[0]["limit_bytes"] else None,
                peak_mib=(statistics.median(r["cgroup_peak_bytes"] for r in ok) / MIB
                          if ok[0]["cgroup_peak_bytes"] else None),
                # A count a run could not read is missing, not zero.
                failcnt=median_of(ok, "cgroup_failcnt"),
                major_faults=median_of(ok, "major_faults"),
                refaults=median_of(ok, "refaults"),
            )
            # An engine that reads its experts itself takes no major fault
            # unless the limit evicted its own pages (code, libraries); for
            # one whose expert reads are faults the count cannot tell (None).
            row["thrash"] = (
                bool(ok[0]["limit_bytes"] and row["major_faults"] > 100)
                if reads_experts and row["major_faults"] is not None
                else None
            )
            row["spread_flag"] = row["spread"] > 0.30
            own = [r["nvme_read_bytes"] / r["nvme_busy_seconds"] for r in ok if r.get("nvme_busy_seconds")]
            if own:
                row["disk_bytes_per_second_own"] = statistics.median(own)
            for key in ("hit_rate", "reads_ahead", "prefetch_accuracy", "stall_seconds", "prefetch_call_seconds",
                        "moves", "moves_from_nvme", "host_swaps", "served_in_place",
                        "modelled_stall_seconds", "bytes_moved_per_token", "expert_seconds"):
                vals = [r[key] for r in ok if r.get(key) is not None]
                if vals:
                    row[key] = statistics.median(vals)
            if ok[0].get("breakdown"):
                row["breakdown"] = {b: statistics.median(r["breakdown"][b] / r["strata_steps"] for r in ok)
                                    for b in ok[0]["breakdown"]}
        table[k] = row

    # The roofline per fraction: the in-DRAM step overlapped with reading
    # Belady's misses (of strata's own routing, at as many slots as it holds
    # experts in DRAM) at the disk's measured bandwidth; beside it the same
    # at its device slots alone.
    dram = table.get("dram", {}).get("tokens_per_s")
    batch = meta["batch"]
    roofline, bounds = {}, {}
    for f in fractions:
        traced = sorted((r for r in runs if r["config"] == "strata" and r["fraction"] == f and r.get("trace")
                         and "error" not in r), key=lambda r: r["trial"])
        rec = traced[0] if traced else None
        if rec is None or bw is None or dram is None:
            continue
        layers = meta["config"]["num_hidden_layers"]
        layer = batch / dram / layers
        # The in-DRAM step's layer: its experts' share (timed in that run)
        # after the rest (attention, norms, the router).
        experts_share = table["dram"].get("expert_seconds")
        dram_steps = next((r["steps"] for r in groups["dram"] if "error" not in r), None)
        if experts_share is not None and dram_steps:
            compute = min(layer, experts_share / dram_steps / layers)
        else:
            compute = layer
        host = rec.get("host_experts", 0)
        b = belady(args, work, meta, rec, bw, compute, rec["device_slots"], host, copy_bw,
                   other_seconds=layer - compute)
        bounds[f"{f:g}"] = b
        if "error" in b:
            continue
        roofline[f"{f:g}"] = roof = step_bound(batch, dram, bw, b)
        # The model again on each run's own rates: the disk as strata's
        # reads got it (bytes over the time reads were in flight) and each
        # layer's time between fetches as the run spent it (its steps' wall
        # time less the stall), against that run's stall.
        own = []
        for t in traced:
            if not (t.get("nvme_busy_seconds") and t.get("breakdown")):
                continue
            bd = t["breakdown"]
            own_bw = t["nvme_read_bytes"] / t["nvme_busy_seconds"]
            per_layer = t["strata_steps"] * layers
            own_compute = bd["compute_seconds"] / per_layer
            own_other = (bd["wall_seconds"] - bd["stall_seconds"] - bd["compute_seconds"]) / per_layer
            o = belady(args, work, meta, t, own_bw, own_compute, t["device_slots"], host, copy_bw, tag="-own",
                       other_seconds=max(0.0, own_other))
            if "error" not in o:
                own.append({"trial": t["trial"], "disk_bytes_per_second": own_bw, "layer_seconds": own_compute,
                            "layer_other_seconds": own_other,
                            "bench_modelled_stall_seconds": o["bench_modelled_stall_seconds"],
                            "measured_stall_seconds": t["stall_seconds"],
                            "belady_stall_seconds": o["belady_stall_seconds"],
                            "modelled_over_measured": o["bench_modelled_stall_seconds"] / t["stall_seconds"]})
        if own:
            b["own_rates"] = own
        if host:
            alone = belady(args, work, meta, rec, bw, compute, rec["device_slots"], other_seconds=layer - compute)
            if "error" not in alone:
                roof["device_slots_alone"] = step_bound(batch, dram, bw, alone)
    lld = table.get("llama-dram", {}).get("tokens_per_s")
    for k, row in table.items():
        if "tokens_per_s" not in row or "@" not in k:
            continue
        f = k.split("@")[1]
        own = lld if k.startswith("llama") else dram
        row["of_own_dram"] = row["tokens_per_s"] / own if own else None
        if f in roofline and not k.startswith("llama"):
            row["of_roofline"] = row["tokens_per_s"] / roofline[f]["tokens_per_s"]
    ratios = {}
    for f in fractions:
        g = f"{f:g}"
        t = {c: table.get(f"{c}@{g}", {})
             for c in ("strata", "strata-nopf", "strata-slots", "accelerate", "mmap", "llama")}
        s = t["strata"].get("tokens_per_s")

        def over(c):
            x = t[c].get("tokens_per_s")
            return s / x if s and x else None

        b = bounds.get(g, {})
        ratios[g] = {
            "strata_of_roofline": t["strata"].get("of_roofline"),
            "strata_over_accelerate": over("accelerate"),
            "strata_over_mmap": over("mmap"),
            "lookahead_over_nopf": over("strata-nopf"),
            "in_place_over_slots": over("strata-slots"),
            "strata_of_dram_vs_llama_of_own_dram": (t["strata"].get("of_own_dram"), t["llama"].get("of_own_dram")),
            "measured_stall_over_belady": (t["strata"]["stall_seconds"] / b["belady_stall_seconds"]
                                           if t["strata"].get("stall_seconds") is not None and b.get("belady_stall_seconds")
                                           else None),
            "bench_modelled_over_measured_stall": (b["bench_modelled_stall_seconds"] / t["strata"]["stall_seconds"]
                                                   if b.get("bench_modelled_stall_seconds") is not None
                                                   and t["strata"].get("stall_seconds") else None),
            # The model on the traced run's own disk rate and layer time,
            # against that run's stall; and the disk rate strata's reads got
            # over the one `strata bench io` measured.
            "own_rates_modelled_over_measured_stall": (
                statistics.median(o["modelled_over_measured"] for o in b["own_rates"]) if b.get("own_rates") else None),
            "own_rates_modelled_over_measured_stall_per_trial": (
                [round(o["modelled_over_measured"], 3) for o in b["own_rates"]] if b.get("own_rates") else None),
            "measured_stall_over_belady_own_rates": (
                statistics.median(o["measured_stall_seconds"] / o["belady_stall_seconds"] for o in b["own_rates"])
                if b.get("own_rates") else None),
            "strata_disk_rate_over_io": (t["strata"]["disk_bytes_per_second_own"] / bw
                                         if t["strata"].get("disk_bytes_per_second_own") and bw else None),
        }
    out = {"meta": meta, "probes": probes, "disk_bytes_per_second": bw, "disk_trials": ios,
           "host_copy_bytes_per_second": copy_bw, "roofline": roofline,
           "bounds": bounds, "table": table, "ratios": ratios}
    print(json.dumps({k: out[k] for k in ("disk_bytes_per_second", "roofline", "table", "ratios")}, indent=1))
    print_markdown(meta, bw, roofline, table)
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "runs": runs}, indent=1))


def print_markdown(meta, bw, roofline, table):
    print(f"\n{meta['dtype']}, disk {bw / 1e9 if bw else float('nan'):.2f} GB/s; roofline: "
          + ", ".join(f"{f}: {r['tokens_per_s']:.2f} tok/s ({r['bound']}-bound, {r['slots']} experts in DRAM"
                      + (f"; {r['device_slots_alone']['tokens_per_s']:.2f} at the device slots alone"
                         if "device_slots_alone" in r else "") + ")"
                      for f, r in roofline.items()))
    print("| configuration | tok/s (median) | trials | spread | of roofline | of own DRAM | read MiB/tok | "
          "written MiB/tok | failcnt | major faults | refaults | thrash | tokens identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def fmt(x, p=2):
        return "—" if x is None else (f"{x:.{p}f}" if isinstance(x, float) else str(x))

    for k in sorted(table):
        r = table[k]
        if "tokens_per_s" not in r:
            print(f"| {k} | failed ({r['failed']} of {r['trials']}) |" + " |" * 11)
            continue
        print(f"| {k} | {r['tokens_per_s']:.2f} | {', '.join(f'{x:.2f}' for x in r['tokens_per_s_all'])} | "
              f"{r['spread'] * 100:.0f}%{' (!)' if r['spread_flag'] else ''} | {fmt(r.get('of_roofline'))} | "
              f"{fmt(r.get('of_own_dram'))} | {r['read_mib_per_token']:.1f} | {fmt(r['write_mib_per_token'], 1)} | "
              f"{fmt(r['failcnt'], 0)} | {fmt(r['major_faults'], 0)} | {fmt(r['refaults'], 0)} | "
              f"{fmt({True: 'yes', False: 'no'}.get(r['thrash']))} | {fmt(r['tokens_identical'])} |")


if __name__ == "__main__":
    main()
