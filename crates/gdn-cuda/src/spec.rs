//! Kernel specialisations: what a compiled `gdn_step` is specialised on, the launch plan that picks one for a
//! batch, and NVRTC compilation with a per-process cache of the machine code.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};
use gdn::{Config, DType, Error, Gate, HeadMap, PoolOptions, Result, Shape, StateLayout};

/// The kernel source: macros select the specialisation (see the comment at its top).
pub const KERNEL_SRC: &str = include_str!("../kernels/gdn_step.cu");
/// The window kernel's source (windows in chunks of eight, [`Spec::window`]): the same
/// macros, entry point and arguments.
pub const WINDOW_SRC: &str = include_str!("../kernels/gdn_window.cu");
/// The element types every kernel source of the crate uses, prepended to each after its `#define` lines.
pub const ELT_SRC: &str = include_str!("../kernels/gdn_elt.cuh");

/// Longest window compiled with its length as a constant; longer windows use a run-time length.
pub const MAX_CONST_T: usize = 8;

/// Cluster sizes the planner may choose (8 is the portable cluster limit).
pub const CLUSTER_SIZES: [usize; 4] = [1, 2, 4, 8];

/// Registers a thread needs beside its rows of the state (the conv's channels, the token's scalars, addresses):
/// ptxas used 124-128 at d 128 with 64 rows a thread.
const STATE_REG_RESERVE: usize = 40;

/// Rows of one column a thread may hold in registers.
const MAX_ROWS_PER_THREAD: usize = 64;

/// The element types of one call's tensors: the four inputs and the output (y, planes, group sums).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Io {
    pub qkv: DType,
    pub alpha: DType,
    pub beta: DType,
    pub z: DType,
    pub out: DType,
}

impl Io {
    /// Every tensor in `dtype`.
    pub fn all(dtype: DType) -> Io {
        Io {
            qkv: dtype,
            alpha: dtype,
            beta: dtype,
            z: dtype,
            out: dtype,
        }
    }
    /// The inputs' types (qkv, alpha, beta, z) and the output's.
    pub fn new(inputs: [DType; 4], out: DType) -> Io {
        Io {
            qkv: inputs[0],
            alpha: inputs[1],
            beta: inputs[2],
            z: inputs[3],
            out,
        }
    }
}

/// The kernel's code for an element type (the `GDN_*_DT` macros).
fn dt_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
    }
}

/// Everything one compiled kernel is specialised on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Spec {
    /// Compute capability (major, minor) the machine code is for.
    pub arch: (i32, i32),
    pub shape: Shape,
    /// Window length of every sequence of the call, or 0 for each sequence's own (run-time) length.
    pub t: usize,
    pub silu: bool,
    pub grouped: bool,
    pub planes: bool,
    /// false: verify only; true: each sequence commits at its own run-time token count (0: not at all).
    pub commit: bool,
    pub plan: Plan,
    /// Element types of the inputs and the output.
    pub io: Io,
    /// The pool's state: element type (f32 or bf16) and layout.
    pub pool: PoolOptions,
    /// Stage a bf16 state at T 1 through shared memory (see [`Spec::staged`]); the pool asks for it on calls
    /// large enough to fill the device, where it pays. It changes no bits.
    pub stage: bool,
    /// `None`: the pool's own buffers. `Some(conv)`: a step on memory the caller owns ([`crate::CudaLayer`], the
    /// kernel's `GDN_EXT`), with the engine's conv state in element type `conv`.
    pub ext: Option<DType>,
    /// The speculative step on the pool (the kernel's `GDN_SPEC`): verify windows are held, accepted prefixes of
    /// held windows applied at the state load. Always with commits, never staged.
    pub speculative: bool,
    /// L2 prefetch of the state `ahead` blocks later in launch order (the kernel's `GDN_AHEAD`; 0: none). A
    /// hint: no bits change.
    pub ahead: u32,
    /// Prefetch the block's own state into L2 before waiting for the previous kernel (`GDN_PREWAIT`).
    pub prewait: bool,
    /// A constant window of 2 tokens or more runs in three phases (`GDN_PHASED`; see [`Spec::phased_loop`]).
    pub phased: bool,
    /// Every block of the call is resident at once (set by [`Spec::with_tune`]; see [`Spec::readers_cluster`]).
    pub one_wave: bool,
    /// The window kernel (`kernels/gdn_window.cu`): the sequences in `wrange`, eight tokens at a time in the
    /// chunked form.
    pub window: bool,
    /// The token-serial kernel leaves the window kernel's sequences to it (`GDN_ROUTE`): set when one call
    /// launches both.
    pub route: bool,
    /// The window kernel's sequences (with `window` or `route`): those whose effective length (the commit point,
    /// or the length of a window that commits nothing) lies in this range (`GDN_WMIN`, `GDN_WMAX`).
    pub wrange: (usize, usize),
}

