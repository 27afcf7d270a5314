#!/usr/bin/env python3
"""Build the HF-transformers conformance fixtures of the GDN window step.

Every case is written as one safetensors file in the `gdn step` input format of
SPEC.md (all inputs F32), with HF's results beside the inputs as `expect_y`,
`expect_state` and `expect_hist` (F64: HF's code is run in float64).

Each case is also recomputed by `spec_step`, a plain float64 numpy transcription
of SPEC.md, and the script fails if it disagrees with HF beyond 1e-11 (relative,
per tensor). Run it from anywhere:

    /work/venv-conf/bin/python tools/conformance/make_fixtures.py [--out DIR] [--check]

`--check` builds everything in memory and compares it with the files on disk
instead of writing them.
"""

import argparse
import contextlib
import hashlib
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load

from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

EPS = 1e-6
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "crates", "gdn-conformance", "fixtures", "hf")
SPEC_TOL = 1e-11  # float64 numpy SPEC vs float64 HF, relative per tensor


# --------------------------------------------------------------------------
# Running HF's code in float64
# --------------------------------------------------------------------------
# HF's delta-rule functions and its gated RMSNorm cast their inputs to
# torch.float32 explicitly. To get a float64 reference out of the very same
# code, the module's global name `torch` is swapped, while the cases run, for a
# thin proxy that answers `float32` with `float64` and forwards everything else.
# Nothing else in HF's code changes.

class _TorchF64:
    def __getattr__(self, name):
        if name == "float32":
            return torch.float64
        return getattr(torch, name)


@contextlib.contextmanager
def hf_float64(enabled=True):
    saved = hf.torch
    if enabled:
        hf.torch = _TorchF64()
    try:
        yield
    finally:
        hf.torch = saved


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

