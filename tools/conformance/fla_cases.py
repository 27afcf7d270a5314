#!/usr/bin/env python3
"""FLA (flash-linear-attention 0.6.0) vs a float64 torch transcription of SPEC.md.

Meant for a CUDA machine with torch and triton, no network and no FLA
installed: unpack the two wheels `fla-core==0.6.0` and
`flash-linear-attention==0.6.0` and put them on PYTHONPATH, e.g.

    mkdir -p /tmp/fla && cd /tmp/fla && for w in /path/to/*.whl; do python -m zipfile -e "$w" .; done
    PYTHONPATH=/tmp/fla OUT=/some/dir python tools/conformance/fla_cases.py

What it does:
  1. Self-test (no GPU, no FLA needed): the float64 torch SPEC step below is
     replayed on every HF fixture in crates/gdn-conformance/fixtures/hf and must
     match HF's float64 outputs to 1e-11. This proves the reference and the
     file reader before anything is compared with FLA.
  2. For each case: random inputs in the `gdn step` format (grouped head map),
     the reference step in float64 (conv, SiLU, L2 norm, gates, delta rule,
     readout, gated norm), then FLA on the same window: q, k, v are the
     reference's conv+SiLU outputs rounded to float32; the gate, beta sigmoid and
     q/k L2 norm run inside FLA's kernels (use_gate_in_kernel with A_log and
     dt_bias, use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel).
     FLA's pre-norm output o and its final state are compared with the
     reference's (relative error ||fla - ref|| / ||ref|| per tensor).
  3. Writes every case to $OUT (or /tmp/fla_cases) as <case>.safetensors:
     the step inputs (F32), expect_y / expect_state / expect_hist / expect_o
     (F64, the reference), and fla_o [B,T,h_v*d] / fla_state [B,d,h_v,d] (F32,
     FLA's results converted to the spec's layouts).

Exit status: 0 when the self-test passed and every FLA result is within its
bound (fused_recurrent 1e-4; chunk 1e-2, since its matmuls may run in TF32),
1 otherwise, 2 when FLA or CUDA is missing (after the self-test).

Needs only torch (and triton for FLA); no numpy, safetensors or einops (a stub
stands in for einops if it is absent: FLA's package imports it, the two
functions used here do not).
"""

import argparse
import ctypes
import json
import math
import os
import struct
import sys
import traceback
import types

import torch

EPS = 1e-6
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HF_FIXTURES = os.path.join(REPO, "crates", "gdn-conformance", "fixtures", "hf")

# --------------------------------------------------------------------------
# safetensors, read and written with the standard library and torch only
# --------------------------------------------------------------------------

_DT = {"F32": torch.float32, "F64": torch.float64}
_DT_NAME = {torch.float32: "F32", torch.float64: "F64"}


def read_st(path):
    with open(path, "rb") as f:
        raw = f.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        dt = _DT[info["dtype"]]
        buf = bytearray(raw[base + a: base + b])
        t = torch.frombuffer(buf, dtype=dt) if len(buf) else torch.empty(0, dtype=dt)
        out[name] = t.reshape(info["shape"]).clone()
    return out, meta