/// Blocks of the window kernel a multiprocessor holds (its launch bounds).
pub const WINDOW_BLOCKS_PER_SM: usize = 2;

/// The effective lengths the window kernel takes for a state dtype, where it measured faster than the
/// token-serial kernel (H200, 2026-12-01, NOTES.md "Windows in chunks of eight", window / token-serial, us):
/// an f32 state from 4 to 8 tokens (B 256 T 4 673 / 730, T 8 792 / 1064; B 1 T 8 12.0 / 16.5; B 1 T 4 10.5 /
/// 9.8 is the one loss kept for the batch), a bf16 state from 6 to 8 (B 256 T 6 750 / 769, T 8 820 / 968; T 5
/// and below slower). The effective length of a sequence is its commit point, or its length if it commits
/// nothing: a commit after k tokens then runs in the kernel a k-token window runs in, so commit-first-k equals
/// a k-token window bitwise.
pub fn window_range(state: DType) -> (usize, usize) {
    match state {
        DType::F32 => (4, 8),
        _ => (6, 8),
    }
}

/// Memory hints and loop forms of a launch (no bits depend on them): how far ahead each block prefetches another
/// block's state into L2, in half waves (0: none; a wave is every block the device holds at once), whether a block
/// prefetches its own state before waiting for the previous kernel, and whether a constant window of 2 tokens or
/// more runs in three phases instead of token by token ([`Spec::phased_loop`]). The planner's are
/// [`Spec::planned_tune`]; [`crate::Cuda::set_tune_override`] fixes others (benchmark sweeps).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tune {
    pub ahead_half_waves: u32,
    pub prewait: bool,
    pub phased: bool,
}

impl Tune {
    /// No hints, the token loop (the kernel before them).
    pub const NONE: Tune = Tune {
        ahead_half_waves: 0,
        prewait: false,
        phased: false,
    };

    /// The distance in blocks for a call of `blocks` blocks on a device holding `resident` at once: none for a
    /// call of one wave (nothing comes after it).
    pub fn ahead_blocks(&self, blocks: usize, resident: usize) -> u32 {
        if blocks <= resident || self.ahead_half_waves == 0 {
            0
        } else {
            u32::try_from(resident.saturating_mul(self.ahead_half_waves as usize) / 2).unwrap_or(0)
        }
    }
}

/// How one value head's state is split over threads and blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// Column blocks per head (the cluster size).
    pub ncb: usize,
    /// Row groups: a thread holds d / rg rows of one column.
    pub rg: usize,
    /// Minimum resident blocks per multiprocessor, the register budget given to the compiler.
    pub minb: usize,
}

/// `ncb,rg,minb` (benchmarks' plan overrides): three numbers, else an error. A split the kernel cannot take
/// ([`Plan::valid_for`]) is not used: pools keep the planner's.
impl std::str::FromStr for Plan {
    type Err = Error;
    fn from_str(s: &str) -> Result<Plan> {
        let n: Vec<Option<usize>> = s.split(',').map(|x| x.trim().parse().ok()).collect();
        match n[..] {
            [Some(ncb), Some(rg), Some(minb)] => Ok(Plan { ncb, rg, minb }),
            _ => Err(Error::Param {
                name: "plan",
                why: format!("a plan is ncb,rg,minb, not {s:?}"),
            }),
        }
    }
}

