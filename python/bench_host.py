"""The host cost of one gdn.step call at B 1 (decode), at the seed's shape (d 128, 16 key heads, 48 value
heads) or a given one.

    python python/bench_host.py                 # CPU: numpy f32 and (if installed) torch CPU
    python python/bench_host.py --device cuda   # CUDA: torch bf16 on torch's current stream

Prints per call (median of rounds):
- check: gdn's argument extraction and checks alone (gdn._native._check_only: every tensor's pointer, shape,
  strides, dtype and device read, every check run, nothing stepped); this is the Python-call overhead.
- call: a whole gdn.step. On the CPU that includes the step itself (and the staging of the slot); on CUDA it is the
  host time to issue the launch (no sync), to set against
- kernel: the device time of one step, from CUDA events around a graph of 20 captured steps.
- floor: a trivial torch/numpy call of the same kind (tensor.data_ptr()), for scale.
"""

import argparse
import statistics
import time

import numpy as np

import gdn
from gdn import _native


def per_call(f, iters, rounds=15):
    for _ in range(iters):
        f()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            f()
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def layer_of(d, h_k, h_v):
    rng = np.random.default_rng(0)
    c = (2 * h_k + h_v) * d
    return gdn.Layer(rng.standard_normal((c, 1, 4)).astype(np.float32) * 0.3, np.zeros(h_v, np.float32),
                     np.zeros(h_v, np.float32), np.ones(d, np.float32), num_k_heads=h_k, num_v_heads=h_v,
                     head_dim=d)


def tensors(lib, d, h_k, h_v, slots, dtype, state_dtype, device):
    c, n = (2 * h_k + h_v) * d, h_v * d
    rng = np.random.default_rng(1)
    arrays = dict(qkv=rng.standard_normal((1, c)), a=rng.standard_normal((1, h_v)), b=rng.standard_normal((1, h_v)),
                  z=rng.standard_normal((1, n)), state=np.zeros((slots, h_v, d, d)), conv=np.zeros((slots, c, 4)),
                  out=np.zeros((1, n)))
    if lib == "numpy":
        x = {k: v.astype(np.float32) for k, v in arrays.items()}
        x.update(slots=np.array([slots // 2], np.int32), cu=np.array([0, 1], np.int32))
        return x
    import torch
    x = {k: torch.from_numpy(v).to(device=device, dtype=state_dtype if k == "state" else dtype)
         for k, v in arrays.items()}
    x.update(slots=torch.tensor([slots // 2], dtype=torch.int32, device=device),
             cu=torch.tensor([0, 1], dtype=torch.int32, device=device))
    return x


def run(fn, layer, x):
    return fn(layer, x["qkv"], x["a"], x["b"], x["z"], x["state"], x["conv"], x["slots"], cu_seqlens=x["cu"],
              out=x["out"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="128,16,48", help="d,h_k,h_v")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    d, h_k, h_v = map(int, args.shape.split(","))
    layer = layer_of(d, h_k, h_v)
    us = lambda t: f"{t * 1e6:8.2f} us"  # noqa: E731
    print(f"shape d {d}, h_k {h_k}, h_v {h_v}; B 1 decode; device {args.device}")
    cases = []
    if args.device == "cpu":
        cases.append(("numpy f32", tensors("numpy", d, h_k, h_v, args.slots, None, None, "cpu")))
        try:
            import torch
            cases.append(("torch cpu f32", tensors("torch", d, h_k, h_v, args.slots, torch.float32, torch.float32,
                                                   "cpu")))
        except ImportError:
            pass
    else:
        import torch
        cases.append(("torch cuda bf16 (bf16 state)", tensors("torch", d, h_k, h_v, args.slots, torch.bfloat16,
                                                              torch.bfloat16, "cuda")))
    for name, x in cases:
        print(f"-- {name}")
        check = per_call(lambda: run(_native._check_only, layer, x), args.iters)
        floor_t = per_call(lambda: x["qkv"].data_ptr() if hasattr(x["qkv"], "data_ptr") else
                           x["qkv"].__array_interface__, args.iters)
        iters = args.iters if args.device == "cuda" else max(20, args.iters // 50)
        call = per_call(lambda: run(gdn.step, layer, x), iters)
        print(f"check  {us(check)}   (argument extraction and checks: the call's overhead)")
        print(f"call   {us(call)}   (a whole gdn.step{'; host issue time' if args.device == 'cuda' else ''})")
        print(f"floor  {us(floor_t)}   (one data_ptr() / __array_interface__ read)")
        if args.device == "cuda":
            import torch
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                for _ in range(20):
                    run(gdn.step, layer, x)
            torch.cuda.current_stream().wait_stream(s)
            g.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(20):
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) / 1e3 / 20)
            kernel = statistics.median(ts)
            print(f"kernel {us(kernel)}   (device time per step, graph of 20 steps)")
            # issue time when the stream keeps up: eager calls back to back, then the sync, per call
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                run(gdn.step, layer, x)
            torch.cuda.synchronize()
            eager = (time.perf_counter() - t0) / 200
            print(f"eager  {us(eager)}   (eager back-to-back calls incl. the final sync, per call)")
            print(f"over   {us(max(eager - kernel, 0))}   (eager per call minus kernel)")
            layer.check_faults()


if __name__ == "__main__":
    main()
