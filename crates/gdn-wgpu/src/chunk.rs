//! The chunked (WY / UT) form of long windows: the template `chunk.wgsl`, its specialisation, the scratch
//! buffer's layout and the plan of a call's chunked windows (which windows run chunked, in how many rounds).

use gdn::{DType, Error, Result, Shape, StateLayout};

use crate::kernel::{expand, paste_includes, wgsl_f32, KernelKey};

/// The template (see the comment at its top).
pub const TEMPLATE: &str = include_str!("chunk.wgsl");

/// Tokens of a chunk by default (`Options::chunk_len`: 16 or 32).
pub const DEFAULT_LEN: usize = 32;

/// A pool's chunk geometry: tokens a chunk (L) and state columns a `chunk_run` workgroup (BV).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geom {
    pub l: usize,
    pub bv: usize,
}

impl Geom {
    /// The geometry for head dim d from the caller's preferences: L 16 or 32 (else 32; not 64, slowest wherever
    /// measured, and its `chunk_wy` would need 38.1 KB of workgroup memory); BV the preferred count where it is a
    /// multiple of 4 dividing d and NT and fills whole thread rows (L BV and d BV multiples of NT), else the first of
    /// 16, 32, 8 that does (16 always does: d is a multiple of 16).
    pub fn new(d: usize, len: usize, columns: usize) -> Geom {
        let l = if [16, 32].contains(&len) {
            len
        } else {
            DEFAULT_LEN
        };
        let ok = |bv: usize| {
            // chunk_run's thread rows need NT a multiple of BV (a BV of 24 or 48 left rows of the state unwritten)
            bv >= 4
                && bv.is_multiple_of(4)
                && NT.is_multiple_of(bv)
                && d.is_multiple_of(bv)
                && (d * bv).is_multiple_of(NT)
                && (l * bv).is_multiple_of(NT)
        };
        let bv = [columns, 16, 32, 8]
            .into_iter()
            .find(|&bv| ok(bv))
            .unwrap_or(16);
        Geom { l, bv }
    }

    /// Floats of a chunk's block per value head: its decayed q.k products P [L][L], then gamma, the end decays
    /// of the chunk's last row and those of the commit row.
    pub fn pb(&self) -> usize {
        self.l * self.l + 3 * self.l
    }
}

/// Threads of every chunked kernel's workgroup (WebGPU's default limit).
pub const NT: usize = 256;

/// Windows of at least this many tokens (counted to the commit point where the window commits) run chunked by
/// default on a GPU adapter: 64, the crossover measured on an H100 through NVIDIA's Vulkan driver at the default
/// geometry (NOTES.md "Chunked windows": token-serial / chunked time 0.66x at 32 tokens, 1.00x at 64, 1.20x at 96,
/// 1.35x at 128, 1.97x at 4096).
/// `Wgpu::measure_crossover` measures the crossover on the adapter at hand.
pub const DEFAULT_CHUNK_FROM: usize = 64;

/// The four entry points, in dispatch order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Entry {
    Pre,
    Wy,
    Run,
    Out,
}

impl Entry {
    pub fn name(self) -> &'static str {
        match self {
            Entry::Pre => "chunk_pre",
            Entry::Wy => "chunk_wy",
            Entry::Run => "chunk_run",
            Entry::Out => "chunk_out",
        }
    }
}

/// Columns of the state one `chunk_run` workgroup carries by default (`Options::chunk_columns`).
pub const DEFAULT_COLUMNS: usize = 16;

/// Tokens `chunk_pre` and `chunk_out` take together: as many as 2048 floats of conv outputs hold (8 at d 128), at
/// most L, so that every chunked kernel fits WebGPU's default 16 KB of workgroup memory at d 128.
pub fn tb(d: usize, l: usize) -> usize {
    (2048 / (2 * d)).clamp(1, l)
}

/// Key columns `chunk_wy` stages at a time (k and q rows of the chunk: 1024 floats, in arrays of rows KT + 1 apart).
pub fn kt(l: usize) -> usize {
    512 / l
}

/// Bytes of workgroup memory the largest entry point uses (each counts only the variables it uses).
pub fn workgroup_bytes(d: usize, g: Geom) -> usize {
    let (l, bv) = (g.l, g.bv);
    let pre = tb(d, l) * (2 * d + 2 * d / 16);
    let wy = 2 * l * l + 3 * l + 2 * l * (kt(l) + 1);
    let run = d * bv + l * bv + 3 * l;
    let out = tb(d, l) * (2 * d + d / 16);
    4 * pre.max(wy).max(run).max(out)
}