impl Plan {
    pub fn cols(&self, d: usize) -> usize {
        d / self.ncb
    }
    pub fn threads(&self, d: usize) -> usize {
        self.cols(d) * self.rg
    }
    /// Whether this split is valid for head dim `d` (the kernel's static assertions, checked first).
    pub fn valid_for(&self, d: usize) -> bool {
        if self.ncb == 0
            || self.rg == 0
            || !d.is_multiple_of(self.ncb)
            || !d.is_multiple_of(self.rg)
        {
            return false;
        }
        let cols = d / self.ncb;
        let rpt = d / self.rg;
        let nt = cols * self.rg;
        cols.is_multiple_of(16)
            && 32usize.is_multiple_of(self.rg)
            && cols.is_multiple_of(32 / self.rg)
            && rpt.is_multiple_of(4)
            && rpt <= MAX_ROWS_PER_THREAD
            && nt.is_multiple_of(32)
            && nt <= 1024
            && self.minb >= 1
            && self.minb * nt <= 2048
    }

    /// Whether the registers a thread gets at this occupancy hold its rows of the state and the rest: at d 256
    /// one block of 1024 threads a head left 64 registers for 64 rows, and the state spilled.
    pub fn fits_registers(&self, d: usize) -> bool {
        self.valid_for(d)
            && 65536 / (self.minb * self.threads(d)) >= d / self.rg + STATE_REG_RESERVE
    }

    /// A register budget for a split: enough blocks per multiprocessor to overlap one block's loads with
    /// another's arithmetic, as far as the state (rpt registers a thread) leaves room.
    pub fn with_rg(d: usize, ncb: usize, rg: usize) -> Plan {
        let nt = ((d / ncb) * rg).max(1);
        let rpt = d / rg.max(1);
        // conv channels a thread carries across tokens: 2 d of q/k plus its block's v columns
        let nch = (2 * d + d / ncb.max(1)).div_ceil(nt);
        let regs = rpt + 40 + 16 * (nch - 1);
        let minb = (65536 / (nt * regs)).clamp(1, (2048 / nt).max(1));
        Plan { ncb, rg, minb }
    }

    /// The split the planner would choose for `ncb` column blocks: the fewest row groups (at most 8, so a
    /// warp reads at least 16 bytes of a state row) that keep a thread within MAX_ROWS_PER_THREAD rows: the
    /// fewer row groups, the fewer butterfly steps and the more of the state each load instruction moves.
    pub fn for_ncb(d: usize, ncb: usize) -> Option<Plan> {
        if ncb == 0 || !d.is_multiple_of(ncb) {
            return None;
        }
        let splits = [1usize, 2, 4, 8].map(|rg| Plan::with_rg(d, ncb, rg));
        // the fewest row groups whose state fits the registers, else the fewest that are valid at all
        splits
            .iter()
            .find(|p| p.fits_registers(d))
            .or_else(|| splits.iter().find(|p| p.valid_for(d)))
            .copied()
    }

    /// The plan for `b` sequences of `h_v` heads on a device with `sms` multiprocessors: one block a head
    /// (no cluster) wherever the shape allows it. Splitting a head over a cluster paid at no batch size (kernel
    /// v2's sweeps; again on 2026-12-01 at B 1: 5.2 against 4.7 us, NOTES.md), so the plan does not depend on
    /// `b` or `sms`. (It could: the only sum across columns, the output norm's, is a pairwise tree over the head's
    /// warps, the same tree for every cluster size when they are a power of two, so a plan override changes no
    /// bits there.)
    pub fn choose(d: usize, h_v: usize, b: usize, sms: usize) -> Result<Plan> {
        let _ = (h_v, b, sms);
        let plans: Vec<Plan> = CLUSTER_SIZES
            .into_iter()
            .filter_map(|ncb| Plan::for_ncb(d, ncb))
            .collect();
        // one block a head where the state fits its registers, else a cluster where it does (d 256), else the
        // first valid split, which spills (d 208: no split of 13 groups of 16 columns fits)
        plans
            .iter()
            .find(|p| p.fits_registers(d))
            .or(plans.first())
            .copied()
            .ok_or_else(|| {
                Error::Unavailable(format!(
                    "the CUDA backend holds the state in registers and has no thread split for d = {d}"
                ))
            })
    }
}

