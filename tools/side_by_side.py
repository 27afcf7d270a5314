#!/usr/bin/env python3
"""One table from one device run: gdn's `gdn bench` tables beside FlashInfer's `fi_bench.json` and FLA's
`anchor_fla.json` (the anchors in ../shared/anchors), on the same cases (B, T, state dtype).

    side_by_side.py --gdn NAME=FILE [--gdn NAME=FILE ...] [--fi fi_bench.json] [--fla anchor_fla.json]

Each `--gdn` file is the stdout of one `gdn bench` run; NAME labels its column (e.g. `f32-km`, `bf16-vm-rot`;
a name ending in `rot` is a run with `--rotate-mib`, states from DRAM, compared with FlashInfer's rotated time).
The state dtype of a gdn column is its name's first field (f32 or bf16). FlashInfer's row for a case is the
one that writes the state (decode `pretranspose` at T 1 and the bf16 windows; `mtp` for f32 windows), FLA's is
its fused recurrence at the same B and T (f32 state only). Peers time their recurrence alone, gdn its whole
fused step (conv, norms, gates, readout, gated RMS norm): the ratio columns are gdn's best time over FlashInfer's.
Only the standard library: it runs on the device's Python and here.
"""
import argparse
import json
import re

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([0-9.]+)\s")


def gdn_table(path):
    out = {}
    for line in open(path):
        m = ROW.match(line)
        if m:
            out[(int(m.group(1)), int(m.group(2)))] = float(m.group(3))
    return out


def fi_table(path):
    """(state, B, T) -> (us, us_rot) for the state-writing kernel of each case."""
    out = {}
    rows = json.load(open(path)).get("rows", [])
    for r in rows:
        if r.get("dsu") or "us" not in r or r.get("case") not in ("a", "b", "c"):
            continue
        state = "f32" if r.get("state") == "float32" else "bf16" if r.get("state") == "bfloat16" else None
        if state is None:
            continue
        key = (state, r["B"], r["T"])
        # f32 windows: the mtp kernel (the pretranspose API has no f32 multi-token path)
        if key in out and r.get("case") != "c":
            continue
        out[key] = (r["us"], r.get("us_rot"))
    return out


def fla_table(path):
    out = {}
    for k, v in json.load(open(path)).items():
        m = re.match(r"fr_B(\d+)_T(\d+)$", k)
        if m and isinstance(v, dict):
            out[(int(m.group(1)), int(m.group(2)))] = v.get("us_graph")
    return out


def ratio(ours, theirs):
    """The best of our columns over the peer's time (< 1: we are faster)."""
    return f"{min(ours) / theirs:.2f}" if ours and theirs else "-"


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gdn", action="append", default=[], help="NAME=FILE")
    ap.add_argument("--fi")
    ap.add_argument("--fla")
    a = ap.parse_args()
    cols = []
    for spec in a.gdn:
        name, _, path = spec.partition("=")
        try:
            cols.append((name, gdn_table(path)))
        except OSError as e:
            print(f"(gdn {name}: {e})")
    fi = {}
    if a.fi:
        try:
            fi = fi_table(a.fi)
        except (OSError, ValueError) as e:
            print(f"(FlashInfer: {e})")
    fla = {}
    if a.fla:
        try:
            fla = fla_table(a.fla)
        except (OSError, ValueError) as e:
            print(f"(FLA: {e})")
    for state in ("f32", "bf16"):
        mine = [(n, t) for n, t in cols if n.split("-")[0] == state]
        if not mine:
            continue
        keys = sorted({k for _, t in mine for k in t})
        head = ["B", "T"] + [f"gdn {n}" for n, _ in mine] + ["FI", "FI rot", "FLA", "gdn / FI", "gdn / FI rot"]
        print(f"\n{state} state, us per call (gdn: whole fused step; FlashInfer, FLA: recurrence alone)")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for b, t in keys:
            ours = [tab.get((b, t)) for _, tab in mine]
            f, frot = fi.get((state, b, t), (None, None))
            cache = [x for (n, _), x in zip(mine, ours) if x is not None and not n.endswith("rot")]
            rot = [x for (n, _), x in zip(mine, ours) if x is not None and n.endswith("rot")]
            # FlashInfer rotates only the cases whose states fit in L2: the others already come from DRAM
            f_rot = frot if frot is not None else f
            fl = fla.get((b, t)) if state == "f32" else None
            print("| " + " | ".join([str(b), str(t)] + [fmt(x) for x in ours] + [fmt(f), fmt(frot), fmt(fl),
                                    ratio(cache, f), ratio(rot, f_rot)]) + " |")


if __name__ == "__main__":
    main()