def write_st(path, tensors, meta):
    header = {"__metadata__": {k: str(v) for k, v in sorted(meta.items())}}
    blobs, off = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        b = _tobytes(t)
        header[name] = {"dtype": _DT_NAME[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj + b"".join(blobs))
    return 8 + len(hj) + off


def _tobytes(t):
    """Raw little-endian bytes of a contiguous CPU tensor (no numpy needed)."""
    assert sys.byteorder == "little" and t.is_contiguous() and t.device.type == "cpu"
    t = t.clone()  # own storage, offset 0
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def rel(out, ref):
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    n = torch.linalg.vector_norm(ref).item()
    e = torch.linalg.vector_norm(out - ref).item()
    return e / n if n > 0 else e


# --------------------------------------------------------------------------
# SPEC.md in float64 torch (vectorized over sequences and heads)
# --------------------------------------------------------------------------

def spec_softplus(u):
    e = torch.exp(u)
    w = 1.0 + e
    acc = torch.where(w == 1.0, e, torch.log(w) * e / (w - 1.0))
    return torch.where(u > 20.0, u, acc)


def conv_silu(qkv, hist, conv_w):
    """Spec step 1 for a whole window. Returns (cv [B,T,C], committed histories
    after each token [T+1][B,C,3])."""
    B, T, C = qkv.shape
    Hs = hist.clone()
    cvs, hists = [], [Hs]
    for t in range(T):
        x = torch.cat([Hs, qkv[:, t, :, None]], dim=2)
        s = torch.zeros(B, C, dtype=torch.float64)
        for k in range(4):
            s = x[:, :, k] * conv_w[:, k] + s
        cvs.append(s / (1.0 + torch.exp(-s)))
        Hs = x[:, :, 1:].clone()
        hists.append(Hs)
    return torch.stack(cvs, dim=1), hists


def spec_step(inp, head_map="grouped", act="silu", eps=EPS, commit="all"):
    """Returns y [B,T,n], state [B,d,h_v,d], hist [B,C,3] (as committed) and the
    pre-norm readout o [B,T,n], all float64."""
    f = lambda k: inp[k].to(torch.float64)
    qkv, alpha, beta, z = f("qkv"), f("alpha"), f("beta"), f("z")
    conv_w, dt, a, gamma = f("conv_w"), f("dt"), f("a"), f("gamma")
    if qkv.dim() == 2:  # batch dimension left out
        qkv, alpha, beta, z = (x.unsqueeze(0) for x in (qkv, alpha, beta, z))
    B, T, C = qkv.shape
    d, hv = gamma.shape[0], dt.shape[0]
    hk = (C // d - hv) // 2
    assert (2 * hk + hv) * d == C, "C does not fit d and h_v"
    n = hv * d
    state = f("state").reshape(B, d, hv, d) if "state" in inp else torch.zeros(B, d, hv, d, dtype=torch.float64)
    hist = f("hist").reshape(B, C, 3) if "hist" in inp else torch.zeros(B, C, 3, dtype=torch.float64)
    if head_map == "grouped":
        gidx = torch.arange(hv) // (hv // hk)
    elif head_map == "tiled":
        gidx = torch.arange(hv) % hk
    else:
        raise ValueError(head_map)
    actf = {"silu": lambda x: x / (1.0 + torch.exp(-x)), "sigmoid": lambda x: 1.0 / (1.0 + torch.exp(-x))}[act]
    kc = {"all": T, "verify": 0}.get(commit)
    kc = int(commit) if kc is None else kc

    cv, hists = conv_silu(qkv, hist, conv_w)
    S = state.permute(0, 2, 1, 3).clone()  # [B, h, i, j]
    S_commit = S.clone() if kc == 0 else None
    ys, os_ = [], []
    rd = 1.0 / math.sqrt(d)
    for t in range(T):
        c = cv[:, t]
        q = c[:, :hk * d].reshape(B, hk, d)[:, gidx]
        k = c[:, hk * d:2 * hk * d].reshape(B, hk, d)[:, gidx]
        v = c[:, 2 * hk * d:].reshape(B, hv, d)
        rq = 1.0 / torch.sqrt((q * q).sum(-1, keepdim=True) / d + eps / d)
        rk = 1.0 / torch.sqrt((k * k).sum(-1, keepdim=True) / d + eps / d)
        qh = (rq * q) * rd
        kh = (rk * k) * rd
        gate = torch.exp(spec_softplus(alpha[:, t] + dt) * a)  # [B, h]
        b = 1.0 / (1.0 + torch.exp(-beta[:, t]))
        kv = torch.einsum("bhi,bhij->bhj", kh, S)
        delta = (v - gate[..., None] * kv) * b[..., None]
        S = gate[..., None, None] * S + kh[..., :, None] * delta[..., None, :]
        o = torch.einsum("bhi,bhij->bhj", qh, S) * rd
        rs = 1.0 / torch.sqrt((o * o).sum(-1, keepdim=True) / d + eps)
        zz = z[:, t].reshape(B, hv, d)
        ys.append((((rs * o) * gamma) * actf(zz)).reshape(B, n))
        os_.append(o.reshape(B, n))
        if t + 1 == kc:
            S_commit = S.clone()
    y = torch.stack(ys, 1)
    o = torch.stack(os_, 1)
    return y, S_commit.permute(0, 2, 1, 3).contiguous(), hists[kc], o, cv


# --------------------------------------------------------------------------
# 1. Self-test against the HF fixtures
# --------------------------------------------------------------------------

def selftest(folder, tol=1e-11):
    if not os.path.isdir(folder):
        print(f"[selftest] SKIPPED: no HF fixtures at {folder}")
        return True
    files = sorted(x for x in os.listdir(folder) if x.endswith(".safetensors"))
    if not files:
        print(f"[selftest] SKIPPED: {folder} holds no .safetensors")
        return True
    ok = True
    for fn in files:
        t, meta = read_st(os.path.join(folder, fn))
        y, S, H, _, _ = spec_step(t, meta.get("head_map", "grouped"), meta.get("gate", "silu"),
                                  float(meta.get("eps", EPS)), meta.get("commit", "all"))
        e = (rel(y, t["expect_y"]), rel(S, t["expect_state"]), rel(H, t["expect_hist"]))
        good = max(e) < tol
        ok &= good
        print(f"[selftest] {fn:40s} y {e[0]:.1e}  state {e[1]:.1e}  hist {e[2]:.1e}  {'ok' if good else 'FAIL'}")
    print(f"[selftest] torch float64 SPEC vs HF fixtures: {'PASS' if ok else 'FAIL'} ({len(files)} files)")
    return ok


# --------------------------------------------------------------------------
# 2. FLA cases
# --------------------------------------------------------------------------

CASES = [
    # name, fla function, B, T, d, h_k, h_v, extreme
    ("rec_d128_r2_t1", "fused_recurrent", 2, 1, 128, 2, 4, False),
    ("rec_d128_r3_t16", "fused_recurrent", 1, 16, 128, 1, 3, False),
    ("rec_d64_r2_t8_extreme", "fused_recurrent", 2, 8, 64, 2, 4, True),
    ("chunk_d64_r2_t256", "chunk", 1, 256, 64, 1, 2, False),
    ("chunk_d128_r2_t200", "chunk", 1, 200, 128, 1, 2, False),
]
BOUND = {"fused_recurrent": 1e-4, "chunk": 1e-2}


def make_inputs(seed, B, T, d, hk, hv, extreme):
    g = torch.Generator().manual_seed(seed)
    C, n = (2 * hk + hv) * d, hv * d
    r = lambda *s, sd=1.0, mu=0.0: (torch.randn(*s, generator=g, dtype=torch.float64) * sd + mu).float()
    A_log = torch.log(torch.rand(hv, generator=g, dtype=torch.float64) * 7.95 + 0.05).float()
    inp = dict(
        qkv=r(B, T, C), alpha=r(B, T, hv, sd=1.5), beta=r(B, T, hv, sd=2.0), z=r(B, T, n, sd=2.0),
        conv_w=r(C, 4, sd=0.5), dt=r(hv), a=-torch.exp(A_log), gamma=r(d, sd=0.5, mu=1.0),
        state=r(B, d, hv, d, sd=0.5), hist=r(B, C, 3),
    )
    if extreme:
        choices = torch.tensor([-30.0, -5.0, 19.5, 20.0, 20.5, 25.0, 40.0], dtype=torch.float64)
        u = choices[torch.randint(0, len(choices), (B, T, hv), generator=g)]
        inp["alpha"] = (u - inp["dt"].double()).float()
        sign = torch.randint(0, 2, (B, T, hv), generator=g).double() * 2 - 1
        inp["beta"] = (sign * (25 + 10 * torch.rand(B, T, hv, generator=g, dtype=torch.float64))).float()
    return inp, A_log


def import_fla():
    try:
        import einops  # noqa: F401
    except ImportError:
        stub = types.ModuleType("einops")

        def _missing(*a, **k):
            raise RuntimeError("einops is not installed (stub)")
        for nm in ("rearrange", "reduce", "repeat", "einsum", "pack", "unpack", "parse_shape"):
            setattr(stub, nm, _missing)
        sys.modules["einops"] = stub
        print("[fla] einops not installed: a stub stands in (unused by the two functions called)")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    import fla
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule, getattr(fla, "__version__", "?")


def mock_fla(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
             use_beta_sigmoid_in_kernel=False, **kw):
    """A float32 torch stand-in with the FLA call signature and semantics as read
    from FLA 0.6.0's kernels (state [B,HV,K,V], grouped heads, 1e-6 inside the
    L2 norm's sqrt, scale K^-0.5). Only for --mock-fla: it checks this script's
    plumbing (layouts, conversions, file writing) where no GPU is at hand."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // H
    q = q.float().repeat_interleave(rep, dim=2)
    k = k.float().repeat_interleave(rep, dim=2)
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (K ** -0.5 if scale is None else scale)
    if use_gate_in_kernel:
        g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(g.float() + dt_bias.float())
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float())
    h = initial_state.float().clone() if initial_state is not None else torch.zeros(B, HV, K, V)
    o = torch.empty(B, T, HV, V)
    for t in range(T):
        h = h * torch.exp(g[:, t])[..., None, None]
        vt = beta[:, t, :, None] * (v[:, t].float() - torch.einsum("bhk,bhkv->bhv", k[:, t], h))
        h = h + k[:, t, :, :, None] * vt[:, :, None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], h)
    return o, (h if output_final_state else None)


def run_fla(which, fns, q, k, v, alpha, beta, A_log, dt, h0):
    """FLA with gate, beta sigmoid and q/k L2 norm in the kernel. Returns
    (o [B,T,hv,d], state [B,hv,d,d]) and a note on how it was called."""
    fused, chunk = fns
    common = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if which == "fused_recurrent":
        o, s = fused(q, k, v, g=alpha, beta=beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt,
                     use_beta_sigmoid_in_kernel=True, **common)
        return o, s, "in-kernel gate/beta/l2norm"
    try:
        o, s = chunk(q, k, v, g=alpha, beta=beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt,
                     use_beta_sigmoid_in_kernel=True, **common)
        return o, s, "in-kernel gate/beta/l2norm"
    except Exception as ex:  # older/newer signature: log-space gate computed outside
        print(f"[fla] chunk with in-kernel gate failed ({type(ex).__name__}: {ex}); retrying with g precomputed")
        g = -torch.exp(A_log) * torch.nn.functional.softplus(alpha + dt)
        o, s = chunk(q, k, v, g=g, beta=torch.sigmoid(beta), **common)
        return o, s, "g and sigmoid(beta) precomputed in f32"


def fla_case(spec, fns, dev, out_dir, fla_version, seed):
    name, which, B, T, d, hk, hv, extreme = spec
    inp, A_log = make_inputs(seed, B, T, d, hk, hv, extreme)
    y, S, H, o_ref, cv = spec_step(inp)
    n = hv * d
    # FLA's inputs: the reference's conv+SiLU output in float32, grouped heads.
    cvf = cv.float()
    q = cvf[..., :hk * d].reshape(B, T, hk, d)
    k = cvf[..., hk * d:2 * hk * d].reshape(B, T, hk, d)
    v = cvf[..., 2 * hk * d:].reshape(B, T, hv, d)
    h0 = inp["state"].permute(0, 2, 1, 3).contiguous()  # spec [B,d,hv,d] -> FLA/HF [B,hv,d_k,d_v]
    to = lambda x: x.contiguous().to(dev)
    results = {}
    for w in ("fused_recurrent", "chunk"):
        try:
            o, s, how = run_fla(w, fns, to(q), to(k), to(v), to(inp["alpha"]), to(inp["beta"]), to(A_log),
                                to(inp["dt"]), to(h0))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            o = o.float().cpu().reshape(B, T, n)
            s = s.float().cpu().permute(0, 2, 1, 3).contiguous()
            results[w] = (o, s, rel(o, o_ref), rel(s, S), how)
        except Exception as ex:
            traceback.print_exc()
            results[w] = (None, None, float("inf"), float("inf"), f"raised {type(ex).__name__}")
    ok = True
    for w, (_, _, eo, es, how) in results.items():
        primary = w == which
        good = max(eo, es) < BOUND[w]
        if primary:
            ok &= good
        print(f"[fla] {name:24s} {w:15s} o {eo:.2e}  state {es:.2e}  "
              f"{'ok' if good else 'ABOVE ' + format(BOUND[w], '.0e')}{'' if primary else ' (side check)'}  [{how}]")
    o, s = results[which][0], results[which][1]
    tensors = {k_: v_.float() for k_, v_ in inp.items()}
    tensors.update(expect_y=y, expect_state=S, expect_hist=H, expect_o=o_ref)
    if o is not None:
        tensors.update(fla_o=o, fla_state=s)
    meta = dict(head_map="grouped", gate="silu", eps="1e-6", commit="all",
                case=f"FLA {fla_version} {which}_gated_delta_rule vs float64 SPEC, d{d} hk{hk} hv{hv} B{B} T{T}"
                     + (", softplus cut-over and |beta| 25..35" if extreme else ""),
                fla_fn=f"{which}_gated_delta_rule", fla_version=fla_version,
                fla_rel_o=f"{results[which][2]:.3e}", fla_rel_state=f"{results[which][3]:.3e}")
    path = os.path.join(out_dir, name + ".safetensors")
    size = write_st(path, tensors, meta)
    print(f"[fla] wrote {path} ({size} bytes)")
    return ok


def main():
    ap = argparse.ArgumentParser(description="FLA gated delta rule vs float64 SPEC reference")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/fla_cases", help="output folder ($OUT)")
    ap.add_argument("--fixtures", default=HF_FIXTURES, help="HF fixtures for the self-test")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--selftest-only", action="store_true", help="only check the reference against HF fixtures")
    ap.add_argument("--mock-fla", action="store_true",
                    help="no GPU: run the cases on the CPU with a float32 torch stand-in for FLA (plumbing test)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, out {args.out}")

    ok = selftest(args.fixtures)
    if args.selftest_only:
        sys.exit(0 if ok else 1)
    if args.mock_fla:
        fused, chunk, ver = mock_fla, mock_fla, "mock"
        args.device = "cpu"
        print("[fla] --mock-fla: a float32 torch stand-in replaces FLA; this only tests the script")
    else:
        if not torch.cuda.is_available() and args.device.startswith("cuda"):
            print("[fla] no CUDA device: FLA cases not run (use --mock-fla to test the script on a CPU)")
            sys.exit(2)
        try:
            fused, chunk, ver = import_fla()
        except Exception:
            traceback.print_exc()
            print("[fla] cannot import FLA (fla.ops.gated_delta_rule): is it on PYTHONPATH?")
            sys.exit(2)
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = "?"
    print(f"[fla] fla {ver}, triton {tv}, device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else args.device}")
    os.makedirs(args.out, exist_ok=True)
    want = [c for c in args.cases.split(",") if c]
    for i, spec in enumerate(CASES):
        if want and spec[0] not in want:
            continue
        try:
            ok &= fla_case(spec, (fused, chunk), args.device, args.out, ver, args.seed + i)
        except Exception:
            traceback.print_exc()
            print(f"[fla] {spec[0]}: FAILED with an exception")
            ok = False
    print("RESULT:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
