"""strata.moe against accelerate's disk offload on a tiny random Mixtral
whose experts do not fit in the memory given.

Configurations, each generating --new-tokens greedy tokens for the same
batch of prompts, each in its own process, interleaved over --trials:
  dram          the whole model in DRAM (transformers' from_pretrained, no
                memory limit): the ceiling;
  accelerate@F  accelerate's load_checkpoint_and_dispatch (strict=True) with
                the experts of the first F of the layers on "cpu" and the
                rest on "disk" (its offload folder), main device cpu;
  strata@F      the model built under accelerate.init_empty_weights(), its
                non-expert weights loaded from the checkpoint, then
                strata.moe.offload(checkpoint=...) reading the experts into
                an ExpertCache: F of the experts' bytes as simulated device
                slots (less one expert for the host tier), the rest on an
                NVMe tier file next to the checkpoint; lookahead prefetch;
  strata-nopf@F the same without prefetch;
where F is each of --fractions; the F configurations generate under a
cgroup v1 memory limit (memory.limit_in_bytes, set by the process itself
once it has loaded: accelerate's loader reads whole checkpoint files and
is killed under the limit while loading) of what the probe holds (a process
that loads everything but the experts and generates with the experts'
output zeroed: its cgroup's rss + mapped_file after generating, i.e. not
the page cache it leaves behind) plus F of all experts' bytes. The page
cache is not dropped between runs unless --drop-caches (every run then
re-reads torch's libraries, minutes on a slow disk): the files generate
reads from — accelerate's offload folder, strata's NVMe file — are made
afresh by each run, before its limit applies, which reclaims their cached
pages down to the limit.

Reported per configuration (median over trials, and each trial): tokens/s
(of generate, loading excluded), bytes read from disk per generated token
(/proc/self/io read_bytes over generate), strata's hit rate, prefetch
accuracy and stall; and whether every configuration's tokens equal the
in-DRAM model's. Then the routing strata@F recorded in its first trial is
replayed with `strata bench moe --routing file:` and its modelled stall and
belady_stall_seconds / belady_prefetch_stall_floor_seconds are set beside
the measured one.

Set-up (not run by CI): as root on Linux with the cgroup v1 memory
controller mounted at /sys/fs/cgroup/memory; a Python with torch,
transformers, accelerate and safetensors (tests/run.sh makes target/pyenv)
and the strata package importable (PYTHONPATH to an installed wheel, or
`pip install ./python`); `cargo build --release -p strata-bench` for
target/release/strata. Run from the repository root:
  python benches/peers/moe_vs_accelerate.py --work DIR [--trials 3]
      [--layers 8 --experts 8 --hidden 1024 --intermediate 512]
      [--batch 4 --new-tokens 64] [--fractions 0.25,0.5] [--json OUT]
DIR holds the checkpoint (about 0.5 GB at the defaults: 64 experts of 6 MiB), the offload
folders and the traces.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cgroups import Group, apply_limit, cgroup_stat, drop_caches

ROOT = Path(__file__).resolve().parents[2]


# -- worker side (one configuration, its own process) ----------------------


def config_of(meta):
    from transformers import MixtralConfig

    return MixtralConfig(**meta["config"])


def proc_io():
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def load_prompts(work):
    import torch

    p = json.loads((work / "prompts.json").read_text())
    return torch.tensor(p, dtype=torch.long)


def non_expert_state(ckpt):
    from safetensors import safe_open

    sd = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if ".mlp.experts." not in k:
                    sd[k] = h.get_tensor(k)
    return sd


def empty_model(meta, ckpt):
    """The model without its experts' weights (on the meta device)."""
    import accelerate
    from transformers import MixtralForCausalLM

    with accelerate.init_empty_weights():
        m = MixtralForCausalLM(config_of(meta))
    m.set_experts_implementation("eager")
    missing, unexpected = m.load_state_dict(non_expert_state(ckpt), strict=False, assign=True)
    # Not a silent strict=False: exactly the experts are left out.
    bad = [k for k in missing if ".mlp.experts." not in k]
    if bad or unexpected:
        raise SystemExit(f"checkpoint mismatch: missing {bad[:3]}, unexpected {unexpected[:3]}")
    return m.eval()


