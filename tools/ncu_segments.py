#!/usr/bin/env python3
"""Where a kernel's time goes, from ncu's source page: the warp-stall samples and executed instructions of each
stretch of SASS between two block barriers (BAR.SYNC), with the top stall reasons and opcodes of each.

    ncu --set full -k regex:gdn_step --launch-skip 3 --launch-count 1 -o rep <command>
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 tools/ncu_segments.py src.csv [warps]

`warps` (the launch's warps: blocks x threads / 32) turns executed instructions into instructions a warp.
tools/device/h200_ncu_window.sh writes such a CSV for the window kernel."""
import collections
import csv
import sys


def main():
    rows = list(csv.reader(open(sys.argv[1])))
    warps = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "(Not" not in h]
    num = lambda r, key: int(r[ix[key]] or 0)
    total = sum(num(r, "Warp Stall Sampling (All Samples)") for r in data)
    print(f"{len(data)} SASS instructions, {total} stall samples")
    start, samples, executed = 0, 0, 0
    reasons, ops = collections.Counter(), collections.Counter()
    for n, r in enumerate(data):
        src = r[1].strip()
        words = src.split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else ""))
        samples += num(r, "Warp Stall Sampling (All Samples)")
        e = num(r, "Instructions Executed")
        executed += e
        ops[op.split(".")[0]] += e
        for h in stalls:
            reasons[h[len("stall_"):]] += num(r, h)
        if "BAR.SYNC" in src or n == len(data) - 1:
            if samples * 100 >= total:
                per = f", {executed / warps:.0f} a warp" if warps else ""
                top_r = ", ".join(f"{k} {v}" for k, v in reasons.most_common(4) if v)
                top_o = ", ".join(f"{k} {v / warps:.0f}" if warps else f"{k} {v}" for k, v in ops.most_common(6))
                print(f"{start:5d}-{n:5d}: {100 * samples / max(total, 1):4.1f}% of samples{per}; stalls: {top_r}; "
                      f"ops: {top_o}")
            start, samples, executed = n + 1, 0, 0
            reasons, ops = collections.Counter(), collections.Counter()


if __name__ == "__main__":
    main()