#[cfg(test)]
mod plan_tests {
    use super::*;

    /// Every head dim up to 256 gets a valid split, one whose register budget holds the state's rows wherever one
    /// exists (d 256 takes a cluster of two blocks a head); d 128 keeps its measured plan (one block, 2 row
    /// groups, 2 blocks an SM).
    #[test]
    fn every_head_dim_gets_a_split_that_keeps_the_state_in_registers() {
        for d in (16..=256).step_by(16) {
            let p = Plan::choose(d, 48, 1, 132).unwrap_or_else(|e| panic!("d {d}: {e}"));
            assert!(p.valid_for(d), "d {d}: {p:?}");
            let any_fits = CLUSTER_SIZES
                .iter()
                .flat_map(|&ncb| [1, 2, 4, 8].map(|rg| Plan::with_rg(d, ncb, rg)))
                .any(|q| d.is_multiple_of(q.ncb) && q.fits_registers(d));
            assert_eq!(p.fits_registers(d), any_fits, "d {d}: {p:?}");
        }
        assert_eq!(
            Plan::choose(128, 48, 256, 132).unwrap(),
            Plan {
                ncb: 1,
                rg: 2,
                minb: 2
            }
        );
        assert_eq!(Plan::choose(256, 48, 256, 132).unwrap().ncb, 2);
        // the plan does not depend on the batch
        for b in [1, 7, 64, 1000] {
            assert_eq!(
                Plan::choose(128, 48, b, 132).unwrap(),
                Plan::choose(128, 48, 256, 132).unwrap()
            );
        }
    }

    /// A forced split is three numbers; anything else is an error, not a default.
    #[test]
    fn a_plan_parses_from_three_numbers() {
        assert_eq!(
            " 8, 8,8".parse::<Plan>().unwrap(),
            Plan {
                ncb: 8,
                rg: 8,
                minb: 8
            }
        );
        for bad in ["", "8,8", "8,8,8,8", "a,b,c", "8,,8", "8,x,8,8"] {
            assert!(bad.parse::<Plan>().is_err(), "{bad:?}");
        }
    }
}

impl Spec {
    /// The specialisation for a layer config, a window length (`None` or a length above [`MAX_CONST_T`]: the
    /// run-time length) and a commit mode under a plan, with f32 tensors and the default pool; see
    /// [`Spec::with_io`] and [`Spec::with_pool`].
    pub fn new(
        arch: (i32, i32),
        config: &Config,
        t: Option<usize>,
        commit: bool,
        planes: bool,
        plan: Plan,
    ) -> Spec {
        Spec {
            arch,
            shape: config.shape,
            t: t.filter(|&t| t <= MAX_CONST_T).unwrap_or(0),
            silu: config.gate == Gate::Silu,
            grouped: config.head_map == HeadMap::Grouped,
            planes,
            commit,
            plan,
            io: Io::default(),
            pool: PoolOptions::default(),
            stage: true,
            ext: None,
            speculative: false,
            ahead: 0,
            prewait: false,
            phased: false,
            one_wave: false,
            window: false,
            route: false,
            wrange: (0, 0),
        }
    }

    /// Whether the window kernel takes this shape: d 64 or 128 (its split: a warp per 16 value columns, the
    /// state as mma fragments), under a plan of one block a head.
    pub fn window_fits(&self) -> bool {
        self.plan.ncb == 1 && matches!(self.shape.d, 64 | 128)
    }