/// The WGSL of the chunked kernels for a pipeline key (its d, state, layout and dtypes; subgroups and row blocks
/// do not apply).
pub fn source(key: &KernelKey, g: Geom) -> String {
    // loads issued ahead of their use in `chunk_run`: W and q rows 4 LB4 floats at a time (d, a multiple of 16, is a
    // multiple of it), P and key rows SB at a time (L is 16 or 32)
    const LB4: usize = 4;
    const SB: usize = 8;
    let d = key.d;
    let (l, bv) = (g.l, g.bv);
    // a `chunk_out` thread's elements of a batch
    let ze = (tb(d, l) * d).div_ceil(NT);
    let consts: [(&str, usize); 20] = [
        ("KT", kt(l)),
        ("EPT", (l * l).div_ceil(NT)),
        ("D", d),
        ("L", l),
        ("BV", bv),
        ("NCB", d / bv),
        ("NT", NT),
        ("CG", bv / 4),
        ("IP1", (l * bv / 2).div_ceil(NT)),
        ("UI", (d * bv / 4).div_ceil(NT)),
        ("RSN", d * bv / NT),
        ("CP1", (2 * d).div_ceil(NT)),
        ("CP2", (2 * d).div_ceil(NT)),
        ("CPE", d.div_ceil(NT)),
        ("GW", key.group_width()),
        ("PB", g.pb()),
        ("TB", tb(d, l)),
        ("LB", 4 * LB4),
        ("SB", SB),
        ("ZE", ze),
    ];
    let mut header = String::new();
    for (name, v) in consts {
        header.push_str(&format!("const {name}: u32 = {v}u;\n"));
    }
    let scale = 1.0f32 / (d as f32).sqrt();
    header.push_str(&format!("const SCALE: f32 = {};\n", wgsl_f32(scale)));
    header.push_str(&key.loaders());
    // the scalar helpers of the token-serial kernel, so that gates, write strengths and roundings are its own
    let t = crate::kernel::TEMPLATE;
    let (a, b) = (
        t.find("fn sigmoid").unwrap_or(0),
        t.find("// where row block ib").unwrap_or(0),
    );
    header.push_str(&t[a..b.max(a)]);
    let flags = [
        ("VMAJOR", key.layout == StateLayout::ValueMajor),
        ("SBF16", key.state == DType::Bf16),
        ("OUT16", key.out != DType::F32),
    ];
    // the unrolled blocks (`//#for NAME COUNT`): chunk_run's loads ahead (LB4, SB) and update rows (UI), chunk_pre's
    // batch (TB), chunk_out's elements (ZE), chunk_wy's substitution inputs and rows (L) and its blocks of 8 rows (L8)
    let counts = [
        ("LB4", LB4),
        ("SB", SB),
        ("UI", (d * bv / 4).div_ceil(NT)),
        ("TB", tb(d, l)),
        ("ZE", ze),
        ("L", l),
        ("L8", l / 8),
    ];
    header + &expand(&paste_includes(TEMPLATE), &flags, &counts)
}

impl KernelKey {
    /// The WGSL of the chunked kernels for this key's d, state, layout and dtypes, with the chunk length and
    /// column block the backend picks for `len` and `columns` ([`crate::Options::chunk_len`],
    /// [`crate::Options::chunk_columns`]); entry points [`CHUNK_ENTRIES`].
    pub fn chunk_source(&self, len: usize, columns: usize) -> String {
        source(self, Geom::new(self.d, len, columns))
    }
}

/// The chunked kernels' entry points, in dispatch order.
pub const CHUNK_ENTRIES: [&str; 4] = ["chunk_pre", "chunk_wy", "chunk_run", "chunk_out"];

/// Floats of the scratch regions for `tokens` tokens in `chunks` chunks, in `CParams` order (q, k, U, W, o, gates,
/// write strengths, products); None where a count overflows.
pub fn regions(sh: &Shape, g: Geom, tokens: usize, chunks: usize) -> Option<[usize; 8]> {
    let qk = tokens.checked_mul(sh.h_k)?.checked_mul(sh.d)?;
    let v = tokens.checked_mul(sh.h_v)?.checked_mul(sh.d)?;
    let gt = tokens.checked_mul(sh.h_v)?;
    let p = chunks.checked_mul(sh.h_v)?.checked_mul(g.pb())?;
    // o has no region of its own: chunk_run writes each readout over the U element it read (the same thread,
    // after the read; no other workgroup reads that column block's U)
    Some([qk, qk, v, v, 0, gt, gt, p])
}

/// Floats of scratch a window of `len` tokens needs; None on overflow.
pub fn scratch_floats(sh: &Shape, g: Geom, len: usize) -> Option<usize> {
    regions(sh, g, len, len.div_ceil(g.l))?
        .iter()
        .try_fold(0usize, |a, &x| a.checked_add(x))
}

/// The uniform block of the chunked kernels (`CParams` in chunk.wgsl).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CParams {
    pub plane: u32,
    pub qkv_off: u32,
    pub alpha_off: u32,
    pub beta_off: u32,
    pub z_off: u32,
    pub h_k: u32,
    pub h_v: u32,
    pub c: u32,
    pub n: u32,
    pub grouped: u32,
    pub silu: u32,
    pub eps: f32,
    pub centry: u32,
    pub offs: [u32; 8],
    pub seq0: u32,
    pub pad: [u32; 2],
}

/// One round of chunked windows: job indices into the call's chunked list, their scratch tokens and chunks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    /// (first, end) of the round's windows in the chunked list.
    pub windows: (usize, usize),
    pub tokens: usize,
    pub chunks: usize,
}