def generate(m, ids, n):
    import torch

    before = proc_io()
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
    after = proc_io()
    new = out[:, ids.shape[1] :]
    return {
        "seconds": dt,
        "tokens": new.tolist(),
        "generated": new.numel(),
        "tokens_per_s": new.numel() / dt,
        "read_bytes": after["read_bytes"] - before["read_bytes"],
        "write_bytes": after["write_bytes"] - before["write_bytes"],
    }


def worker(args):
    import torch

    work = Path(args.work)
    ckpt = work / "ckpt"
    torch.manual_seed(0)
    if args.worker == "prepare":
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
        m = MixtralForCausalLM(MixtralConfig(**cfg))
        # Fused expert tensors under their module names, which accelerate's
        # loader maps (the original format splits them per expert).
        m.save_pretrained(ckpt, save_original_format=False)
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=g)
        (work / "prompts.json").write_text(json.dumps(ids.tolist()))
        eb = 3 * args.hidden * args.intermediate * 4
        meta = {"config": cfg, "expert_bytes": eb, "experts_total": args.layers * args.experts}
        (work / "meta.json").write_text(json.dumps(meta))
        print(json.dumps({"ok": True}))
        return
    meta = json.loads((work / "meta.json").read_text())
    ids = load_prompts(work)
    name, frac = args.worker, args.fraction
    t_load = time.perf_counter()
    extra = {}
    if name == "probe":
        m = empty_model(meta, ckpt)

        class Zero(torch.nn.Module):
            def forward(self, h, idx, w):
                return torch.zeros_like(h)

        for layer in m.model.layers:
            layer.mlp.experts = Zero()
    elif name == "dram":
        from transformers import MixtralForCausalLM

        m = MixtralForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        m.set_experts_implementation("eager")
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
            m, str(ckpt), device_map=dmap, offload_folder=str(off), strict=True
        ).eval()
        extra["experts_in_dram_layers"] = in_dram
    elif name in ("strata", "strata-nopf"):
        import strata.moe

        m = empty_model(meta, ckpt)
        eb = meta["expert_bytes"]
        budget = int(frac * meta["experts_total"])
        slots = budget - 1  # one expert's room for the host tier
        nvme = work / "nvme"
        nvme.mkdir(exist_ok=True)
        trace = work / f"route-{name}-{frac}-{args.trial}.txt" if args.trial == 0 else None
        moe = strata.moe.offload(
            m,
            device_slots=slots,
            host_bytes=eb + (2 << 20),
            nvme_path=nvme,
            checkpoint=ckpt,
            prefetch=(name == "strata"),
            record_routing=trace,
        )
        extra.update(device_slots=slots, trace=str(trace) if trace else None, layout_expert_bytes=moe.layout["expert_bytes"],
                     page_size=moe.layout["page_size"])
    else:
        raise SystemExit(f"unknown configuration {name}")
    load_s = time.perf_counter() - t_load
    if args.limit:
        extra.update(apply_limit(args.limit))
    r = generate(m, ids, args.new_tokens)
    if name == "probe":
        # What the process holds once it has run: its anonymous memory and
        # the file pages it maps (torch's libraries), not the page cache it
        # left behind, which the kernel reclaims under a limit.
        st = cgroup_stat()
        r["resident_bytes"] = st["rss"] + st["mapped_file"]
    r.update(extra, config=name, fraction=frac, load_seconds=load_s)
    if name.startswith("strata"):
        moe.close()
        s = moe.stats()
        t = s["total"]
        r.update(
            hit_rate=t["hit_rate"],
            prefetch_accuracy=t["prefetch_accuracy"],
            stall_seconds=t["stall_seconds"],
            prefetch_call_seconds=t["prefetch_call_seconds"],
            modelled_stall_seconds=t["modelled_stall_seconds"],
            bytes_moved_per_token=t["bytes_moved"] / s["tokens"],
            fetches=t["fetches"],
            steps=s["steps"],
            strata_tokens=s["tokens"],
        )
    print("RESULT " + json.dumps(r))


# -- driver side -----------------------------------------------------------