    /// The window kernel's specialisation of the same call of `blocks` blocks on `sms` multiprocessors (no
    /// staging), for the pool's [`window_range`]. Its memory hint, with the split per-column work
    /// ([`Spec::window_split`]) only: in a call of several waves (two blocks a multiprocessor) each block
    /// prefetches into L2 the state of the block half a wave later (`tune`: other distances, for sweeps).
    pub fn with_window(self, blocks: usize, sms: usize, tune: Option<Tune>) -> Spec {
        let s = Spec {
            window: true,
            route: false,
            wrange: window_range(self.pool.state),
            stage: false,
            ahead: 0,
            prewait: false,
            phased: false,
            ..self
        };
        let t = tune.unwrap_or(Tune {
            ahead_half_waves: u32::from(s.window_split()),
            prewait: false,
            phased: false,
        });
        Spec {
            ahead: t.ahead_blocks(blocks, WINDOW_BLOCKS_PER_SM.saturating_mul(sms)),
            ..s
        }
    }

    /// Whether the window kernel splits its per-column work (readouts, norms, outputs) over two threads a
    /// column, half of the chunk's tokens each (`GDN_WSPLIT`; no bits change): where it measured faster, an f32
    /// state and a constant length of 4 to 6 (H200, NOTES.md: B 256 T 4 626 against 668 us, T 6 710 against
    /// 751; slower at T 8 and with a bf16 state at T 6).
    pub fn window_split(&self) -> bool {
        self.window && self.pool.state == DType::F32 && (4..=6).contains(&self.t)
    }

    /// Whether the token-serial kernel runs its window in three phases (`GDN_PHASED`): every token's conv and norms,
    /// then each column's recurrence with no block barrier, then every token's output norm, instead of three block
    /// barriers a token. Asked for by the tune, for a constant window of 2 tokens or more, the speculative kernel's
    /// too (not the window kernel's); the kernel keeps the token loop where the phases' shared memory would not fit
    /// (`PHASED_SMEM`). The same operations in the same order, so no bits change.
    pub fn phased_loop(&self) -> bool {
        self.phased && self.t >= 2 && !self.window
    }

    /// The token-serial kernel leaving the window kernel's sequences to it.
    pub fn with_route(self) -> Spec {
        Spec {
            route: true,
            wrange: window_range(self.pool.state),
            ..self
        }
    }

    /// The planner's memory hints for a call of `blocks` blocks on `sms` multiprocessors, as measured on the
    /// H200 (NOTES.md): the own state prefetched before the wait in a call of one wave (B 1 rotated: -6 to -8%;
    /// in a longer call it delays every later block's loads, B 256 +13%), and a prefetch half a wave ahead only
    /// for a staged bf16 value-major state in a call of several waves (B 256: -13%; f32 and key-major states
    /// lose 1-7% with it).
    pub fn planned_tune(&self, blocks: usize, sms: usize) -> Tune {
        let one_wave = blocks <= self.minb().saturating_mul(sms);
        let ahead = !one_wave && self.staged() && self.pool.layout == StateLayout::ValueMajor;
        Tune {
            ahead_half_waves: ahead as u32,
            prewait: one_wave,
            phased: true,
        }
    }

    /// The same specialisation with the memory hints `tune` (None: the planner's, [`Spec::planned_tune`]) for a
    /// call of `blocks` blocks on `sms` multiprocessors.
    pub fn with_tune(self, tune: Option<Tune>, blocks: usize, sms: usize) -> Spec {
        let resident = self.minb().saturating_mul(sms);
        let t = tune.unwrap_or_else(|| self.planned_tune(blocks, sms));
        Spec {
            ahead: t.ahead_blocks(blocks, resident),
            prewait: t.prewait,
            phased: t.phased,
            one_wave: blocks <= resident,
            ..self
        }
    }

    /// The same specialisation as the pool's speculative step (commits on, no staging).
    pub fn with_speculative(self) -> Spec {
        Spec {
            speculative: true,
            commit: true,
            ..self
        }
    }

    /// The same specialisation on memory the caller owns, the conv state in `conv` (f32, bf16 or f16).
    pub fn with_ext(self, conv: DType) -> Spec {
        Spec {
            ext: Some(conv),
            ..self
        }
    }

