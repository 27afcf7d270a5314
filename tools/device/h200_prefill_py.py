"""Prefill on engine memory through Python: gdn.vllm.gdn_attention_core (one gdn.step on vLLM's tensors: the
chunked path from 64 tokens) against what vLLM runs for prefill with FLA 0.6 (causal_conv1d with the cache as
initial state, chunk_gated_delta_rule, rms_norm_gated), on the same tensors, eager as vLLM's prefill runs:
device time by CUDA events around N calls, median of 5. Seed shape, value-major f32 state, bf16 or f32 rows.
Prints a markdown table last and writes prefill_py.json to $OUT. Needs the FLA wheels on PYTHONPATH."""

import json
import os

import torch
from fla.modules.causal_conv1d.ops import causal_conv1d
from fla.modules.norm.fused_norm_gate import rms_norm_gated
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

import gdn
import gdn.vllm

dev = torch.device("cuda")
HK, HV, D = 16, 48, 128
C, N = (2 * HK + HV) * D, HV * D
torch.manual_seed(0)
conv_w = torch.randn(C, 1, 4) * 0.3
dt_bias = torch.randn(HV) * 0.5
A_log = torch.rand(HV) * 2 - 1
gamma = torch.rand(D) + 0.5
layer = gdn.Layer(conv_w, dt_bias, A_log, gamma, num_k_heads=HK, num_v_heads=HV, head_dim=D,
                  head_map="grouped", gate="silu")
rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()  # noqa: E731


def timed(fn, n):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        ev[0].record()
        for _ in range(n):
            fn()
        ev[1].record()
        ev[1].synchronize()
        ts.append(ev[0].elapsed_time(ev[1]) * 1e3 / n)
    return sorted(ts)[2]


def case(lens, dtype):
    n = len(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    R = int(cu[-1])
    idx = torch.arange(n, dtype=torch.int32, device=dev)
    x = torch.randn(R, C, device=dev, dtype=dtype)
    b = torch.randn(R, HV, device=dev, dtype=dtype)
    a = torch.randn(R, HV, device=dev, dtype=dtype)
    z = torch.randn(R, HV, D, device=dev, dtype=dtype)
    ssm = torch.randn(n, HV, D, D, device=dev) * 0.05
    kv0 = torch.randn(n, 3, C, device=dev, dtype=dtype)
    out = torch.zeros(R, HV, D, device=dev, dtype=dtype)
    ssm_g, kv_g = ssm.clone(), kv0.clone()

    def ours(st=ssm_g, kv=kv_g):
        gdn.vllm.gdn_attention_core(layer, x, b, a, z, out, kv.transpose(-1, -2), st, idx, cu,
                                    max_query_len=max(lens))

    ours()
    torch.cuda.synchronize()
    layer.check_faults()
    y_ours, s_ours = out.clone(), ssm_g.clone()
    w = conv_w[:, 0].to(dev, dtype)
    cache = torch.cat([torch.zeros(n, C, 1, device=dev, dtype=dtype), kv0.transpose(-1, -2)], -1).contiguous()

    def fla():
        y, _ = causal_conv1d(x[None], weight=w, initial_state=cache, output_final_state=True, activation="silu",
                             cu_seqlens=cu)
        q, k, v = y.split([HK * D, HK * D, HV * D], -1)
        o, ht = chunk_gated_delta_rule(
            q.reshape(1, R, HK, D), k.reshape(1, R, HK, D), v.reshape(1, R, HV, D), g=a[None].float(),
            beta=b[None].float(), initial_state=ssm.transpose(-1, -2).contiguous(), output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log.to(dev), dt_bias=dt_bias.to(dev),
            use_beta_sigmoid_in_kernel=True, cu_seqlens=cu)
        return rms_norm_gated(o, z[None], gamma.to(dev, dtype), None, activation="silu", eps=1e-6)[0], ht

    try:
        yf, ht = fla()
        e_y, e_s = rel(y_ours, yf), rel(s_ours, ht.transpose(-1, -2))
        t_fla = timed(fla, 5 if R >= 8192 else 20)
    except Exception as e:  # noqa: BLE001 (FLA's keyword set differs between releases: say so, time ours)
        print(f"FLA failed: {type(e).__name__}: {str(e)[:200]}")
        e_y = e_s = t_fla = float("nan")
    scratch = [ssm.clone(), kv0.clone()]
    t_ours = timed(lambda: ours(*scratch), 5 if R >= 8192 else 20)
    return dict(rows=R, gdn_us=t_ours, fla_us=t_fla, y_rel_vs_fla=e_y, state_rel_vs_fla=e_s)


res = {}
for dt, nm in [(torch.bfloat16, "bf16"), (torch.float32, "f32")]:
    for lens in ([512], [8192], [32768], [8192] * 4, [1000, 64, 3000, 5, 200]):
        name = f"{nm} {'+'.join(map(str, lens)) if len(set(lens)) > 1 else (f'{len(lens)}x' if len(lens) > 1 else '') + str(lens[0])}"
        res[name] = case(lens, dt)
        print(name, res[name], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "prefill_py.json"), "w"), indent=1)
print("\n| rows dtype | windows | gdn.step µs | FLA conv+chunk+norm µs | FLA / gdn | y rel vs FLA | state rel vs FLA |")
print("|---|---|---|---|---|---|---|")
for k, r in res.items():
    print(f"| {k.split()[0]} | {k.split()[1]} | {r['gdn_us']:.1f} | {r['fla_us']:.1f} | {r['fla_us'] / r['gdn_us']:.2f} | "
          f"{r['y_rel_vs_fla']:.1e} | {r['state_rel_vs_fla']:.1e} |")
