#!/usr/bin/env python3
"""Times two `gdn` builds against each other on a shared (noisy) CPU host: runs them in turn, N rounds, with the
same arguments, and prints every run of every table row, then each row's best, median and the ratio of medians.
Only alternated runs compare on a VM whose neighbours move speeds by up to 2x from minute to minute (CPU-NOTES.md).

    python3 tools/alternate.py --runs 6 /tmp/gdn_base /tmp/gdn_new -- bench --prefill 4096,1024
    python3 tools/alternate.py --raw out.txt A B -- bench --batch 1,8 --tokens 1,8 --io bf16

A table row is a line of the bench's output that starts with integers (its case: T, or B and T); its value is the
first number with a decimal point after them (the time per call). The host's CPU model and vector flags are
printed first, as every CPU number must carry them.
"""
import argparse
import statistics
import subprocess
import sys


def host():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "lscpu not available"
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    vec = [f for f in flags if f.startswith(("avx512", "avx2", "fma", "amx"))]
    return f"{model}; {' '.join(vec)}"


def rows(text):
    """(case, value) of every table row in a bench's output."""
    found = []
    for line in text.splitlines():
        parts = line.split()
        key = []
        for p in parts:
            if p.isdigit():
                key.append(p)
                continue
            break
        if not key or len(key) == len(parts):
            continue
        value = next((p for p in parts[len(key):] if "." in p), None)
        try:
            found.append((" ".join(key), float(value)))
        except (TypeError, ValueError):
            continue
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="rounds (each runs both builds once)")
    ap.add_argument("--raw", help="also write every run's whole output here")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then the arguments both builds get")
    o = ap.parse_args()
    args = o.args[1:] if o.args[:1] == ["--"] else o.args
    print(f"host: {host()}")
    print(f"command: <build> {' '.join(args)}")
    raw = open(o.raw, "w") if o.raw else None
    seen = {o.a: {}, o.b: {}}
    order = []
    for r in range(o.runs):
        for exe in (o.a, o.b):
            p = subprocess.run([exe, *args], capture_output=True, text=True)
            if raw:
                raw.write(f"== round {r + 1} {exe} (rc {p.returncode})\n{p.stdout}{p.stderr}\n")
            if p.returncode != 0:
                sys.exit(f"{exe} failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
            got = rows(p.stdout)
            for case, v in got:
                if case not in order:
                    order.append(case)
                seen[exe].setdefault(case, []).append(v)
            print(f"round {r + 1} {exe}: " + ", ".join(f"{c} {v:g}" for c, v in got), flush=True)
    print(f"\n{'case':>10} | {'build':<24} | {'best':>10} | {'median':>10} | runs")
    for case in order:
        meds = {}
        for exe in (o.a, o.b):
            vs = sorted(seen[exe].get(case, []))
            if not vs:
                continue
            meds[exe] = statistics.median(vs)
            runs = " ".join(f"{v:g}" for v in vs)
            print(f"{case:>10} | {exe[-24:]:<24} | {vs[0]:>10g} | {meds[exe]:>10g} | {runs}")
        if len(meds) == 2:
            print(f"{case:>10} | {'b / a (medians)':<24} | {'':>10} | {meds[o.b] / meds[o.a]:>10.3f} |")


if __name__ == "__main__":
    main()
