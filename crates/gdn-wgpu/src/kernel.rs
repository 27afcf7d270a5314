//! The kernel's specialisation: the launch geometry chosen for a shape and an adapter, the checks against the
//! adapter's limits, and the expansion of `gdn_step.wgsl` into plain WGSL.

use gdn::{DType, Error, Result, StateLayout};

/// The template (see the comment at its top for the directives).
pub const TEMPLATE: &str = include_str!("gdn_step.wgsl");

/// Loops over at most this many iterations are written out; longer ones stay loops.
const UNROLL_MAX: usize = 64;

/// Bindings of the kernel: seven storage buffers and one uniform buffer.
pub const STORAGE_BUFFERS: u32 = 7;

/// The longest window a slot holds (speculative steps): the kernel's pending records per slot and value head.
pub const HOLD: usize = 16;

/// Floats of one slot's held-window region (`pend` in the kernel), per token: for each q/k head its normalized
/// key and raw q, k inputs (3 d, in two halves used in turn), for each value head its raw v inputs, delta vector
/// and gate (2 d + 1).
pub fn pending_len(d: usize, h_k: usize, h_v: usize) -> Option<usize> {
    let shared = (2 * HOLD)
        .checked_mul(h_k)?
        .checked_mul(d.checked_mul(3)?)?;
    let own = HOLD
        .checked_mul(h_v)?
        .checked_mul(d.checked_mul(2)?.checked_add(1)?)?;
    shared.checked_add(own)
}

/// What a pipeline is specialised on: the head dim, the launch geometry, the pool's state (dtype, layout) and
/// the step's dtypes. Head counts, head map, gate, eps, planes and every sequence's rows and commit are uniforms
/// or job entries, so the pipeline a sequence runs on never depends on the rest of its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    pub d: usize,
    pub subgroups: bool,
    /// Row blocks: the workgroup has `d * row_blocks` threads, each holding `d / row_blocks` state rows.
    pub row_blocks: usize,
    /// wgpu's runtime checks (bounds checks, loop bounding) kept in the shader.
    pub checked: bool,
    /// The state's dtype (f32 or bf16) and layout.
    pub state: DType,
    pub layout: StateLayout,
    /// qkv, alpha, beta, z.
    pub inputs: [DType; 4],
    /// y, planes and group sums.
    pub out: DType,
}

impl KernelKey {
    /// f32 everywhere, key-major, workgroup memory, four row blocks, checks on: a base to change fields of.
    pub fn plain(d: usize) -> Self {
        KernelKey {
            d,
            subgroups: false,
            row_blocks: 4,
            checked: true,
            state: DType::F32,
            layout: StateLayout::KeyMajor,
            inputs: [DType::F32; 4],
            out: DType::F32,
        }
    }

    /// Threads of a workgroup.
    pub fn workgroup_size(&self) -> usize {
        self.d * self.row_blocks
    }

    /// State rows a thread holds in registers.
    pub fn rows_per_thread(&self) -> usize {
        self.d / self.row_blocks
    }

    /// Group sums a head's row takes in the device's output: d / 16, rounded up to even for 16-bit outputs
    /// (two a word, and a word never shared by two heads' workgroups).
    pub fn group_width(&self) -> usize {
        let g = self.d / 16;
        if self.out == DType::F32 {
            g
        } else {
            g.next_multiple_of(2)
        }
    }

    /// Bytes of workgroup memory the kernel declares.
    pub fn workgroup_bytes(&self) -> usize {
        let d = self.d;
        let w = self.workgroup_size();
        let floats = 4 * d // vals
            + 2 * d // qh, kh
            + 2 * self.row_blocks * d // red, red2
            + 2 * w // gates
            + d // ys
            + if self.subgroups { 0 } else { 3 * d / 16 }
            // xs: the bf16 key-major commit's exchange
            + if self.state == DType::Bf16 && self.layout == StateLayout::KeyMajor { 2 * w } else { 0 };
        4 * floats
    }