    /// The same specialisation with other tensor element types.
    pub fn with_io(self, io: Io) -> Spec {
        Spec { io, ..self }
    }

    /// The same specialisation with staging allowed or not.
    pub fn with_stage(self, stage: bool) -> Spec {
        Spec { stage, ..self }
    }

    /// The same specialisation for another kind of pool.
    pub fn with_pool(self, pool: PoolOptions) -> Spec {
        Spec { pool, ..self }
    }

    /// Whether the kernel stages the state through shared memory instead of registers (the kernel's `STAGE`:
    /// asked for, a bf16 state at T 1, one block a head, d <= 128).
    pub fn staged(&self) -> bool {
        let d = self.shape.d;
        self.stage
            && !self.speculative
            && self.pool.state == DType::Bf16
            && self.t == 1
            && self.plan.ncb == 1
            && d <= 128
            && (d / self.plan.rg.max(1)).is_multiple_of(8)
    }

    /// The register budget compiled in: the plan's, and for a staged state (no registers hold it) more blocks
    /// a multiprocessor, as many as measured best on the H200 (B 256 T 1, NOTES.md): six key-major (2-byte
    /// shared loads, so more blocks to cover them), four value-major. Only the register allocation changes
    /// with it, not the arithmetic.
    pub fn minb(&self) -> usize {
        if self.staged() {
            let extra = if self.pool.layout == StateLayout::KeyMajor {
                4
            } else {
                2
            };
            (self.plan.minb + extra).min((2048 / self.threads().max(1)).max(1))
        } else {
            self.plan.minb
        }
    }

    /// The macro lines that select this specialisation, put before the kernel source. The pool's header is
    /// exactly what it was before the external step existed (the `GDN_EXT` lines come only with `ext`, the
    /// `GDN_SPEC` line only with `speculative`), so the machine code of the other specialisations is unchanged.
    pub fn header(&self) -> String {
        let mut h = self.pool_header();
        if self.speculative {
            h.push_str("#define GDN_SPEC 1\n");
        }
        if self.ahead > 0 {
            h.push_str(&format!("#define GDN_AHEAD {}\n", self.ahead));
        }
        if self.prewait {
            h.push_str("#define GDN_PREWAIT 1\n");
        }
        if self.phased_loop() {
            h.push_str("#define GDN_PHASED 1\n");
        }
        if self.route {
            h.push_str("#define GDN_ROUTE 1\n");
        }
        if self.window_split() {
            h.push_str("#define GDN_WSPLIT 1\n");
        }
        if self.route || self.window {
            h.push_str(&format!(
                "#define GDN_WMIN {}\n#define GDN_WMAX {}\n",
                self.wrange.0, self.wrange.1
            ));
        }
        if let Some(conv) = self.ext {
            h.push_str(&format!(
                "#define GDN_EXT 1\n#define GDN_CONV_DT {}\n",
                dt_code(conv)
            ));
            if let Some(r) = self.readers_cluster() {
                h.push_str(&format!("#define GDN_RCL {r}\n"));
            }
        }
        h
    }

    /// A decode step (T 1) on memory the caller owns that commits, with one block a head, in a call of one wave:
    /// the blocks that read one key head's q / k history form a cluster of h_v / h_k (a barrier orders their reads
    /// before the write; the kernel's GDN_RCL), where that is at most 8 (the portable cluster size). Otherwise a
    /// last-reader count in global memory does. Measured on the H200 (NOTES.md): B 1 T 1 5.68 -> 4.97 us (f32),
    /// 5.32 -> 4.80 (bf16); it lost at T 8 (B 1 18.8 -> 20.9, B 256 1179 -> 1417) and at B 256 T 1 f32 (482 -> 499).
    pub fn readers_cluster(&self) -> Option<usize> {
        let r = self.shape.h_v / self.shape.h_k;
        (self.ext.is_some()
            && self.commit
            && !self.speculative
            && !self.window
            && self.t == 1
            && self.one_wave
            && self.plan.ncb == 1
            && r <= 8)
            .then_some(r)
    }