def f32(x):
    """Round to the nearest float32, returned as float64 numpy (exact upcast)."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def t64(x):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float64)))


def rel(out, ref):
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    n = np.linalg.norm(ref)
    d = np.linalg.norm(out - ref)
    return d / n if n > 0 else d


# --------------------------------------------------------------------------
# SPEC.md, transcribed to float64 numpy (the cross-check of the conversions)
# --------------------------------------------------------------------------

def spec_softplus(u):
    if u > 20.0:
        return u
    e = np.exp(u)
    w = 1.0 + e
    if w == 1.0:
        return e
    return np.log(w) * e / (w - 1.0)


def spec_step(inp, head_map, act, eps=EPS, commit="all"):
    """One window step per SPEC.md. inp: dict of numpy arrays in the file layout.
    Returns (y [B,T,n], state [B,d,h_v,d], hist [B,C,3]) as committed."""
    qkv = inp["qkv"].astype(np.float64)
    alpha = inp["alpha"].astype(np.float64)
    beta = inp["beta"].astype(np.float64)
    z = inp["z"].astype(np.float64)
    w = inp["conv_w"].astype(np.float64)
    dt = inp["dt"].astype(np.float64)
    a = inp["a"].astype(np.float64)
    gamma = inp["gamma"].astype(np.float64)
    B, T, C = qkv.shape
    d = gamma.shape[0]
    hv = dt.shape[0]
    hk = (C // d - hv) // 2
    assert (2 * hk + hv) * d == C
    n = hv * d
    S0 = inp["state"].astype(np.float64).copy()
    H0 = inp["hist"].astype(np.float64).copy()
    if act == "silu":
        actf = lambda x: x / (1.0 + np.exp(-x))
    elif act == "sigmoid":
        actf = lambda x: 1.0 / (1.0 + np.exp(-x))
    else:
        raise ValueError(act)
    if head_map == "grouped":
        gmap = lambda h: h // (hv // hk)
    elif head_map == "tiled":
        gmap = lambda h: h % hk
    else:
        raise ValueError(head_map)
    kcommit = {"all": T, "verify": 0}.get(commit)
    if kcommit is None:
        kcommit = int(commit)

    y = np.zeros((B, T, n))
    S_out = S0.copy()
    H_out = H0.copy()
    for b in range(B):
        S = S0[b].copy()  # [d(i), hv, d(j)]
        Hs = H0[b].copy()  # [C, 3]
        for t in range(T):
            # 1. conv + SiLU over all channels, then the shift (once per channel)
            x = np.concatenate([Hs, qkv[b, t][:, None]], axis=1)  # [C, 4]
            s = np.zeros(C)
            for k in range(4):
                s = x[:, k] * w[:, k] + s
            cv = s / (1.0 + np.exp(-s))
            Hs = x[:, 1:].copy()
            for h in range(hv):
                g = gmap(h)
                q = cv[g * d:(g + 1) * d]
                k = cv[hk * d + g * d: hk * d + (g + 1) * d]
                v = cv[2 * hk * d + h * d: 2 * hk * d + (h + 1) * d]
                # 2. L2 norms, as the spec writes them
                rq = 1.0 / np.sqrt(np.sum(q * q) / d + eps / d)
                rk = 1.0 / np.sqrt(np.sum(k * k) / d + eps / d)
                qh = (rq * q) * (1.0 / np.sqrt(d))
                kh = (rk * k) * (1.0 / np.sqrt(d))
                # 3. decay, 4. write strength
                gate = np.exp(spec_softplus(alpha[b, t, h] + dt[h]) * a[h])
                bb = 1.0 / (1.0 + np.exp(-beta[b, t, h]))
                # 5. delta rule
                Sh = S[:, h, :]  # [i, j]
                kv = kh @ Sh
                delta = (v - gate * kv) * bb
                Sh = gate * Sh + np.outer(kh, delta)
                S[:, h, :] = Sh
                # 6. readout
                o = (qh @ Sh) * (1.0 / np.sqrt(d))
                # 7. gated RMS norm
                rs = 1.0 / np.sqrt(np.sum(o * o) / d + eps)
                zz = z[b, t, h * d:(h + 1) * d]
                y[b, t, h * d:(h + 1) * d] = ((rs * o) * gamma) * actf(zz)
            if t + 1 == kcommit:
                S_out[b] = S
                H_out[b] = Hs
    return y, S_out, H_out


# --------------------------------------------------------------------------
# Conversions between HF's tensors and the spec's layout
# --------------------------------------------------------------------------
# state: HF [B, h_v, d_k, d_v] (S_hf[b,h,i,j], i key, j value)
#        spec [B, d, h_v, d] with S[i][h][j] at (i*h_v + h)*d + j  ->  permute(0,2,1,3)
# conv:  HF conv_state [B, C, 4]; causal_conv1d_update concatenates it with the
#        new inputs and keeps the last 4 columns; the first output it keeps uses
#        columns 1,2,3 and the new input, so spec hist = conv_state[..., 1:4]
#        (column 0 is dead: it only feeds an output HF throws away).
#        HF conv1d.weight [C, 1, 4] is a cross-correlation: tap 0 on the oldest
#        input, tap 3 on the current one, exactly the spec's conv_w [C, 4].

def state_hf_to_spec(s):
    return np.ascontiguousarray(np.asarray(s).transpose(0, 2, 1, 3))


def state_spec_to_hf(s):
    return np.ascontiguousarray(np.asarray(s).transpose(0, 2, 1, 3))


# --------------------------------------------------------------------------
# Case builders
# --------------------------------------------------------------------------

def random_params(rng, d, hk, hv):
    C = (2 * hk + hv) * d
    conv_w = f32(rng.normal(0.0, 0.5, size=(C, 4)))
    dt = f32(rng.normal(0.0, 1.0, size=hv))
    A_log = f32(np.log(rng.uniform(0.05, 8.0, size=hv)))
    # HF computes -A_log.float().exp(): a float32 exp of the float32 parameter.
    a = -torch.from_numpy(A_log.astype(np.float32)).exp().double().numpy()
    gamma = f32(1.0 + 0.5 * rng.normal(size=d))
    return dict(conv_w=conv_w, dt=dt, a=a, gamma=gamma), A_log


def hf_window(inp, use_chunk):
    """HF's building blocks on one window: causal_conv1d_update (with a 4-column
    conv state whose dead column 0 is filled with junk), the delta rule
    (torch_recurrent_gated_delta_rule or torch_chunk_gated_delta_rule, q/k L2
    norm inside), and Qwen3_5RMSNormGated. Grouped map, silu gate."""
    qkv = t64(inp["qkv"])
    B, T, C = qkv.shape
    d = inp["gamma"].shape[0]
    hv = inp["dt"].shape[0]
    hk = (C // d - hv) // 2
    # conv state: the dead column 0 gets arbitrary finite values
    junk = np.linspace(-3.0, 3.0, B * C).reshape(B, C, 1)
    conv_state = t64(np.concatenate([junk, inp["hist"]], axis=2))
    weight = t64(inp["conv_w"])
    with hf_float64():
        cv = hf.causal_conv1d_update(qkv.transpose(1, 2), conv_state, weight, None, "silu")
        cv = cv.transpose(1, 2)
        q, k, v = torch.split(cv, [hk * d, hk * d, hv * d], dim=-1)
        q = q.reshape(B, T, hk, d)
        k = k.reshape(B, T, hk, d)
        v = v.reshape(B, T, hv, d)
        beta = t64(inp["beta"]).sigmoid()
        g = t64(inp["a"]) * F.softplus(t64(inp["alpha"]) + t64(inp["dt"]))
        s0 = t64(state_spec_to_hf(inp["state"]))
        fn = hf.torch_chunk_gated_delta_rule if use_chunk else hf.torch_recurrent_gated_delta_rule
        o, s1 = fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
        norm = hf.Qwen3_5RMSNormGated(d, eps=EPS).double()
        with torch.no_grad():
            norm.weight.copy_(t64(inp["gamma"]))
            y = norm(o.reshape(-1, d), t64(inp["z"]).reshape(-1, d)).reshape(B, T, hv * d)
    hist = conv_state[..., 1:].numpy()
    return y.detach().numpy(), state_hf_to_spec(s1.numpy()), hist


def window_case(name, desc, seed, B, T, d, hk, hv, use_chunk=False, extreme=False,
                commit="all", scale_state=0.5):
    rng = np.random.default_rng(seed)
    C = (2 * hk + hv) * d
    n = hv * d
    p, _ = random_params(rng, d, hk, hv)
    inp = dict(
        qkv=f32(rng.normal(0.0, 1.0, size=(B, T, C))),
        alpha=f32(rng.normal(0.0, 1.5, size=(B, T, hv))),
        beta=f32(rng.normal(0.0, 2.0, size=(B, T, hv))),
        z=f32(rng.normal(0.0, 2.0, size=(B, T, n))),
        state=f32(rng.normal(0.0, scale_state, size=(B, d, hv, d))),
        hist=f32(rng.normal(0.0, 1.0, size=(B, C, 3))),
        **p,
    )
    if extreme:
        # softplus cut-over: about half the (token, head) pairs get alpha + dt > 20,
        # some land right around 20; huge gate logits on z and beta.
        u = rng.choice([-30.0, -5.0, 19.5, 20.0, 20.5, 25.0, 40.0], size=(B, T, hv))
        inp["alpha"] = f32(u - inp["dt"][None, None, :])
        inp["beta"] = f32(rng.choice([-1, 1], size=(B, T, hv)) * rng.uniform(25.0, 35.0, size=(B, T, hv)))
        inp["z"] = f32(rng.choice([-1, 1], size=(B, T, n)) * rng.uniform(25.0, 35.0, size=(B, T, n)))
    # HF on the whole window: y for every token; the state/history are the
    # committed ones: all T tokens, none (verify), or HF rerun on the first k.
    y, S, Hh = hf_window(inp, use_chunk)
    if commit == "verify":
        S, Hh = inp["state"].copy(), inp["hist"].copy()
    elif commit != "all":
        k = int(commit)
        sub = dict(inp)
        for key in ("qkv", "alpha", "beta", "z"):
            sub[key] = inp[key][:, :k]
        _, S, Hh = hf_window(sub, use_chunk)
    exp = dict(expect_y=y, expect_state=S, expect_hist=Hh)
    return dict(name=name, desc=desc, inp=inp, exp=exp, head_map="grouped", commit=str(commit),
                hk=hk, hf_chunk=use_chunk)


def make_layer(d, hk, hv, hidden, rng):
    cfg = Qwen3_5TextConfig(
        hidden_size=hidden, linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=d, linear_value_head_dim=d, linear_conv_kernel_dim=4,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=2 * hidden, vocab_size=64, rms_norm_eps=EPS,
        layer_types=["linear_attention"], hidden_act="silu",
    )
    layer = hf.Qwen3_5GatedDeltaNet(cfg, 0).double()
    C = (2 * hk + hv) * d
    with torch.no_grad():
        s = 1.0 / np.sqrt(hidden)
        layer.in_proj_qkv.weight.copy_(t64(f32(rng.normal(0, s, size=(C, hidden)))))
        layer.in_proj_z.weight.copy_(t64(f32(rng.normal(0, 2 * s, size=(hv * d, hidden)))))
        layer.in_proj_b.weight.copy_(t64(f32(rng.normal(0, 2 * s, size=(hv, hidden)))))
        layer.in_proj_a.weight.copy_(t64(f32(rng.normal(0, 2 * s, size=(hv, hidden)))))
        layer.out_proj.weight.copy_(t64(f32(rng.normal(0, s, size=(hidden, hv * d)))))
        layer.conv1d.weight.copy_(t64(f32(rng.normal(0, 0.5, size=(C, 1, 4)))))
        layer.dt_bias.copy_(t64(f32(rng.normal(0, 1.0, size=hv))))
        layer.A_log.copy_(t64(f32(np.log(rng.uniform(0.05, 8.0, size=hv)))))
        layer.norm.weight.copy_(t64(f32(1.0 + 0.5 * rng.normal(size=d))))
    return cfg, layer


def run_layer(layer, hidden_states, cache):
    """Qwen3_5GatedDeltaNet.forward in float64. The four input projections are
    rounded to float32 by forward hooks (the step's inputs are F32), and
    out_proj's input, the pre-projection output, is captured as y."""
    got = {}

    def rounder(key):
        def hook(mod, args, out):
            r = out.float().double()
            got[key] = r.detach().numpy().copy()
            return r
        return hook

    def grab_y(mod, args):
        got["y"] = args[0].detach().numpy().copy()

    hs = [layer.in_proj_qkv.register_forward_hook(rounder("qkv")),
          layer.in_proj_z.register_forward_hook(rounder("z")),
          layer.in_proj_b.register_forward_hook(rounder("beta")),
          layer.in_proj_a.register_forward_hook(rounder("alpha")),
          layer.out_proj.register_forward_pre_hook(grab_y)]
    try:
        with hf_float64(), torch.no_grad():
            layer(t64(hidden_states), cache=cache)
    finally:
        for h in hs:
            h.remove()
    return got


def layer_params(layer):
    d = layer.head_v_dim
    return dict(
        conv_w=layer.conv1d.weight.detach().numpy()[:, 0, :].copy(),
        dt=layer.dt_bias.detach().numpy().copy(),
        a=-layer.A_log.detach().float().exp().double().numpy(),
        gamma=layer.norm.weight.detach().numpy().copy(),
    )


def forward_cases(seed):
    """The whole Qwen3_5GatedDeltaNet.forward: a prefill from a zero state, then a
    one-token decode and a 5-token continuation from HF's cache (rounded to f32)."""
    rng = np.random.default_rng(seed)
    d, hk, hv, hidden, B = 16, 2, 4, 48, 2
    cfg, layer = make_layer(d, hk, hv, hidden, rng)
    params = layer_params(layer)
    C = (2 * hk + hv) * d
    cases = []

    cache = DynamicCache(config=cfg)
    x = f32(rng.normal(0, 1, size=(B, 12, hidden)))
    got = run_layer(layer, x, cache)
    lay = cache.layers[0]
    inp = dict(qkv=got["qkv"], alpha=got["alpha"], beta=got["beta"], z=got["z"],
               state=np.zeros((B, d, hv, d)), hist=np.zeros((B, C, 3)), **params)
    exp = dict(expect_y=got["y"],
               expect_state=state_hf_to_spec(lay.recurrent_states[0].numpy()),
               expect_hist=lay.conv_states[0].numpy()[..., 1:].copy())
    cases.append(dict(name="fwd_prefill_t12",
                      desc="Qwen3_5GatedDeltaNet.forward prefill from zero state (causal_conv1d_fn + chunk rule), "
                           "d16 hk2 hv4 B2 T12",
                      inp=inp, exp=exp, head_map="grouped", commit="all", hk=hk, hf_chunk=True))

    for name, T, desc in (("fwd_decode_t1", 1, "one-token decode (causal_conv1d_update + recurrent rule)"),
                          ("fwd_cont_t5", 5, "5-token continuation (conv over cached columns + chunk rule "
                                              "with initial state)")):
        # Continue from HF's cache after the prefill, rounded to f32 so it can be an input.
        cache2 = DynamicCache(config=cfg)
        run_layer(layer, x, cache2)
        lay2 = cache2.layers[0]
        with torch.no_grad():
            lay2.recurrent_states[0].copy_(lay2.recurrent_states[0].float().double())
            lay2.conv_states[0].copy_(lay2.conv_states[0].float().double())
        s_in = state_hf_to_spec(lay2.recurrent_states[0].numpy())
        h_in = lay2.conv_states[0].numpy()[..., 1:].copy()
        x2 = f32(rng.normal(0, 1, size=(B, T, hidden)))
        got2 = run_layer(layer, x2, cache2)
        inp2 = dict(qkv=got2["qkv"], alpha=got2["alpha"], beta=got2["beta"], z=got2["z"],
                    state=s_in, hist=h_in, **params)
        exp2 = dict(expect_y=got2["y"],
                    expect_state=state_hf_to_spec(lay2.recurrent_states[0].numpy()),
                    expect_hist=lay2.conv_states[0].numpy()[..., 1:].copy())
        cases.append(dict(name=name,
                          desc=f"Qwen3_5GatedDeltaNet.forward with cache after fwd_prefill_t12: {desc}, "
                               f"d16 hk2 hv4 B2 T{T}",
                          inp=inp2, exp=exp2, head_map="grouped", commit="all", hk=hk, hf_chunk=(T > 1)))
    return cases


# --------------------------------------------------------------------------
# Tiled head order
# --------------------------------------------------------------------------
# grouped: value head h reads q/k head h // r (r = h_v / h_k);
# tiled:   value head p reads q/k head p % h_k.
# Grouped head h = kh*r + m (kh its q/k head, m its rank within the group) goes
# to tiled position p = m*h_k + kh, so p % h_k = kh. Equivalently tiled
# position p holds grouped head src[p] = (p % h_k)*r + p // h_k. Everything
# indexed by value head moves along: the v channels of qkv, conv_w and hist
# (whole d-blocks), alpha, beta, dt, a, the z and y head blocks, and the state's
# h axis. q/k channels and gamma stay.

def tiled_src(hk, hv):
    r = hv // hk
    return np.array([(p % hk) * r + p // hk for p in range(hv)])


def to_tiled(case):
    inp, exp = case["inp"], case["exp"]
    d = inp["gamma"].shape[0]
    hv = inp["dt"].shape[0]
    hk = case["hk"]
    src = tiled_src(hk, hv)
    C = (2 * hk + hv) * d
    chan = np.concatenate([np.arange(2 * hk * d),
                           np.concatenate([2 * hk * d + src[p] * d + np.arange(d) for p in range(hv)])])
    vout = np.concatenate([src[p] * d + np.arange(d) for p in range(hv)])
    assert sorted(chan.tolist()) == list(range(C))
    ni = dict(
        qkv=inp["qkv"][..., chan], conv_w=inp["conv_w"][chan], hist=inp["hist"][:, chan],
        alpha=inp["alpha"][..., src], beta=inp["beta"][..., src], dt=inp["dt"][src], a=inp["a"][src],
        z=inp["z"][..., vout], state=inp["state"][:, :, src], gamma=inp["gamma"],
    )
    ne = dict(expect_y=exp["expect_y"][..., vout], expect_state=exp["expect_state"][:, :, src],
              expect_hist=exp["expect_hist"][:, chan])
    return dict(name=case["name"] + "_tiled",
                desc=f"{case['name']} with value heads permuted to the tiled order "
                     f"(tiled position p = grouped head {src.tolist()}[p])",
                inp=ni, exp=ne, head_map="tiled", commit=case["commit"], hk=hk, hf_chunk=case["hf_chunk"])


# --------------------------------------------------------------------------
# All cases
# --------------------------------------------------------------------------

def build_cases():
    cases = [
        window_case("win_r1_t1", "decode window, random state/hist, h_v/h_k=1, d16 hk2 hv2 B2 T1",
                    101, B=2, T=1, d=16, hk=2, hv=2),
        window_case("win_r2_t4", "verify-sized window, random state/hist, h_v/h_k=2, d16 hk2 hv4 B3 T4",
                    102, B=3, T=4, d=16, hk=2, hv=4),
        window_case("win_r3_t7", "random state/hist, h_v/h_k=3, d16 hk2 hv6 B2 T7",
                    103, B=2, T=7, d=16, hk=2, hv=6),
        window_case("win_r4_t16_chunk", "random state/hist, h_v/h_k=4, HF chunked rule, d16 hk1 hv4 B1 T16",
                    104, B=1, T=16, d=16, hk=1, hv=4, use_chunk=True),
        window_case("win_r2_t64_d32_chunk", "64-token window, random state/hist, HF chunked rule, "
                    "d32 hk1 hv2 B1 T64", 105, B=1, T=64, d=32, hk=1, hv=2, use_chunk=True),
        window_case("win_extreme_t8", "softplus cut-over (alpha+dt in {-30,-5,19.5,20,20.5,25,40}), "
                    "|beta| and |z| 25..35, h_v/h_k=2, d16 hk2 hv4 B2 T8",
                    106, B=2, T=8, d=16, hk=2, hv=4, extreme=True),
        window_case("win_r2_t6_commit3", "commit first 3 of 6 tokens (state/hist after token 2, "
                    "y for all 6), h_v/h_k=2, d16 hk2 hv4 B2 T6", 107, B=2, T=6, d=16, hk=2, hv=4,
                    commit=3),
        window_case("win_r2_t5_verify", "verify: y for 5 tokens, state/hist unchanged, h_v/h_k=2, "
                    "d16 hk2 hv4 B1 T5", 108, B=1, T=5, d=16, hk=2, hv=4, commit="verify"),
    ]
    cases += forward_cases(200)
    by = {c["name"]: c for c in cases}
    cases.append(to_tiled(by["win_r3_t7"]))
    cases.append(to_tiled(by["fwd_cont_t5"]))
    return cases


def case_bytes(case):
    tensors = {}
    for k, v in case["inp"].items():
        v = np.ascontiguousarray(v, dtype=np.float64)
        assert np.array_equal(v.astype(np.float32).astype(np.float64), v), f"{case['name']}: {k} not f32-exact"
        tensors[k] = v.astype(np.float32)
    for k, v in case["exp"].items():
        tensors[k] = np.ascontiguousarray(v, dtype=np.float64)
    meta = {"head_map": case["head_map"], "gate": "silu", "eps": "1e-6", "commit": case["commit"],
            "case": case["desc"]}
    data = write_safetensors(tensors, meta)
    back = load(data)  # the official reader must read back exactly what went in
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)
    return data


def write_safetensors(tensors, meta):
    """A byte-stable safetensors writer: the library's own writer orders the
    metadata keys differently from run to run (a hash map), which would make the
    files change on every regeneration. Here the header keys are sorted, tensors
    are laid out in name order, and the header is padded with spaces to 8 bytes."""
    dtypes = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}
    header = {"__metadata__": dict(sorted(meta.items()))}
    blobs = []
    off = 0
    for name in sorted(tensors):
        v = np.ascontiguousarray(tensors[name])
        b = v.astype(v.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtypes[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    return struct.pack("<Q", len(hj)) + hj + b"".join(blobs)


def verify_case(case):
    """numpy SPEC vs HF, on the F32 inputs as they go into the file."""
    inp = {k: np.asarray(v, dtype=np.float32).astype(np.float64) for k, v in case["inp"].items()}
    y, S, H = spec_step(inp, case["head_map"], "silu", EPS, case["commit"])
    e = case["exp"]
    return rel(y, e["expect_y"]), rel(S, e["expect_state"]), rel(H, e["expect_hist"])


def f32_hf_error(case):
    """HF's own float32 path (no float64 patch) on the same window, vs the float64
    reference: the order of error an f32 implementation makes."""
    if case["head_map"] != "grouped" or case["name"].startswith("fwd"):
        return None
    y, S, _ = _hf_window_f32(case["inp"], case["hf_chunk"])
    e = case["exp"]
    if case["commit"] != "all":  # the committed state is not the window's last one
        return rel(y, e["expect_y"]), float("nan")
    return rel(y, e["expect_y"]), rel(S, e["expect_state"])


def _hf_window_f32(inp, use_chunk):
    qkv = torch.from_numpy(inp["qkv"].astype(np.float32))
    B, T, C = qkv.shape
    d = inp["gamma"].shape[0]
    hv = inp["dt"].shape[0]
    hk = (C // d - hv) // 2
    f = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    conv_state = f(np.concatenate([np.zeros((B, C, 1)), inp["hist"]], axis=2))
    cv = hf.causal_conv1d_update(qkv.transpose(1, 2), conv_state, f(inp["conv_w"]), None, "silu").transpose(1, 2)
    q, k, v = torch.split(cv, [hk * d, hk * d, hv * d], dim=-1)
    beta = f(inp["beta"]).sigmoid()
    g = f(inp["a"]) * F.softplus(f(inp["alpha"]) + f(inp["dt"]))
    fn = hf.torch_chunk_gated_delta_rule if use_chunk else hf.torch_recurrent_gated_delta_rule
    o, s1 = fn(q.reshape(B, T, hk, d), k.reshape(B, T, hk, d), v.reshape(B, T, hv, d), g=g, beta=beta,
               initial_state=f(state_spec_to_hf(inp["state"])), output_final_state=True,
               use_qk_l2norm_in_kernel=True)
    norm = hf.Qwen3_5RMSNormGated(d, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(f(inp["gamma"]))
        y = norm(o.reshape(-1, d), f(inp["z"]).reshape(-1, d)).reshape(B, T, hv * d)
    return y.detach().double().numpy(), state_hf_to_spec(s1.double().numpy()), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = ap.parse_args()
    torch.set_num_threads(1)

    cases = build_cases()
    ok = True
    total = 0
    if not args.check:
        os.makedirs(args.out, exist_ok=True)
    print(f"{'case':28s} {'bytes':>7s}  spec-vs-HF(f64) rel err: y / state / hist   HF-f32 vs f64: y / state")
    for c in cases:
        ey, es, eh = verify_case(c)
        good = max(ey, es, eh) < SPEC_TOL
        ok &= good
        f32e = f32_hf_error(c)
        f32s = "" if f32e is None else f"   {f32e[0]:.2e} / {f32e[1]:.2e}"
        data = case_bytes(c)
        total += len(data)
        path = os.path.join(args.out, c["name"] + ".safetensors")
        if args.check:
            same = os.path.exists(path) and open(path, "rb").read() == data
            ok &= same
            tag = "same" if same else "DIFFERS"
        else:
            with open(path, "wb") as fh:
                fh.write(data)
            tag = hashlib.sha256(data).hexdigest()[:12]
        print(f"{c['name']:28s} {len(data):7d}  {ey:.2e} / {es:.2e} / {eh:.2e}  {'ok' if good else 'FAIL'}"
              f"{f32s}  {tag}")
    print(f"total {total} bytes in {len(cases)} files")
    if total > 2 * 1024 * 1024:
        print("FAIL: fixtures exceed 2 MB")
        ok = False
    if not ok:
        print("FAILED")
        sys.exit(1)
    print("all cases: numpy SPEC agrees with HF (float64)")


if __name__ == "__main__":
    main()
