// The quantized out_proj (SPEC.md, "The quantized out_proj"), the same arithmetic as gdn-cuda's quant.cu:
// out[t][o] = sum_g scale[o][g] (sum_{m in g} field(word, m) x[t][m]) - zs[o][g] gsum[t][g].
//
// Planes path (SHIFT false): a field is masked in place and x is the plane whose scale undoes its bit position;
// shift path: x is y and each field is shifted down. A masked field becomes a float by ORing it under the
// exponent of 2^23 and subtracting 2^23 (exact below 2^23); a 16-bit packing's upper word is moved down once a
// u32, and 8-bit fields 2 and 3 of a u32 take their 2^16 back in the same step (exact).
//
// A workgroup of WG threads owns ROWS output rows and TT tokens (workgroup_id.y); thread l takes groups l,
// l + WG, ...; the partial sums meet in workgroup memory in a fixed tree (the same bits every run). No
// subgroup operations, so it runs on any adapter.

override PACK: u32 = 0u; // 0: 2-bit eight to a u16; 1: 8-bit four to a u32; 2: 8-bit two to a u16
override SHIFT: bool = false;

const ROWS: u32 = 2u;
const TT: u32 = 4u;
const WG: u32 = 64u;

struct Params {
    hidden: u32,
    n: u32,
    tokens: u32,
    // offsets (floats) of x in `act` and of the group sums in `gsum`
    x_off: u32,
    g_off: u32,
    count: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> words: array<u32>;
@group(0) @binding(1) var<storage, read> scale: array<f32>;
@group(0) @binding(2) var<storage, read> zs: array<f32>;
@group(0) @binding(3) var<storage, read> act: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<uniform> prm: Params;
@group(0) @binding(6) var<storage, read> gsum: array<f32>;

var<workgroup> red: array<f32, 512>; // ROWS * TT * WG

fn from_masked(b: u32) -> f32 {
    return bitcast<f32>(0x4B000000u | b) - 8388608.0;
}

// (2^23 + v) 2^16 - 2^39 = v 2^16, exact
fn from_masked_hi(b: u32) -> f32 {
    return bitcast<f32>(0x4B000000u | b) * 65536.0 - 549755813888.0;
}

fn decode(at: u32) -> array<f32, 16> {
    var v: array<f32, 16>;
    if (PACK == 0u) {
        let w = words[at];
        let hi = w >> 16u;
        for (var e = 0u; e < 8u; e++) {
            if (SHIFT) {
                v[e] = from_masked((w >> (2u * e)) & 3u);
                v[8u + e] = from_masked((w >> (16u + 2u * e)) & 3u);
            } else {
                v[e] = from_masked(w & (3u << (2u * e)));
                v[8u + e] = from_masked(hi & (3u << (2u * e)));
            }
        }
    } else {
        for (var k = 0u; k < 4u; k++) {
            let w = words[at + k];
            if (SHIFT) {
                for (var e = 0u; e < 4u; e++) {
                    v[4u * k + e] = from_masked((w >> (8u * e)) & 255u);
                }
            } else {
                let hi = w >> 16u;
                v[4u * k] = from_masked(w & 0xFFu);
                v[4u * k + 1u] = from_masked(w & 0xFF00u);
                if (PACK == 1u) {
                    v[4u * k + 2u] = from_masked_hi(hi & 0xFFu);
                    v[4u * k + 3u] = from_masked_hi(hi & 0xFF00u);
                } else {
                    v[4u * k + 2u] = from_masked(hi & 0xFFu);
                    v[4u * k + 3u] = from_masked(hi & 0xFF00u);
                }
            }
        }
    }
    return v;
}

@compute @workgroup_size(64)
fn product(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let groups = prm.n / 16u;
    let wpg = select(4u, 1u, PACK == 0u);
    let o0 = wid.x * ROWS;
    let t0 = wid.y * TT;
    var acc: array<f32, 8>; // [ROWS][TT], zero
    for (var g = lid; g < groups; g += WG) {
        // rows past hidden repeat the last row (their sums are not stored)
        let oa = min(o0, prm.hidden - 1u);
        let ob = min(o0 + 1u, prm.hidden - 1u);
        let va = decode((oa * groups + g) * wpg);
        let vb = decode((ob * groups + g) * wpg);
        let sa = scale[oa * groups + g];
        let sb = scale[ob * groups + g];
        let za = zs[oa * groups + g];
        let zb = zs[ob * groups + g];
        for (var t = 0u; t < TT; t++) {
            if (t0 + t < prm.tokens) {
                let xb = prm.x_off + (t0 + t) * prm.n + 16u * g;
                let gs = gsum[prm.g_off + (t0 + t) * groups + g];
                var a0 = 0.0;
                var b0 = 0.0;
                var a1 = 0.0;
                var b1 = 0.0;
                for (var e = 0u; e < 16u; e += 2u) {
                    let x0 = act[xb + e];
                    let x1 = act[xb + e + 1u];
                    a0 = fma(va[e], x0, a0);
                    b0 = fma(va[e + 1u], x1, b0);
                    a1 = fma(vb[e], x0, a1);
                    b1 = fma(vb[e + 1u], x1, b1);
                }
                acc[t] = fma(-za, gs, fma(sa, a0 + b0, acc[t]));
                acc[TT + t] = fma(-zb, gs, fma(sb, a1 + b1, acc[TT + t]));
            }
        }
    }
    for (var k = 0u; k < ROWS * TT; k++) {
        red[k * WG + lid] = acc[k];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            for (var k = 0u; k < ROWS * TT; k++) {
                red[k * WG + lid] += red[k * WG + lid + s];
            }
        }
        workgroupBarrier();
    }
    if (lid < ROWS * TT) {
        let r = lid / TT;
        let t = lid % TT;
        if (o0 + r < prm.hidden && t0 + t < prm.tokens) {
            out[(t0 + t) * prm.hidden + o0 + r] = red[lid * WG];
        }
    }
}

// The shift path's own pass: group sums of y (at x_off in `act`) as the step writes them (even columns' sum
// plus odd columns', each in increasing order), one thread a group, into `out`.
@compute @workgroup_size(64)
fn group_sums(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= prm.count) {
        return;
    }
    let b = prm.x_off + 16u * i;
    var even = 0.0;
    var odd = 0.0;
    for (var e = 0u; e < 16u; e += 2u) {
        even += act[b + e];
        odd += act[b + e + 1u];
    }
    out[i] = even + odd;
}
