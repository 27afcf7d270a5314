#!/usr/bin/env python3
"""FlashInfer 0.7's speculative-decoding flows on the H200, for issue 15's side by side with `gdn bench --spec`.

Every step verifies a window of W drafted tokens per sequence (bf16 q/k/v/a/b, f32 state pool [P, 48, 128,
128], value-major) and keeps a random prefix of it (0..=W accepted, seeded, as `gdn bench --spec` draws):
- `inter+copy`: `gated_delta_rule_mtp` verify-only with `intermediate_states_buffer` [B, W, 48, 128, 128]
  (every token's state written), then the accepted token's state copied into the pool (`index_copy_` of the
  gathered rows; sequences that accept nothing keep their state).
- `slot-per-token`: the same kernel with `ssm_state_indices` [B, W] writing every token's state to its own pool
  slot (the FLA / vLLM flow); the next step reads the accepted token's slot, no copy.
- `verify`: the verify alone (no state written), the floor of any flow that reads the state once.
A CUDA graph of 20 steps (each its own acceptances), replayed; median of 7 rounds; us per step.
Run with FlashInfer importable (tools/device/h200_side_by_side.sh sets PYTHONPATH after fi_run.sh unpacked it).
"""
import argparse
import json
import os
import statistics

import torch

H, HV, K = 16, 48, 128


def graph_us(fns, rounds=7, round_ms=20.0):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    e1.synchronize()
    reps = max(1, min(200, int(round_ms / max(e0.elapsed_time(e1), 1e-3))))
    ts = []
    for _ in range(rounds):
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / (reps * len(fns)))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--windows", default="4,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    import flashinfer.gdn_decode as gd

    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(7)
    bf = torch.bfloat16
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1.0, 16.0))
    dt = torch.exp(torch.empty(HV, device=dev).uniform_(-6.9, -2.3))
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).float()
    res = {}
    print(f"{'B':>4} {'W':>2} {'inter+copy us':>14} {'slot-per-token us':>18} {'verify us':>10}", flush=True)
    for B in [int(x) for x in a.batch.split(",")]:
        for W in [int(x) for x in a.windows.split(",")]:
            q = torch.randn(B, W, H, K, device=dev, dtype=bf)
            k = torch.randn(B, W, H, K, device=dev, dtype=bf)
            v = torch.randn(B, W, HV, K, device=dev, dtype=bf)
            ga = (torch.randn(B, W, HV, device=dev) * 0.5).to(bf)
            gb = torch.randn(B, W, HV, device=dev).to(bf)
            out = torch.empty(B, W, HV, K, device=dev, dtype=bf)
            acc = [torch.randint(0, W + 1, (B,), generator=gen) for _ in range(a.steps)]
            row = {}
            try:
                pool = torch.randn(B, HV, K, K, device=dev) * 0.02
                idx = torch.arange(B, dtype=torch.int32, device=dev)
                inter = torch.empty(B, W, HV, K, K, device=dev)
                sel = []
                for ac in acc:
                    keep = (ac > 0).nonzero().flatten()
                    sel.append((keep.to(dev), (ac[keep] - 1).to(dev)))

                def step_copy(keep, t):
                    def f():
                        gd.gated_delta_rule_mtp(q, k, v, pool, idx, A_log, ga, dt_bias, gb, output=out,
                                                intermediate_states_buffer=inter, disable_state_update=True)
                        pool.index_copy_(0, keep, inter[keep, t])
                    return f
                row["inter_copy"] = graph_us([step_copy(kp, t) for kp, t in sel])

                def verify():
                    gd.gated_delta_rule_mtp(q, k, v, pool, idx, A_log, ga, dt_bias, gb, output=out,
                                            disable_state_update=True)
                row["verify"] = graph_us([verify] * a.steps)
                del pool, inter
                torch.cuda.empty_cache()

                # two banks of W slots per sequence plus its home slot: step i writes every token's state to
                # bank i % 2 and reads the slot step i - 1 accepted (in the other bank), or the home slot when it
                # accepted nothing, so no call reads a slot it writes. This times the flow's traffic (one state
                # read, W written, no copy); the values are not checked.
                P = B * (2 * W + 1)
                pool = torch.randn(P, HV, K, K, device=dev) * 0.02
                base = torch.arange(B) * (2 * W + 1)
                banks = [(base[:, None] + 1 + j * W + torch.arange(W)[None, :]).to(torch.int32).to(dev)
                         for j in range(2)]
                reads, writes, prev = [], [], None
                for i, ac in enumerate(acc):
                    r = base if prev is None else torch.where(prev > 0, base + 1 + ((i - 1) % 2) * W + prev - 1, base)
                    reads.append(r.to(torch.int32).to(dev))
                    writes.append(banks[i % 2])
                    prev = ac

                def step_slots(r, w):
                    def f():
                        gd.gated_delta_rule_mtp(q, k, v, pool, r, A_log, ga, dt_bias, gb, output=out,
                                                ssm_state_indices=w, disable_state_update=False)
                    return f
                row["slot_per_token"] = graph_us([step_slots(r, w) for r, w in zip(reads, writes)])
                del pool
                torch.cuda.empty_cache()
            except Exception as e:  # report, go on with the next case
                row["error"] = repr(e)[:300]
            res[f"B{B}_W{W}"] = row
            f = lambda key: f"{row[key]:.1f}" if key in row else "-"
            print(f"{B:>4} {W:>2} {f('inter_copy'):>14} {f('slot_per_token'):>18} {f('verify'):>10}"
                  + (f"  {row['error']}" if "error" in row else ""), flush=True)
    json.dump(res, open(os.path.join(a.out, "fi_spec_flow.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