    fn pool_header(&self) -> String {
        let s = &self.shape;
        format!(
            "#define GDN_D {}\n#define GDN_HK {}\n#define GDN_HV {}\n#define GDN_T {}\n#define GDN_SILU {}\n\
             #define GDN_GROUPED {}\n#define GDN_PLANES {}\n#define GDN_COMMIT {}\n#define GDN_NCB {}\n\
             #define GDN_RG {}\n#define GDN_MINB {}\n#define GDN_QKV_DT {}\n#define GDN_ALPHA_DT {}\n\
             #define GDN_BETA_DT {}\n#define GDN_Z_DT {}\n#define GDN_OUT_DT {}\n#define GDN_STATE_DT {}\n\
             #define GDN_VMAJOR {}\n#define GDN_STAGE {}\n",
            s.d,
            s.h_k,
            s.h_v,
            self.t,
            self.silu as u8,
            self.grouped as u8,
            self.planes as u8,
            self.commit as u8,
            self.plan.ncb,
            self.plan.rg,
            self.minb(),
            dt_code(self.io.qkv),
            dt_code(self.io.alpha),
            dt_code(self.io.beta),
            dt_code(self.io.z),
            dt_code(self.io.out),
            dt_code(self.pool.state),
            (self.pool.layout == StateLayout::ValueMajor) as u8,
            self.staged() as u8,
        )
    }

    pub fn source(&self) -> String {
        let body = if self.window { WINDOW_SRC } else { KERNEL_SRC };
        format!("{}{}{}", self.header(), ELT_SRC, body)
    }

    /// The threads of one block (the window kernel's: 2 d, a warp per 16 value columns).
    pub fn threads(&self) -> usize {
        if self.window {
            2 * self.shape.d
        } else {
            self.plan.threads(self.shape.d)
        }
    }
}

/// Machine code of one specialisation and the compiler's log (with ptxas's resource report).
#[derive(Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// Whether libnvrtc can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library by its candidate names; no symbol is called.
    unsafe { nvrtc_sys::is_culib_present() }
}

type Slot = Arc<OnceLock<std::result::Result<Arc<Compiled>, String>>>;

fn cache() -> &'static Mutex<HashMap<Spec, Slot>> {
    static CACHE: OnceLock<Mutex<HashMap<Spec, Slot>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The machine code for `spec`, compiled by NVRTC on first use and cached for the process. Different
