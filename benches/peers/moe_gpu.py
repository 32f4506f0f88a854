"""strata.moe on a GPU: a random Mixtral-shaped model whose experts do not
all fit the device budget, against the same model wholly on the device and
against accelerate's CPU offload of the experts, with the roofline of the
host-to-device link.

Configurations, one after the other in this process (the model rebuilt from
the same seed for each, the device's memory emptied between them):

  device        the whole model in device memory: its speed and the
                reference tokens.
  strata@F      strata.moe.offload(model, device_slots = F of the experts,
                host_bytes = every expert): the experts in host memory,
                F of them in device slots at once, lookahead prefetch.
  strata-nopf@F the same without the lookahead.
  accelerate@F  accelerate.dispatch_model with the experts of the first
                F of the layers on the device and the others on "cpu": its
                hooks copy an offloaded layer's experts to the device at
                every forward (the peer a user of accelerate would pick).

Reported per configuration: tokens/s (greedy decoding of --new-tokens after
a prompt, batch --batch; the median of --trials), whether the tokens equal
the device run's, and for strata the hit rate, stall and bytes moved a
token. The roofline at F: the device run's step overlapped with moving
Belady's misses (strata's own routing, at as many slots as it has) at the
host-to-device bandwidth measured here (a pinned host tensor of an expert's
size copied to the device, the median of 20); tokens/s of the roofline =
batch / max(device step, misses' bytes / bandwidth).

On a machine without a GPU, --device cpu runs the same with the model on
the CPU and strata's simulated device (a dry run of the script: every
figure is then the CPU's, not a GPU's).

    python benches/peers/moe_gpu.py --device cuda --json OUT.json
        [--layers 8 --experts 8 --hidden 4096 --intermediate 14336]
        [--fractions 0.25,0.5] [--batch 4 --new-tokens 32 --trials 3]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build(args, device):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        # At the default 0.02 a random model repeats one token and routes
        # nearly every step to the same experts.
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    with torch.device(device):
        m = MixtralForCausalLM(cfg).to(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32).eval()
    m.set_experts_implementation("eager")
    return m


def prompts(args, device):
    import torch

    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=g).to(device)


def generate(m, ids, n, sync):
    import torch

    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    sync()
    dt = time.perf_counter() - t0
    new = out[:, ids.shape[1]:]
    return {"seconds": dt, "tokens": new.tolist(), "tokens_per_s": new.numel() / dt}


def h2d_bandwidth(nbytes, device):
    """Bytes/s of a pinned host tensor of `nbytes` copied to the device
    (the median of 20 copies)."""
    import torch

    if device == "cpu":
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
    else:
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for _ in range(20):
        sync_of(device)()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync_of(device)()
        rates.append(nbytes / (time.perf_counter() - t0))
    return statistics.median(rates[2:])


def sync_of(device):
    import torch

    return torch.cuda.synchronize if device != "cpu" else (lambda: None)


def belady_misses(trace, slots):
    """Belady's MIN misses of the `token layer expert` fetches in `trace`
    (lines with a fourth field, the lookahead's, skipped) at `slots`, and
    the steps."""
    seq = []
    steps = set()
    for line in Path(trace).read_text().splitlines():
        f = line.split()
        if not f or f[0].startswith("#") or len(f) != 3:
            continue
        steps.add(f[0])
        seq.append((int(f[1]), int(f[2])))
    nxt, last = [0] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], len(seq))
        last[seq[i]] = i
    resident, misses = {}, 0
    for i, x in enumerate(seq):
        if x not in resident:
            misses += 1
            if len(resident) >= slots:
                del resident[max(resident, key=resident.get)]
        resident[x] = nxt[i]
    return misses, len(steps)


def run(args, name, frac, device, ids, work):
    import torch

    m = build(args, "cpu" if name.startswith("accelerate") else device)
    extra, moe = {}, None
    n_experts = args.layers * args.experts
    eb = 3 * args.hidden * args.intermediate * (2 if args.dtype == "bfloat16" else 4)
    if name.startswith("strata"):
        import strata.moe

        slots = max(1, int(frac * n_experts))
        trace = work / f"route-{name}-{frac}.txt"
        # Every expert in host memory, whatever its padding to pages.
        moe = strata.moe.offload(m, device_slots=slots, host_bytes=2 * (n_experts + 1) * eb,
                                 device="cuda" if device != "cpu" else "sim",
                                 prefetch=(name == "strata"), record_routing=str(trace))
        extra.update(device_slots=slots, trace=str(trace))
    elif name.startswith("accelerate"):
        import accelerate

        on_device = round(frac * args.layers)
        dmap = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
        for i in range(args.layers):
            for part in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate"):
                dmap[f"model.layers.{i}.{part}"] = 0
            dmap[f"model.layers.{i}.mlp.experts"] = 0 if i < on_device else "cpu"
        if device == "cpu":
            dmap = {k: "cpu" for k in dmap}
        m = accelerate.dispatch_model(m, device_map=dmap)
        extra.update(expert_layers_on_device=on_device)
    results = [generate(m, ids, args.new_tokens, sync_of(device)) for _ in range(args.trials)]
    r = {"config": name, "fraction": frac, "tokens_per_s_all": [x["tokens_per_s"] for x in results],
         "tokens_per_s": statistics.median(x["tokens_per_s"] for x in results), "tokens": results[-1]["tokens"],
         **extra}
    if moe is not None:
        t = moe.stats()["total"]
        r.update(hit_rate=t["hit_rate"], stall_seconds=t["stall_seconds"],
                 bytes_moved_per_token=t["bytes_moved"] / max(1, moe.stats()["tokens"]))
        moe.close()
    del m, moe
    if device != "cpu":
        torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--configs", default="strata,strata-nopf,accelerate")
    ap.add_argument("--json")
    ap.add_argument("--work", help="keep the runs' routing traces in this folder (default: a temporary one, removed at the end)")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU (use --device cpu for a dry run)")
    fractions = [float(f) for f in args.fractions.split(",")]
    configs = args.configs.split(",")
    unknown = set(configs) - {"strata", "strata-nopf", "accelerate"}
    if unknown:
        raise SystemExit(f"unknown configurations: {', '.join(sorted(unknown))}")
    device = "cuda:0" if args.device == "cuda" else "cpu"
    eb = 3 * args.hidden * args.intermediate * (2 if args.dtype == "bfloat16" else 4)
    ids = prompts(args, device)
    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        tmp = None
    else:
        tmp = tempfile.TemporaryDirectory(prefix="strata-moe-gpu-")
        work = Path(tmp.name)
    try:
        report(args, device, ids, eb, work, configs, fractions)
    finally:
        if tmp is not None:
            tmp.cleanup()


def report(args, device, ids, eb, work, configs, fractions):
    """The runs, the roofline and the report, the traces in `work`."""
    import torch

    bw = h2d_bandwidth(eb, device)
    print(f"{args.device}: {args.layers} layers x {args.experts} experts of {eb / 2**20:.1f} MiB; "
          f"host-to-device {bw / 1e9:.2f} GB/s", flush=True)
    runs = [run(args, "device", 1.0, device, ids, work)]
    ref = runs[0]["tokens"]
    print(f"device: {runs[0]['tokens_per_s']:.2f} tok/s", flush=True)
    for f in fractions:
        for c in configs:
            try:
                r = run(args, c, f, device, ids, work)
            except Exception as e:  # a peer that fails is reported, not fatal
                r = {"config": c, "fraction": f, "error": f"{type(e).__name__}: {e}"}
            if "error" not in r:
                r["tokens_identical"] = r["tokens"] == ref
            runs.append(r)
            print(f"{c}@{f:g}: " + (r.get("error") or f"{r['tokens_per_s']:.2f} tok/s, tokens identical "
                                     f"{r['tokens_identical']}"), flush=True)
    dev_step = args.batch / runs[0]["tokens_per_s"]
    roofline = {}
    for f in fractions:
        rec = next((r for r in runs if r["config"] == "strata" and r["fraction"] == f and "error" not in r), None)
        if rec is None:
            continue
        misses, steps = belady_misses(rec["trace"], rec["device_slots"])
        # The trace holds every trial's steps: a step's share.
        read = misses * eb / max(1, steps) / bw
        roofline[f"{f:g}"] = {"tokens_per_s": args.batch / max(dev_step, read), "device_step_seconds": dev_step,
                              "read_step_seconds": read, "belady_misses": misses, "steps": steps}
    for r in runs:
        g = f"{r['fraction']:g}"
        if g in roofline and "tokens_per_s" in r:
            r["of_roofline"] = r["tokens_per_s"] / roofline[g]["tokens_per_s"]
    out = {"device": args.device, "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
           "args": vars(args), "expert_bytes": eb, "h2d_bytes_per_second": bw, "roofline": roofline,
           "runs": [{k: v for k, v in r.items() if k != "tokens" and (args.work or k != "trace")} for r in runs]}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