    /// Checks the launch against the device's limits: a workgroup the device cannot run is an error here,
    /// never a dispatch that is silently skipped.
    pub fn check_limits(&self, limits: &wgpu::Limits) -> Result<()> {
        let w = self.workgroup_size();
        let fail = |what: String| {
            Err(Error::Backend(format!(
                "the GDN kernel for d = {} needs {what}; this adapter cannot run it",
                self.d
            )))
        };
        if w > limits.max_compute_invocations_per_workgroup as usize {
            return fail(format!(
                "{w} invocations per workgroup, the adapter allows {}",
                limits.max_compute_invocations_per_workgroup
            ));
        }
        if w > limits.max_compute_workgroup_size_x as usize {
            return fail(format!(
                "a workgroup size of {w} in x, the adapter allows {}",
                limits.max_compute_workgroup_size_x
            ));
        }
        let bytes = self.workgroup_bytes();
        if bytes > limits.max_compute_workgroup_storage_size as usize {
            return fail(format!(
                "{bytes} bytes of workgroup memory, the adapter allows {}",
                limits.max_compute_workgroup_storage_size
            ));
        }
        if STORAGE_BUFFERS > limits.max_storage_buffers_per_shader_stage {
            return fail(format!(
                "{STORAGE_BUFFERS} storage buffers per stage, the adapter allows {}",
                limits.max_storage_buffers_per_shader_stage
            ));
        }
        Ok(())
    }

    /// The input loaders (`ld_qkv`, `ld_alpha`, `ld_beta`, `ld_z`: element i of the tensor, widened to f32,
    /// exact) and `enc16` for this key's dtypes.
    pub fn loaders(&self) -> String {
        let mut header = String::new();
        for (name, dt) in ["qkv", "alpha", "beta", "z"].iter().zip(self.inputs) {
            let body = match dt {
                DType::F32 => format!("return bitcast<f32>(inp[prm.{name}_off + i]);"),
                DType::Bf16 => format!(
                    "let w = inp[prm.{name}_off + (i >> 1u)]; \
                     return select(bf16_lo(w), bf16_hi(w), (i & 1u) != 0u);"
                ),
                DType::F16 => format!(
                    "let w = inp[prm.{name}_off + (i >> 1u)]; \
                     return f16_f32(select(w & 0xffffu, w >> 16u, (i & 1u) != 0u));"
                ),
            };
            header.push_str(&format!("fn ld_{name}(i: u32) -> f32 {{ {body} }}\n"));
        }
        let enc = match self.out {
            DType::F16 => "f16_bits",
            _ => "bf16_bits",
        };
        header.push_str(&format!("fn enc16(x: f32) -> u32 {{ return {enc}(x); }}\n"));
        header
    }

    /// The WGSL source of this specialisation.
    pub fn source(&self) -> String {
        let d = self.d;
        let ib = self.row_blocks;
        let w = self.workgroup_size();
        let rpt = self.rows_per_thread();
        let cpt = (3 * d).div_ceil(w);
        let scale = 1.0f32 / (d as f32).sqrt();
        // the stride, in vec4 row groups, between a thread's row groups: value-major threads interleave theirs
        let rs = if self.layout == StateLayout::ValueMajor {
            ib
        } else {
            1
        };
        let consts: [(&str, usize); 9] = [
            ("HOLD", HOLD),
            ("RS", rs),
            ("D", d),
            ("IB", ib),
            ("RPT", rpt),
            ("RPT4", rpt / 4),
            ("W", w),
            ("CPT", cpt),
            ("GW", self.group_width()),
        ];
        let mut header = String::new();
        for (name, v) in consts {
            header.push_str(&format!("const {name}: u32 = {v}u;\n"));
        }
        header.push_str(&format!("const SCALE: f32 = {};\n", wgsl_f32(scale)));
        header.push_str(&self.loaders());
        let flags = [
            ("SUBGROUPS", self.subgroups),
            ("VMAJOR", self.layout == StateLayout::ValueMajor),
            ("SBF16", self.state == DType::Bf16),
            ("OUT16", self.out != DType::F32),
        ];
        let counts = [("RPT", rpt), ("RPT4", rpt / 4), ("IB", ib), ("CPT", cpt)];
        header + &expand(&paste_includes(TEMPLATE), &flags, &counts)
    }
}

/// An f32 as a WGSL literal that parses back to the same value.
pub(crate) fn wgsl_f32(x: f32) -> String {
    // `{:e}` always writes an exponent, so WGSL reads the literal as a float
    format!("{x:e}")
}

