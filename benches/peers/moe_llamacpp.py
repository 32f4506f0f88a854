"""llama.cpp peer for moe_vs_peers.py: the same tiny random Mixtral,
converted to GGUF and generated greedily by llama.cpp (CPU, mmap).

Standalone, no torch: runs under target/llamaenv, a venv holding only
llama-cpp-python (which builds llama.cpp from source), gguf, numpy and
safetensors. Made with (2 cores, about 9 minutes, almost all of it the
llama.cpp build):
  python3 -m venv target/llamaenv
  target/llamaenv/bin/pip install --upgrade pip
  target/llamaenv/bin/pip install cmake ninja numpy gguf safetensors
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF" \\
    CMAKE_BUILD_PARALLEL_LEVEL=2 target/llamaenv/bin/pip install -v --no-cache-dir llama-cpp-python
(llama-cpp-python 0.3.36, gguf 0.19.0; GGML_NATIVE=ON tunes the kernels to
this CPU, so build the venv on the machine that runs the benchmark.)

The checkpoint is the one `moe_vs_peers.py --worker prepare` writes
(transformers 5, save_original_format=False): fused experts
model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up
rows; silu(gate) * up) and .down_proj [E, H, I], the router
mlp.gate.weight [E, H] (softmax over all experts, top-k, renormalised:
llama.cpp's llama arch does the same). It becomes a GGUF of architecture
"llama" with experts, as llama.cpp's convert_hf_to_gguf.py writes Mixtral,
Q and K rows permuted from Hugging Face's rotate_half layout to llama.cpp's
interleaved one. There is no tokenizer: a placeholder SentencePiece
("llama") vocabulary of vocab_size tokens; generation feeds and reads
token ids and takes the argmax of the logits itself, so no token stops it.

Checked against transformers' greedy generate (float32, eager experts) at
the default dims: the f32 GGUF with --kv-type f32 --flash-attn off gives
the same tokens (4 x 64 of 4 x 64); with llama.cpp's defaults (f16 KV
cache, flash attention on, which rounds to f16) or the f16 GGUF (f16
matmuls round the activations too) the sequences agree for their first
0-12 tokens only, this random model's top-2 logits being close.

  target/llamaenv/bin/python benches/peers/moe_llamacpp.py --ckpt DIR/ckpt
      --meta DIR/meta.json --prompts DIR/prompts.json --gguf OUT.gguf
      [--dtype f32|f16] [--new-tokens N] [--threads 2] [--sequential]
      [--kv-type f16|f32] [--flash-attn auto|on|off]
writes the GGUF if missing (in a child process, so that the converter's
memory is not counted in this one's), generates, and prints
`RESULT {json}` on one line.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cgroups import apply_limit, memory_counters, proc_io

# MixtralConfig's defaults for what prepare's meta.json leaves out.
MIXTRAL_DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "hidden_act": "silu", "head_dim": None}


def model_config(ckpt_dir, meta):
    """meta["config"] over the checkpoint's config.json over MixtralConfig's defaults."""
    cfg = dict(MIXTRAL_DEFAULTS)
    p = Path(ckpt_dir) / "config.json"
    if p.exists():
        hf = json.loads(p.read_text())
        cfg.update({k: v for k, v in hf.items() if v is not None})
        rp = hf.get("rope_parameters") or {}
        if "rope_theta" in rp:
            cfg["rope_theta"] = rp["rope_theta"]
        if rp.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rp['rope_type']} not supported")
    cfg.update({k: v for k, v in meta["config"].items() if v is not None})
    if cfg["hidden_act"] != "silu":
        raise ValueError("only silu experts")
    if not cfg.get("head_dim"):
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


def permute(w, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate_half rows to
    llama.cpp's (interleaved pairs) rope layout."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt_dir, meta, out_path, dtype="f32"):
    import gguf
    import numpy as np

    if dtype not in ("f32", "f16"):
        raise ValueError("dtype is f32 or f16")
    cfg = model_config(ckpt_dir, meta)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    L, E = cfg["num_hidden_layers"], cfg["num_local_experts"]
    nh, nkv, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    ftype = gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16

    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    where = {}
    for f in files:
        with open(f, "rb") as h:
            n = int.from_bytes(h.read(8), "little")
            for k, info in json.loads(h.read(n)).items():
                if k != "__metadata__":
                    where[k] = (f, 8 + n, info)

    def get(name):
        """The tensor as numpy (bfloat16, which numpy lacks, widened to
        float32 exactly)."""
        f, base, info = where[name]
        a, b = info["data_offsets"]
        with open(f, "rb") as h:
            h.seek(base + a)
            raw = h.read(b - a)
        kind = info["dtype"]
        if kind == "BF16":
            x = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            x = np.frombuffer(raw, dtype={"F32": np.float32, "F16": np.float16}[kind])
        return x.reshape(info["shape"])

    out_path = Path(out_path)
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("moe-bench-mixtral")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(V)
    w.add_file_type(ftype)

    # Placeholder SentencePiece vocabulary: unk, bos, eos, the 256 byte
    # tokens llama.cpp looks up (newline), then tok{i}.
    T = gguf.TokenType
    tokens, types = ["<unk>", "<s>", "</s>"], [T.UNKNOWN, T.CONTROL, T.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [T.BYTE] * 256
    if V < len(tokens):
        raise ValueError(f"vocab_size {V} < {len(tokens)}")
    tokens += [f"tok{i}" for i in range(len(tokens), V)]
    types += [T.NORMAL] * (V - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(V)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)

    def put(name, a, keep_f32=False):
        a = np.ascontiguousarray(a)
        if dtype == "f16" and a.ndim > 1 and not keep_f32:
            a = a.astype(np.float16)
        else:
            a = a.astype(np.float32, copy=False)
        w.add_tensor(name, a)

    put("token_embd.weight", get("model.embed_tokens.weight"))
    for i in range(L):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        put(b + "attn_norm.weight", get(p + "input_layernorm.weight"))
        put(b + "attn_q.weight", permute(get(p + "self_attn.q_proj.weight"), nh, nh))
        put(b + "attn_k.weight", permute(get(p + "self_attn.k_proj.weight"), nh, nkv))
        put(b + "attn_v.weight", get(p + "self_attn.v_proj.weight"))
        put(b + "attn_output.weight", get(p + "self_attn.o_proj.weight"))
        put(b + "ffn_norm.weight", get(p + "post_attention_layernorm.weight"))
        # convert_hf_to_gguf keeps the router in f32.
        put(b + "ffn_gate_inp.weight", get(p + "mlp.gate.weight"), keep_f32=True)
        gu = get(p + "mlp.experts.gate_up_proj")  # [E, 2I, H]
        assert gu.shape == (E, 2 * I, H), gu.shape
        put(b + "ffn_gate_exps.weight", gu[:, :I, :])  # [E, I, H]
        put(b + "ffn_up_exps.weight", gu[:, I:, :])
        del gu
        dn = get(p + "mlp.experts.down_proj")  # [E, H, I]
        assert dn.shape == (E, H, I), dn.shape
        put(b + "ffn_down_exps.weight", dn)
    put("output_norm.weight", get("model.norm.weight"))
    put("output.weight", get("lm_head.weight"))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out_path)
    return str(out_path)


def _proc_status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def generate(gguf_path, prompts, new_tokens, threads, sequential=False, kv_type="f16", flash_attn="auto",
             limit=0):
    """Greedy decoding of exactly new_tokens tokens per prompt (argmax of the
    logits, no EOS stop). Batched: all prompts as sequences of one
    llama_batch per step; sequential=True does one prompt after another.
    kv_type "f16" (llama.cpp's default) or "f32"; flash_attn "auto"
    (llama.cpp's default: on for the CPU), "on" or "off". A `limit` (bytes)
    is set on this process's memory cgroup once the model has loaded
    (cgroups.apply_limit), before generating."""
    import numpy as np
    import llama_cpp as lc

    if os.environ.get("MOE_LLAMACPP_LOG") is None:
        # Silence llama.cpp's load log (stderr), keep errors.
        @lc.llama_log_callback
        def _quiet(level, text, user_data):
            if level == lc.GGML_LOG_LEVEL_ERROR:
                sys.stderr.write(text.decode(errors="replace"))

        lc.llama_log_set(_quiet, ctypes.c_void_p(0))
        generate._log_cb = _quiet  # keep alive
    lc.llama_backend_init()

    n_seq = len(prompts)
    longest = max(len(p) for p in prompts) + new_tokens
    t_load = time.perf_counter()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.load_mode = lc.LLAMA_LOAD_MODE_MMAP  # llama.cpp's default (use_mmap)
    model = lc.llama_model_load_from_file(str(gguf_path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    par = n_seq if not sequential else 1
    cp = lc.llama_context_default_params()
    cp.n_seq_max = par
    cp.kv_unified = True
    cp.n_ctx = ((par * longest + 255) // 256) * 256
    cp.n_batch = max(cp.n_ctx, 512)
    cp.n_ubatch = cp.n_batch
    cp.n_threads = threads
    cp.n_threads_batch = threads
    kv = {"f16": lc.GGML_TYPE_F16, "f32": lc.GGML_TYPE_F32}[kv_type]
    cp.type_k = cp.type_v = kv
    cp.flash_attn_type = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                          "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    mem = lc.llama_get_memory(ctx)
    load_s = time.perf_counter() - t_load

    batch = lc.llama_batch_init(cp.n_batch, 0, par)

    def decode(entries):
        """entries: (token, pos, seq, want_logits); returns argmax per wanted row."""
        batch.n_tokens = len(entries)
        for j, (tok, pos, seq, want) in enumerate(entries):
            batch.token[j] = tok
            batch.pos[j] = pos
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = seq
            batch.logits[j] = 1 if want else 0
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = []
        for j, e in enumerate(entries):
            if e[3]:
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, j), shape=(n_vocab,))
                out.append(int(row.argmax()))
        return out

    def run(group):
        # group: list of (seq_id, prompt)
        lc.llama_memory_clear(mem, True)
        entries = []
        for s, p in group:
            entries += [(int(t), k, s, k == len(p) - 1) for k, t in enumerate(p)]
        nxt = decode(entries)
        gen = [[t] for t in nxt]
        for step in range(1, new_tokens):
            nxt = decode([(gen[j][-1], len(p) + step - 1, s, True) for j, (s, p) in enumerate(group)])
            for j, t in enumerate(nxt):
                gen[j].append(t)
        return gen

    extra = {}
    if limit:
        extra.update(apply_limit(limit))
    mem0 = memory_counters()
    rb0 = proc_io()["read_bytes"]
    t0 = time.perf_counter()
    if sequential:
        tokens = [run([(0, p)])[0] for p in prompts]
    else:
        tokens = run(list(enumerate(prompts)))
    dt = time.perf_counter() - t0
    read = proc_io()["read_bytes"] - rb0
    mem1 = memory_counters()
    extra.update({k: mem1[k] - mem0[k] for k in mem0})
    st = _proc_status()

    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    generated = n_seq * new_tokens
    return {
        "tokens": tokens,
        "seconds": dt,
        "generated": generated,
        "tokens_per_s": generated / dt,
        "load_seconds": load_s,
        "read_bytes": read,
        "rss_bytes": st.get("VmRSS"),
        "rss_anon_bytes": st.get("RssAnon"),
        "rss_file_bytes": st.get("RssFile"),
        "peak_rss_bytes": st.get("VmHWM"),
        "threads": threads,
        "batched": not sequential,
        "kv_type": kv_type,
        "flash_attn": flash_attn,
        **extra,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--prompts")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequential", action="store_true", help="one prompt after another instead of one batch")
    ap.add_argument("--kv-type", default="f16", choices=["f16", "f32"], help="KV cache type (llama.cpp's default f16)")
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--limit", type=int, default=0,
                    help="a memory limit (bytes) for this process's cgroup, set once the model has loaded")
    ap.add_argument("--convert-only", action="store_true", help="write the GGUF (even if present) and exit")
    args = ap.parse_args()
    meta = json.loads(Path(args.meta).read_text())
    if args.convert_only:
        t0 = time.perf_counter()
        write_gguf(args.ckpt, meta, args.gguf, args.dtype)
        print(json.dumps({"gguf": args.gguf, "seconds": time.perf_counter() - t0}))
        return
    convert_s = None
    if not Path(args.gguf).exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--convert-only", "--ckpt", args.ckpt, "--meta", args.meta,
                        "--gguf", args.gguf, "--dtype", args.dtype], check=True, stdout=subprocess.DEVNULL)
        convert_s = time.perf_counter() - t0
    if not args.prompts:
        raise SystemExit("--prompts is required to generate")
    prompts = json.loads(Path(args.prompts).read_text())
    r = generate(args.gguf, prompts, args.new_tokens, args.threads, sequential=args.sequential,
                 kv_type=args.kv_type, flash_attn=args.flash_attn, limit=args.limit)
    r.update({"config": "llamacpp", "dtype": args.dtype, "gguf": args.gguf,
              "gguf_bytes": os.path.getsize(args.gguf), "convert_seconds": convert_s})
    print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