def run_worker(args, name, frac, trial, limit):
    cmd = [sys.executable, __file__, "--worker", name, "--fraction", str(frac), "--trial", str(trial),
           "--work", args.work, "--new-tokens", str(args.new_tokens), "--limit", str(limit or 0)]
    # Every configuration in a cgroup of its own (for its peak); the worker
    # sets the limit once it has loaded.
    dropped = drop_caches() if args.drop_caches else False
    with Group(f"strata-moe-peer-{os.getpid()}-{name}-{frac}-{trial}") as group:
        t0 = time.perf_counter()
        p = subprocess.run(group.wrap(cmd), capture_output=True, text=True)
        wall = time.perf_counter() - t0
    peak, failcnt = group.peak, group.failcnt
    res = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    if res is None:
        res = {"config": name, "fraction": frac, "error": f"rc {p.returncode}: {p.stderr.strip()[-800:]}"}
    res.update(trial=trial, limit_bytes=limit, cgroup_peak_bytes=peak, cgroup_failcnt=failcnt,
               process_wall_seconds=wall, page_cache_dropped=dropped)
    return res


def label(r):
    return r["config"] if r["config"] == "dram" else f"{r['config']}@{r['fraction']:g}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--configs", default="accelerate,strata,strata-nopf")
    ap.add_argument("--strata-bin", default=str(ROOT / "target/release/strata"))
    ap.add_argument("--json")
    ap.add_argument("--resume", action="store_true",
                    help="keep DIR/runs.jsonl and the probe's limits; run only what is missing")
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

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "meta.json").exists():
        p = subprocess.run([sys.executable, __file__, "--worker", "prepare", "--work", args.work,
                            "--layers", str(args.layers), "--experts", str(args.experts),
                            "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
                            "--vocab", str(args.vocab), "--batch", str(args.batch),
                            "--prompt-len", str(args.prompt_len), "--seed", str(args.seed)])
        if p.returncode:
            raise SystemExit("prepare failed")
    meta = json.loads((work / "meta.json").read_text())
    experts_bytes = meta["expert_bytes"] * meta["experts_total"]
    fractions = [float(f) for f in args.fractions.split(",")]
    configs = args.configs.split(",")
    if args.report_only:
        lines = (work / "runs.jsonl").read_text().splitlines()
        runs = [json.loads(x) for x in lines]
        probe = json.loads((work / "probe.json").read_text())
        return report(args, work, meta, probe, runs, fractions, experts_bytes)
    if args.resume and (work / "probe.json").exists():
        # The same limits as the runs already made.
        probe = json.loads((work / "probe.json").read_text())
        done = [json.loads(x) for x in (work / "runs.jsonl").read_text().splitlines()]
    else:
        probe = run_worker(args, "probe", 1.0, 0, None)
        if "error" in probe:
            raise SystemExit(f"probe failed: {probe['error']}")
        (work / "probe.json").write_text(json.dumps(probe))
        (work / "runs.jsonl").write_text("")
        done = []
    base = probe["resident_bytes"]
    print(f"experts: {meta['experts_total']} x {meta['expert_bytes'] / 2**20:.1f} MiB = {experts_bytes / 2**20:.0f} MiB; "
          f"probe: {base / 2**20:.0f} MiB resident (cgroup peak {probe['cgroup_peak_bytes'] / 2**20:.0f} MiB)", flush=True)
    runs = list(done)
    for trial in range(args.trials):
        order = [("dram", 1.0)] + [(c, f) for f in fractions for c in configs]
        # Interleaved, in a different order each trial.
        order = order[trial % len(order):] + order[: trial % len(order)]
        for name, frac in order:
            if any(r["config"] == name and r["fraction"] == frac and r["trial"] == trial for r in done):
                continue
            limit = None if name == "dram" else base + int(frac * experts_bytes)
            r = run_worker(args, name, frac, trial, limit)
            runs.append(r)
            with open(work / "runs.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
            msg = r.get("error") or f"{r['tokens_per_s']:.2f} tok/s, read {r['read_bytes'] / r['generated'] / 2**20:.1f} MiB/token"
            print(f"trial {trial} {label(r)}: {msg}", flush=True)

    report(args, work, meta, probe, runs, fractions, experts_bytes)


def report(args, work, meta, probe, runs, fractions, experts_bytes):
    base = probe["resident_bytes"]
    ref = next((r["tokens"] for r in runs if r["config"] == "dram" and "tokens" in r), None)
    summary = {}
    for r in runs:
        summary.setdefault(label(r), []).append(r)
    table = {}
    for k, rs in summary.items():
        ok = [r for r in rs if "error" not in r]
        row = {"trials": len(rs), "failed": len(rs) - len(ok)}
        if ok:
            row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ok)
            row["tokens_per_s_all"] = [round(r["tokens_per_s"], 3) for r in ok]
            row["read_mib_per_token"] = statistics.median(r["read_bytes"] / r["generated"] for r in ok) / 2**20
            row["write_mib_per_token"] = statistics.median(r["write_bytes"] / r["generated"] for r in ok) / 2**20
            row["tokens_identical"] = all(r["tokens"] == ref for r in ok)
            row["limit_mib"] = ok[0]["limit_bytes"] / 2**20 if ok[0]["limit_bytes"] else None
            row["peak_mib"] = statistics.median(r["cgroup_peak_bytes"] for r in ok if r["cgroup_peak_bytes"]) / 2**20 if ok[0]["cgroup_peak_bytes"] else None
            for key in ("hit_rate", "prefetch_accuracy", "stall_seconds", "prefetch_call_seconds",
                        "modelled_stall_seconds", "bytes_moved_per_token"):
                if key in ok[0] and ok[0][key] is not None:
                    row[key] = statistics.median(r[key] for r in ok)
        table[k] = row

    ratios = {}
    for f in fractions:
        s, a, n, d = (table.get(x, {}).get("tokens_per_s") for x in
                      (f"strata@{f:g}", f"accelerate@{f:g}", f"strata-nopf@{f:g}", "dram"))
        ratios[f"{f:g}"] = {
            "strata_over_accelerate": s / a if s and a else None,
            "strata_over_dram": s / d if s and d else None,
            "lookahead_over_nopf": s / n if s and n else None,
        }

    replays = []
    binary = Path(args.strata_bin)
    for r in runs:
        if r.get("trace") and binary.is_file():
            out = work / (Path(r["trace"]).stem + "-bench.json")
            cmd = [str(binary), "bench", "moe", "--routing", f"file:{r['trace']}",
                   "--expert-bytes", str(r["layout_expert_bytes"]), "--device-slots", str(r["device_slots"]),
                   "--page-size", str(r["page_size"]), "--quiet", "--json", str(out)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                replays.append({"run": label(r), "error": p.stderr.strip()[-500:], "command": " ".join(cmd)})
                continue
            b = json.loads(out.read_text())
            res = b["results"][0]
            bd = b["bounds"]
            replays.append({
                "run": label(r),
                "command": " ".join(cmd),
                "measured_stall_seconds": r["stall_seconds"],
                "in_run_modelled_stall_seconds": r["modelled_stall_seconds"],
                "bench_modelled_stall_seconds": res["stall_seconds"],
                "bench_hit_rate": res["hit_rate"],
                "measured_hit_rate": r["hit_rate"],
                "belady_hit_rate": bd["belady_hit_rate"],
                "belady_stall_seconds": bd["belady_stall_seconds"],
                "belady_prefetch_stall_floor_seconds": bd["belady_prefetch_stall_floor_seconds"],
                "transfer_seconds": bd["transfer_seconds"],
                "measured_over_belady": r["stall_seconds"] / bd["belady_stall_seconds"] if bd["belady_stall_seconds"] else None,
                "bench_modelled_over_measured": res["stall_seconds"] / r["stall_seconds"] if r["stall_seconds"] else None,
                "in_run_modelled_over_measured": (r["modelled_stall_seconds"] / r["stall_seconds"]
                                                  if r["stall_seconds"] and r["modelled_stall_seconds"] is not None else None),
            })

    report = {"meta": meta, "probe_resident_bytes": base, "probe": probe, "experts_bytes": experts_bytes, "table": table,
              "ratios": ratios, "replays": replays, "runs": runs}
    print(json.dumps({"table": table, "ratios": ratios, "replays": replays}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
