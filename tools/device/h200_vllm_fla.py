"""gdn.vllm.gdn_attention_core against FLA's causal conv + fused_recurrent_gated_delta_rule + rms_norm_gated
(the three kernels vLLM's GDN core and norm run) on the same vLLM-shaped tensors: a decode batch with a padded
slot, and a varlen batch of multi-token windows (query_start_loc), f32 and bf16 activations, f32 state.
Needs the FLA 0.6 wheels on PYTHONPATH (shared/anchors/README.md)."""

import json
import os

import torch
from fla.modules.causal_conv1d.ops import causal_conv1d, causal_conv1d_update
from fla.modules.norm.fused_norm_gate import rms_norm_gated
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

import gdn
import gdn.vllm

dev = torch.device("cuda")
HK, HV, D = 16, 48, 128
C, N = (2 * HK + HV) * D, HV * D
SLOTS = 16
torch.manual_seed(0)
conv_w = torch.randn(C, 1, 4) * 0.3
dt_bias = torch.randn(HV) * 0.5
A_log = torch.rand(HV) * 2 - 1
gamma = torch.rand(D) + 0.5
layer = gdn.Layer(conv_w, dt_bias, A_log, gamma, num_k_heads=HK, num_v_heads=HV, head_dim=D,
                  head_map="grouped", gate="silu")
rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()
res = {}


def case(name, lens, dtype, pad):
    n = len(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    R = int(cu[-1])
    perm = torch.randperm(SLOTS)[:n].to(torch.int32)
    idx = perm.clone()
    if pad:
        idx[-1] = -1  # vLLM's PAD_SLOT_ID: skipped, its rows untouched
    idx = idx.to(dev)
    x = torch.randn(R, C, device=dev, dtype=dtype)
    b = torch.randn(R, HV, device=dev, dtype=dtype)
    a = torch.randn(R, HV, device=dev, dtype=dtype)
    z = torch.randn(R, HV, D, device=dev, dtype=dtype)
    ssm = torch.randn(SLOTS, HV, D, D, device=dev) * 0.05  # [slot][h][v][k]
    kv0 = torch.randn(SLOTS, 3, C, device=dev, dtype=dtype)  # vLLM allocates [slot][K-1][C]
    out = torch.full((R, HV, D), 7.0, device=dev, dtype=dtype)
    ssm_g, kv0_g = ssm.clone(), kv0.clone()
    gdn.vllm.gdn_attention_core(layer, x, b, a, z, out, kv0_g.transpose(-1, -2), ssm_g, idx, cu, validate=True)
    torch.cuda.synchronize()
    live = [s for s in range(n) if int(idx[s]) >= 0]
    sl = torch.tensor([int(idx[s]) for s in live], device=dev, dtype=torch.long)
    # FLA on the live sequences, their slots gathered
    rows = torch.cat([torch.arange(int(cu[s]), int(cu[s + 1]), device=dev) for s in live])
    cu_l = torch.tensor([0] + list(torch.tensor([lens[s] for s in live]).cumsum(0)), dtype=torch.int32, device=dev)
    cache = torch.cat([torch.zeros(len(live), C, 1, device=dev, dtype=dtype), kv0[sl].transpose(-1, -2)], -1).contiguous()
    w = conv_w[:, 0].to(dev, dtype)
    xl = x[rows]
    if all(lens[s] == 1 for s in live):
        y, _ = causal_conv1d_update(xl, cache, weight=w, activation="silu")
        y = y[None]
        cache_new = cache
    else:
        y, cache_new = causal_conv1d(xl[None], weight=w, initial_state=cache, output_final_state=True,
                                     activation="silu", cu_seqlens=cu_l)
    q, k, v = y.split([HK * D, HK * D, HV * D], -1)
    R_l = xl.shape[0]
    o, ht = fused_recurrent_gated_delta_rule(
        q.reshape(1, R_l, HK, D), k.reshape(1, R_l, HK, D), v.reshape(1, R_l, HV, D),
        g=a[rows][None].float(), beta=b[rows][None].float(), initial_state=ssm[sl].transpose(-1, -2).contiguous(),
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=A_log.to(dev), dt_bias=dt_bias.to(dev), use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_l)
    yf = rms_norm_gated(o, z[rows][None], gamma.to(dev, dtype), None, activation="silu", eps=1e-6)[0]
    e_y = rel(out[rows], yf)
    e_s = rel(ssm_g[sl], ht.transpose(-1, -2))
    e_c = rel(kv0_g[sl].transpose(-1, -2), cache_new[:, :, 1:])
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[sl.cpu()] = False
    untouched = bool(torch.equal(ssm_g[others.to(dev)], ssm[others.to(dev)]) and torch.equal(kv0_g[others.to(dev)], kv0[others.to(dev)]))
    pad_rows_untouched = True
    if pad:
        s = n - 1
        pad_rows_untouched = bool((out[int(cu[s]):int(cu[s + 1])] == 7.0).all())
    r = dict(y_rel=e_y, state_rel=e_s, conv_rel=e_c, other_slots_untouched=untouched, pad_rows_untouched=pad_rows_untouched)
    res[name] = r
    print(f"{name:<28} y {e_y:.2e}  state {e_s:.2e}  conv state {e_c:.2e}  other slots untouched {untouched}  "
          f"padded rows untouched {pad_rows_untouched}")
    return r


for dt, nm in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
    case(f"decode B8 + pad, {nm}", [1] * 9, dt, True)
    case(f"varlen 4,2,5,1,3, {nm}", [4, 2, 5, 1, 3], dt, False)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "vllm_fla.json"), "w"), indent=1)