/// specialisations compile in parallel; a second caller of the same one waits for the first.
pub fn compiled(spec: &Spec) -> Result<Arc<Compiled>> {
    if !nvrtc_present() {
        return Err(Error::Unavailable(
            "libnvrtc (CUDA 13) not found: install nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let slot: Slot = {
        let mut map = cache()
            .lock()
            .map_err(|_| Error::Backend("kernel cache lock poisoned".into()))?;
        map.entry(*spec).or_default().clone()
    };
    slot.get_or_init(|| compile(spec).map(Arc::new))
        .clone()
        .map_err(Error::Backend)
}

fn log_of(prog: nvrtc_sys::nvrtcProgram) -> String {
    // SAFETY: `prog` is a live program created by `compile` below.
    match unsafe { nvrtc_result::get_program_log(prog) } {
        Ok(raw) => {
            let bytes: Vec<u8> = raw
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Err(e) => format!("(no log: {e:?})"),
    }
}

/// Compiles one specialisation to a cubin for its architecture.
fn compile(spec: &Spec) -> std::result::Result<Compiled, String> {
    compile_source(
        &spec.source(),
        if spec.window {
            "gdn_window.cu"
        } else {
            "gdn_step.cu"
        },
        spec.arch,
        &format!("{spec:?}"),
        &spec.header(),
    )
}

/// Machine code of another kernel source of this crate (the chunked path's, `crate::chunk`; the quantized
/// out_proj's, `crate::quant`), compiled as the step kernel is (same options) and cached for the process by its
/// full source text.
pub(crate) fn compiled_source(src: &str, name: &str, arch: (i32, i32)) -> Result<Arc<Compiled>> {
    type SrcSlot = Arc<OnceLock<std::result::Result<Arc<Compiled>, String>>>;
    type SrcCache = Mutex<HashMap<(String, (i32, i32)), SrcSlot>>;
    static SRC_CACHE: OnceLock<SrcCache> = OnceLock::new();
    if !nvrtc_present() {
        return Err(Error::Unavailable(
            "libnvrtc (CUDA 13) not found: install nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let slot: SrcSlot = {
        let mut map = SRC_CACHE
            .get_or_init(|| Mutex::new(HashMap::new()))
            .lock()
            .map_err(|_| Error::Backend("kernel cache lock poisoned".into()))?;
        map.entry((src.to_string(), arch)).or_default().clone()
    };
    slot.get_or_init(|| {
        let head: String = src
            .lines()
            .take_while(|l| l.starts_with("#define"))
            .collect::<Vec<_>>()
            .join("\n");
        compile_source(src, name, arch, name, &head).map(Arc::new)
    })
    .clone()
    .map_err(Error::Backend)
}

fn compile_source(
    src: &str,
    name: &str,
    arch: (i32, i32),
    what: &str,
    header: &str,
) -> std::result::Result<Compiled, String> {
    let src = CString::new(src).map_err(|e| e.to_string())?;
    let name = CString::new(name).map_err(|e| e.to_string())?;
    let prog = nvrtc_result::create_program(&src, Some(&name)).map_err(|e| format!("{e:?}"))?;
    let arch = format!("--gpu-architecture=sm_{}{}", arch.0, arch.1);
    let opts = [
        arch.as_str(),
        "--std=c++17",
        "--fmad=false",
        "--ptxas-options=--verbose",
        "-default-device",
    ];
    // SAFETY: `prog` is live until destroyed at the end of this function; the option strings outlive the call.
    let compiled = unsafe { nvrtc_result::compile_program(prog, &opts) };
    let log = log_of(prog);
    let out = match compiled {
        Err(e) => Err(format!(
            "NVRTC failed on {what} ({e:?}):\n{log}\n(the source starts with:\n{header})"
        )),
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; `size` is a valid out-pointer.
            let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) };
            if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(format!("nvrtcGetCUBINSize failed: {r:?}"))
            } else {
                let mut cubin = vec![0u8; size];
                // SAFETY: `cubin` has exactly the size NVRTC reported for this program's cubin.
                let r =
                    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) };
                if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(format!("nvrtcGetCUBIN failed: {r:?}"))
                } else {
                    Ok(Compiled { cubin, log })
                }
            }
        }
    };
    // SAFETY: `prog` was created above and is not used after this.
    let _ = unsafe { nvrtc_result::destroy_program(prog) };
    out
}

/// ptxas's one-line resource summary ("Used N registers, ...") out of a compile log.
pub fn resource_line(log: &str) -> String {
    log.lines()
        .filter(|l| l.contains("registers") || l.contains("spill"))
        .map(|l| l.trim())
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every specialisation the planner can produce for `config` on `arch` at batch sizes `batches` (f32 tensors, the
/// default pool): windows 1..=MAX_CONST_T and the run-time length, planes on and off, verify and commit; the gate
/// and head map are `config`'s. [`Spec::with_io`] and [`Spec::with_pool`] give the other dtypes and pools.
pub fn all_specs(arch: (i32, i32), config: &Config, sms: usize, batches: &[usize]) -> Vec<Spec> {
    let mut plans: Vec<Plan> = batches
        .iter()
        .filter_map(|&b| Plan::choose(config.shape.d, config.shape.h_v, b, sms).ok())
        .collect();
    plans.sort_by_key(|p| (p.ncb, p.rg));
    plans.dedup();
    let mut out = Vec::new();
    for plan in plans {
        for t in (1..=MAX_CONST_T).map(Some).chain([None]) {
            for planes in [false, true] {
                for commit in [false, true] {
                    out.push(Spec::new(arch, config, t, commit, planes, plan));
                }
            }
        }
    }
    out
}