/// Groups chunked windows (their lengths, in order) into rounds whose scratch fits `max_floats` and whose chunk
/// count fits `max_groups` workgroups in y; a window that alone does not fit is an error naming it.
pub fn plan(
    sh: &Shape,
    g: Geom,
    lens: &[usize],
    max_floats: usize,
    max_groups: usize,
) -> Result<Vec<Round>> {
    let mut rounds = Vec::new();
    let mut cur = Round::default();
    for (i, &len) in lens.iter().enumerate() {
        let chunks = len.div_ceil(g.l);
        let floats = scratch_floats(sh, g, len).unwrap_or(usize::MAX);
        if floats > max_floats || chunks > max_groups {
            return Err(Error::Backend(format!(
                "a window of {len} tokens needs {} bytes of scratch and {chunks} chunks on the chunked path; \
                 the adapter binds at most {} bytes and dispatches {max_groups} workgroups: commit it in \
                 shorter windows (or raise the crossover, `Wgpu::with_chunk_from`, to run it token by token)",
                floats.saturating_mul(4),
                max_floats.saturating_mul(4)
            )));
        }
        let (t, c) = (cur.tokens + len, cur.chunks + chunks);
        let fits = regions(sh, g, t, c)
            .and_then(|r| r.iter().try_fold(0usize, |a, &x| a.checked_add(x)))
            .is_some_and(|f| f <= max_floats)
            && c <= max_groups;
        if !fits {
            rounds.push(std::mem::take(&mut cur));
            cur.windows = (i, i);
        }
        cur.windows.1 = i + 1;
        cur.tokens += len;
        cur.chunks += chunks;
    }
    if cur.windows.1 > cur.windows.0 {
        rounds.push(cur);
    }
    Ok(rounds)
}

/// Checks the chunked kernels against the adapter's limits.
pub fn check_limits(d: usize, g: Geom, limits: &wgpu::Limits) -> Result<()> {
    let bytes = workgroup_bytes(d, g);
    if NT as u32 > limits.max_compute_invocations_per_workgroup
        || NT as u32 > limits.max_compute_workgroup_size_x
        || bytes > limits.max_compute_workgroup_storage_size as usize
    {
        return Err(Error::Backend(format!(
            "the chunked GDN kernels for d = {d} need {NT} invocations and {bytes} bytes of workgroup memory; \
             this adapter cannot run them"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_source_is_valid_wgsl() {
        for d in [16, 48, 128, 256] {
            for (state, layout, out) in [
                (DType::F32, StateLayout::KeyMajor, DType::F32),
                (DType::Bf16, StateLayout::ValueMajor, DType::Bf16),
                (DType::Bf16, StateLayout::KeyMajor, DType::F16),
            ] {
                let key = KernelKey {
                    state,
                    layout,
                    out,
                    inputs: [DType::Bf16, DType::F32, DType::F16, DType::F32],
                    ..KernelKey::plain(d)
                };
                let src = source(&key, Geom::new(d, 16, 8));
                let module = naga::front::wgsl::parse_str(&src)
                    .unwrap_or_else(|e| panic!("d {d}: {}", e.emit_to_string(&src)));
                naga::valid::Validator::new(
                    naga::valid::ValidationFlags::all(),
                    naga::valid::Capabilities::empty(),
                )
                .validate(&module)
                .unwrap_or_else(|e| panic!("d {d}: {e:?}"));
            }
        }
    }

    #[test]
    fn d_128_fits_webgpu_default_workgroup_memory() {
        let web = wgpu::Limits::default();
        for l in [16, 32] {
            assert!(check_limits(128, Geom::new(128, l, 16), &web).is_ok());
        }
        assert!(check_limits(128, Geom::new(128, 32, 32), &web).is_err());
    }

    #[test]
    fn rounds_split_by_scratch_and_refuse_what_cannot_fit() {
        let sh = Shape::new(16, 1, 2).unwrap();
        let g = Geom::new(16, 32, 16);
        assert_eq!(g, Geom { l: 32, bv: 16 });
        assert_eq!(Geom::new(16, 16, 8), Geom { l: 16, bv: 16 });
        assert_eq!(Geom::new(128, 64, 8), Geom { l: 32, bv: 8 });
        assert_eq!(Geom::new(48, 7, 32), Geom { l: 32, bv: 16 });
        // 48 divides d 192 but not the 256 threads
        assert_eq!(Geom::new(192, 32, 48), Geom { l: 32, bv: 16 });
        let one = scratch_floats(&sh, g, 100).unwrap();
        let r = plan(&sh, g, &[100, 100, 100], 2 * one + 10, 65535).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].windows, (0, 2));
        assert_eq!(r[1].windows, (2, 3));
        assert_eq!(r[1].tokens, 100);
        let err = plan(&sh, g, &[100, 1000], 2 * one, 65535).unwrap_err();
        assert!(err.to_string().contains("1000 tokens"), "{err}");
        assert!(plan(&sh, g, &[33], usize::MAX, 1).is_err());
        assert_eq!(scratch_floats(&sh, g, usize::MAX), None);
    }
}