/// Chooses the row blocks for a shape: four (the seed's 4 x 128 threads at d = 128) where the adapter allows
/// the workgroup, fewer otherwise, always with a multiple of four rows per thread.
pub fn choose_row_blocks(d: usize, limits: &wgpu::Limits, preferred: usize) -> usize {
    let max_w = (limits.max_compute_invocations_per_workgroup)
        .min(limits.max_compute_workgroup_size_x) as usize;
    let mut ib = preferred.max(1);
    // `preferred` is the caller's: products checked (an overflow is a count that does not fit)
    let fits = |ib: usize| {
        d.checked_mul(ib).is_some_and(|w| w <= max_w)
            && ib.checked_mul(4).is_some_and(|r| d.is_multiple_of(r))
    };
    while ib > 1 && !fits(ib) {
        ib /= 2;
    }
    ib
}

/// Cuts the `//#define NAME` ... `//#enddef` blocks out of `src` and pastes each where `//#include NAME` stands
/// (before the other directives are expanded, so a block may hold them).
pub fn paste_includes(src: &str) -> String {
    let mut blocks: Vec<(String, String)> = Vec::new();
    let mut rest = String::with_capacity(src.len());
    let mut open: Option<(String, String)> = None;
    for line in src.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix("//#define ") {
            open = Some((name.trim().to_string(), String::new()));
            continue;
        }
        if t == "//#enddef" {
            blocks.extend(open.take());
            continue;
        }
        let into = match open.as_mut() {
            Some((_, body)) => body,
            None => &mut rest,
        };
        into.push_str(line);
        into.push('\n');
    }
    let mut out = String::with_capacity(rest.len() * 2);
    for line in rest.lines() {
        match line.trim().strip_prefix("//#include ") {
            Some(name) => {
                if let Some((_, body)) = blocks.iter().find(|(n, _)| n == name.trim()) {
                    out.push_str(body);
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Expands the template's directives. Flags not named are false; a count not named is an internal error: it
/// leaves a line no WGSL parser accepts, so the templates' validity tests catch it.
pub fn expand(src: &str, flags: &[(&str, bool)], counts: &[(&str, usize)]) -> String {
    let flag = |name: &str| -> bool {
        let (neg, name) = match name.strip_prefix('!') {
            Some(n) => (true, n),
            None => (false, name),
        };
        flags.iter().any(|&(n, v)| n == name && v) != neg
    };
    let mut out = String::with_capacity(src.len() * 2);
    // (this level is kept, some branch of it was kept)
    let mut conds: Vec<(bool, bool)> = Vec::new();
    // `//#for` blocks are collected and expanded recursively
    let mut for_stack: Vec<(String, usize, String)> = Vec::new();
    let keeping = |conds: &Vec<(bool, bool)>| conds.iter().all(|c| c.0);
    for line in src.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("//#if ") {
            let parent = keeping(&conds);
            let v = flag(rest.trim());
            conds.push((parent && v, v));
            continue;
        }
        if t == "//#else" {
            let parent = conds[..conds.len().saturating_sub(1)].iter().all(|c| c.0);
            if let Some(top) = conds.last_mut() {
                *top = (parent && !top.1, true);
            }
            continue;
        }
        if t == "//#endif" {
            conds.pop();
            continue;
        }
        if !keeping(&conds) {
            continue;
        }
        if let Some(rest) = t.strip_prefix("//#for ") {
            let mut it = rest.split_whitespace();
            let var = it.next().unwrap_or("i").to_string();
            let count_name = it.next().unwrap_or("");
            match counts.iter().find(|(n, _)| *n == count_name) {
                Some(&(_, count)) => for_stack.push((var, count, String::new())),
                None => {
                    // a count the caller did not pass: a line no WGSL parser accepts, so the template's validity
                    // tests fail instead of the block silently vanishing
                    out.push_str(&format!("missing count {count_name} for //#for {var};\n"));
                    for_stack.push((var, 0, String::new()));
                }
            }
            continue;
        }
        if t == "//#endfor" {
            if let Some((var, count, body)) = for_stack.pop() {
                let body = expand(&body, flags, counts);
                let text = unroll(&var, count, &body);
                match for_stack.last_mut() {
                    Some(parent) => parent.2.push_str(&text),
                    None => out.push_str(&text),
                }
            }
            continue;
        }
        match for_stack.last_mut() {
            Some(block) => {
                block.2.push_str(line);
                block.2.push('\n');
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// `count` copies of `body` with `$var` replaced by 0, 1, ..., or one loop when `count` is large.
fn unroll(var: &str, count: usize, body: &str) -> String {
    let pat = format!("${var}");
    let mut s = String::new();
    if count <= UNROLL_MAX {
        for i in 0..count {
            s.push_str(&body.replace(&pat, &i.to_string()));
        }
    } else {
        let v = format!("{var}_i");
        s.push_str(&format!(
            "for (var {v}: u32 = 0u; {v} < {count}u; {v}++) {{\n"
        ));
        s.push_str(&body.replace(&pat, &v));
        s.push_str("}\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_expand() {
        let src = "a\n//#if X\nb\n//#else\nc\n//#endif\n//#if !X\nd\n//#endif\n//#for r N\n{ s[$r]; }\n//#endfor\n";
        let out = expand(src, &[("X", true)], &[("N", 3)]);
        assert_eq!(out, "a\nb\n{ s[0]; }\n{ s[1]; }\n{ s[2]; }\n");
        let out = expand(src, &[], &[("N", 100)]);
        assert!(out.starts_with("a\nc\nd\nfor (var r_i: u32 = 0u; r_i < 100u; r_i++) {"));
        assert!(out.contains("{ s[r_i]; }"));
        let src =
            "x\n//#define B\n//#if X\nb\n//#endif\n//#enddef\n//#include B\ny\n  //#include B\n";
        let out = expand(&paste_includes(src), &[("X", true)], &[]);
        assert_eq!(out, "x\nb\ny\nb\n");
        // a count not passed leaves a line that fails to parse, not an empty block
        let out = expand("//#for r N\n{ s[$r]; }\n//#endfor\n", &[], &[]);
        assert_eq!(out, "missing count N for //#for r;\n");
        assert!(naga::front::wgsl::parse_str(&out).is_err());
    }

    #[test]
    fn limits_are_checked_with_a_clear_error() {
        // WebGPU's default limits: 256 invocations per workgroup
        let web = wgpu::Limits::default();
        assert_eq!(choose_row_blocks(128, &web, 4), 2);
        assert_eq!(choose_row_blocks(64, &web, 4), 4);
        assert_eq!(choose_row_blocks(1024, &web, 4), 1);
        // the caller's count: zero, or one whose products overflow, still gives a count that fits
        assert_eq!(choose_row_blocks(128, &web, 0), 1);
        assert_eq!(choose_row_blocks(64, &web, usize::MAX), 1);
        assert_eq!(choose_row_blocks(64, &web, usize::MAX / 3), 2);
        let key = |d, row_blocks| KernelKey {
            d,
            subgroups: false,
            row_blocks,
            checked: true,
            ..KernelKey::plain(16)
        };
        assert!(key(128, 2).check_limits(&web).is_ok());
        let err = key(128, 4).check_limits(&web).unwrap_err().to_string();
        assert!(err.contains("512 invocations"), "{err}");
        let err = key(1024, 1).check_limits(&web).unwrap_err().to_string();
        assert!(err.contains("d = 1024"), "{err}");
    }

    #[test]
    fn pending_region_sizes() {
        // the seed shape: 16 tokens x (2 halves x 16 q/k heads x 3 d + 48 value heads x (2 d + 1))
        assert_eq!(
            pending_len(128, 16, 48),
            Some(16 * (2 * 16 * 384 + 48 * 257))
        );
        assert_eq!(pending_len(usize::MAX / 4, 1, 1), None);
        assert_eq!(pending_len(1024, 1, usize::MAX / 1024), None);
        assert_eq!(pending_len(1024, usize::MAX / 1024, 1), None);
    }

    #[test]
    fn copy_kernel_is_valid_wgsl() {
        let src = include_str!("copy.wgsl");
        let module = naga::front::wgsl::parse_str(src).expect("copy.wgsl parses");
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::empty(),
        )
        .validate(&module)
        .expect("copy.wgsl validates");
    }

    // every specialisation is parsed, validated and translated to MSL and HLSL in tests/naga_targets.rs
}
