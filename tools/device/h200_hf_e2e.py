"""End to end on a GPU: a small Qwen3.5 (random, seeded weights; GDN layers at the real shape) generates
greedily with HF's own path and with gdn.hf.patch; prints token agreement, logit error, per-token
decode time both ways and the host cost of one gdn.step call. Usage: python3 h200_hf_e2e.py [--quick]."""

import json
import os
import sys
import time

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

import gdn
import gdn.hf

QUICK = "--quick" in sys.argv
DEV = "cuda" if torch.cuda.is_available() and "--cpu" not in sys.argv else "cpu"
PROMPT, NEW = (8, 8) if QUICK else (32, 64)
res = {"device": DEV}


def build(dtype):
    cfg = Qwen3_5TextConfig(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).eval()
    # random but not degenerate: HF's init leaves the norm weights at 1 and A_log in (log 0.01, log 16)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Qwen3_5GatedDeltaNet":
                m.dt_bias.normal_(0, 0.5)
                m.norm.weight.uniform_(0.5, 1.5)
    return model.to(DEV, dtype)


def generate(model, ids):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


def decode_ms(model, ids, steps):
    """Per-token time of a decode loop (prefill, then `steps` single-token forwards with the cache)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(tok, past_key_values=cache, use_cache=True)
        if DEV == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        if DEV == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3 / steps


def forced_logits(model, full, steps):
    """Logits of `steps` decode steps fed the tokens of `full` (teacher forcing): a prefill of the prompt, then
    one-token windows."""
    from transformers import DynamicCache

    p = full.shape[1] - steps
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = [model(full[:, :p], past_key_values=cache, use_cache=True).logits[:, -1]]
        for i in range(steps - 1):
            out.append(model(full[:, p + i:p + i + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1).float()


def compare(dtype, ref=None):
    """Greedy generation with HF's path and with gdn.hf.patch. For bf16, also both paths' logits teacher-forced
    on the f32 run's tokens, against the f32 run's logits (`ref`): how far each bf16 path is from f32."""
    name = str(dtype).split(".")[-1]
    model = build(dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=g).to(DEV)
    ref_tok, ref_logits = generate(model, ids)
    hf_ms = decode_ms(model, ids, 8 if QUICK else 32)
    hf_forced = forced_logits(model, ref[0], NEW) if ref is not None else None
    n = gdn.hf.patch(model)
    got_tok, got_logits = generate(model, ids)
    gdn_ms = decode_ms(model, ids, 8 if QUICK else 32)
    same = (got_tok == ref_tok).float().mean().item()
    first = int((got_tok != ref_tok).nonzero()[0, 1]) if same < 1 else NEW
    # logits compared over the steps both paths agree on (after a divergence the contexts differ)
    k = max(first, 1)
    err = ((got_logits[:, :k] - ref_logits[:, :k]).norm() / ref_logits[:, :k].norm()).item()
    r = dict(patched_layers=n, tokens_equal=same, first_divergence=first, logit_rel_err=err,
             hf_decode_ms=hf_ms, gdn_decode_ms=gdn_ms)
    print(f"{name}: {n} GDN layers patched; greedy tokens equal {same * 100:.1f}% (first divergence at {first} of "
          f"{NEW}); logit rel. error {err:.2e} over {k} steps; decode per token: HF {hf_ms:.2f} ms, gdn {gdn_ms:.2f} ms")
    if ref is not None:
        gdn_forced = forced_logits(model, ref[0], NEW)
        f32_logits = ref[1]
        rel = lambda x: ((x - f32_logits).norm() / f32_logits.norm()).item()
        top = lambda x: (x.argmax(-1) == f32_logits.argmax(-1)).float().mean().item()
        both = (hf_forced.argmax(-1) == gdn_forced.argmax(-1)).float().mean().item()
        r.update(forced_hf_vs_f32_rel=rel(hf_forced), forced_gdn_vs_f32_rel=rel(gdn_forced),
                 forced_hf_top1_vs_f32=top(hf_forced), forced_gdn_top1_vs_f32=top(gdn_forced),
                 forced_top1_hf_vs_gdn=both)
        print(f"{name}, teacher-forced on the f32 tokens, against the f32 logits: HF {name} rel. error "
              f"{rel(hf_forced):.2e}, top-1 {top(hf_forced) * 100:.1f}%; gdn {name} rel. error {rel(gdn_forced):.2e}, "
              f"top-1 {top(gdn_forced) * 100:.1f}%; HF and gdn top-1 agree {both * 100:.1f}%")
    res[name] = r
    return torch.cat([ids, ref_tok], 1), ref_logits


def host_cost():
    """gdn.step at B 1 T 1 (seed shape, bf16 activations, f32 state): the eager call's wall time per call
    against the kernel's own time from a CUDA-graph replay of the same call."""
    sh = dict(h_k=16, h_v=48, d=128)
    C, n = (2 * sh["h_k"] + sh["h_v"]) * sh["d"], sh["h_v"] * sh["d"]
    torch.manual_seed(2)
    layer = gdn.Layer(torch.randn(C, 1, 4) * 0.3, torch.randn(48) * 0.5, torch.rand(48) * 2 - 1, torch.ones(128),
                      num_k_heads=16, num_v_heads=48, head_dim=128, head_map="grouped", gate="silu")
    bf = torch.bfloat16
    qkv = torch.randn(1, C, device=DEV, dtype=bf)
    a, b = torch.randn(1, 48, device=DEV, dtype=bf), torch.randn(1, 48, device=DEV, dtype=bf)
    z = torch.randn(1, n, device=DEV, dtype=bf)
    state = torch.zeros(4, 48, 128, 128, device=DEV)
    conv = torch.zeros(4, C, 3, device=DEV, dtype=bf)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    lens = torch.tensor([1], dtype=torch.int32, device=DEV)
    out = torch.empty(1, n, device=DEV, dtype=bf)
    call = lambda: gdn.step(layer, qkv, a, b, z, state, conv, slots, lengths=lens, out=out)
    for _ in range(20):
        call()
    N = 2000
    if DEV == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(N):
        call()
    wall = (time.perf_counter() - t) * 1e6 / N
    if DEV == "cuda":
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        reps = 100
        with torch.cuda.graph(graph):
            for _ in range(reps):
                call()
        graph.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        kern = e0.elapsed_time(e1) * 1e3 / (10 * reps)
    else:
        kern = float("nan")
    res["host"] = dict(eager_us_per_call=wall, graph_us_per_call=kern, host_over_kernel_us=wall - kern)
    print(f"gdn.step B 1 T 1: eager {wall:.2f} us per call, graph replay {kern:.2f} us per call "
          f"(host cost above the kernel: {wall - kern:.2f} us)")


f32_run = compare(torch.float32)
compare(torch.bfloat16, f32_run)
host_cost()
fla = None
try:
    import fla  # noqa: F401
    fla = getattr(fla, "__version__", "?")
except ImportError:
    pass
res["fla_importable"] = fla
print(f"FLA importable: {fla}")
path = os.path.join(os.environ.get("OUT", "/tmp"), "hf_e2e.json")
json.dump(res, open(path, "w"), indent=1)
