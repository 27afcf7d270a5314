//! The Metal and DX12 shader paths, which no machine here runs: every WGSL specialisation the backend can
//! build is parsed, validated and translated with naga (the version wgpu uses) to MSL and HLSL, with the
//! options wgpu-hal's Metal and DX12 backends pass (binding maps built the way they build them, runtime checks
//! on and off as `Options::runtime_checks` asks). No GPU, no adapter: pure naga, so it runs on every CI machine.
//! What is not checked here: Apple's and Microsoft's compilers (xcrun metal, DXC) on the translated text.
//!
//! What a pipeline is specialised on (`KernelKey`): head dim, row blocks, reduction path, runtime checks, state
//! dtype and layout, four input dtypes and the output dtype. Head counts and their ratio, head map, gate, eps,
//! planes and every sequence's rows and commit (verify, all, first k) are uniforms or job entries: they do not
//! change the shader's text, so one specialisation covers all of them. Runtime checks do not change the WGSL
//! either, only the translation options, so every module is translated both ways.
//!
//! Coverage (`NOTES.md` has the counts and times):
//! - the cross product of every head dim in `DIMS`, every row-block count the backend may choose for it on
//!   Metal and DX12 (a divisor `ib` of d / 4 with d ib <= 1024 threads: `choose_row_blocks` lowers any
//!   requested count to one of these), both reduction paths, both state dtypes, both layouts and the three
//!   output dtypes, the inputs' dtypes rotated with the output's so that every input meets every dtype;
//! - at d = 128 and four row blocks (the default), the full cross product: all 81 x 3 input and output dtype
//!   combinations on both paths, both state dtypes and both layouts. An input's dtype changes only its own
//!   loader function (`ld_qkv`, `ld_alpha`, `ld_beta`, `ld_z`: a load from `inp` at a uniform offset), which
//!   no other key dimension touches, so the rotation above and this cross product cover how they combine;
//! - every head dim the backend accepts (16, 32, ..., 1024) at its default row blocks, on both paths, both
//!   states and both layouts, the dtypes moving with d;
//! - the chunked kernels of long windows (`chunk.wgsl`, four entry points) at every head dim in `DIMS` and every
//!   column block the backend picks, both state dtypes and layouts, the three output dtypes with rotated inputs;
//! - the copy-ceiling kernel;
//! - that the check can fail: a subgroup kernel validated without the subgroup capability is an error.

use std::fmt::Write as _;
use std::time::Instant;

use gdn::{DType, StateLayout};
use gdn_wgpu::KernelKey;
use naga::back::{hlsl, msl};
use naga::valid::{Capabilities, ShaderStages, SubgroupOperationSet, ValidationFlags, Validator};

/// Head dims of the cross product: SPEC's small ones, the seed's 128, 256, an odd d / 16 (48, 80: the 16-bit
/// group sums round their width up), and the largest the backend accepts (1024, one row block, its row loops
/// kept as loops rather than written out).
const DIMS: [usize; 9] = [16, 32, 48, 64, 80, 128, 256, 512, 1024];

/// The largest workgroup on Metal and DX12 (and on most Vulkan drivers).
const MAX_THREADS: usize = 1024;

/// Metal language versions: the oldest wgpu's Metal backend picks on an OS it supports (macOS 10.13: 2.0)
/// and the one of a current macOS (3.2); subgroup operations need Apple7 / Mac2 GPUs, macOS 10.15 and later,
/// MSL 2.2 at least.
const MSL_PLAIN: (u8, u8) = (2, 0);
const MSL_SUBGROUPS: (u8, u8) = (2, 2);
const MSL_NEW: (u8, u8) = (3, 2);

/// wgpu's DX12 backend refuses adapters below shader model 6.0, and 6.0 is what wave (subgroup) operations
/// need: the lowest it compiles for.
const HLSL_SM: hlsl::ShaderModel = hlsl::ShaderModel::V6_0;

const DTYPES: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

#[derive(Clone, Copy)]
enum Bind {
    Storage { read_only: bool },
    Uniform,
}

/// The step kernel's bind group layout (`Gpu::open`): state, history, inputs, weights, output, jobs, params,
/// held windows.
const STEP_LAYOUT: [Bind; 8] = [
    Bind::Storage { read_only: false },
    Bind::Storage { read_only: false },
    Bind::Storage { read_only: true },
    Bind::Storage { read_only: true },
    Bind::Storage { read_only: false },
    Bind::Storage { read_only: true },
    Bind::Uniform,
    Bind::Storage { read_only: false },
];

/// The copy kernel's (derived by wgpu from the shader): source, destination.
const COPY_LAYOUT: [Bind; 2] = [
    Bind::Storage { read_only: true },
    Bind::Storage { read_only: false },
];

fn rb(binding: usize) -> naga::ResourceBinding {
    naga::ResourceBinding {
        group: 0,
        binding: binding as u32,
    }
}

/// Buffers in binding order, one slot each, then the sizes buffer (runtime-sized arrays), as wgpu-hal's
/// Metal `create_pipeline_layout` assigns them.
fn msl_resources(layout: &[Bind]) -> msl::EntryPointResources {
    let mut resources = msl::BindingMap::default();
    for (i, b) in layout.iter().enumerate() {
        let target = msl::BindTarget {
            buffer: Some(i as msl::Slot),
            mutable: matches!(b, Bind::Storage { read_only: false }),
            ..Default::default()
        };
        resources.insert(rb(i), target);
    }
    msl::EntryPointResources {
        resources,
        immediates_buffer: None,
        sizes_buffer: Some(layout.len() as msl::Slot),
    }
}

/// Registers by class (CBV for uniforms, SRV for read-only storage, UAV for read-write), counted in binding
/// order in space 0, as wgpu-hal's DX12 `create_pipeline_layout`; the special constants (num_workgroups) in
/// the next CBV register.
fn hlsl_bindings(layout: &[Bind]) -> (hlsl::BindingMap, hlsl::BindTarget) {
    let (mut cbv, mut srv, mut uav) = (0u32, 0u32, 0u32);
    let mut map = hlsl::BindingMap::default();
    for (i, b) in layout.iter().enumerate() {
        let counter = match b {
            Bind::Uniform => &mut cbv,
            Bind::Storage { read_only: true } => &mut srv,
            Bind::Storage { read_only: false } => &mut uav,
        };
        map.insert(
            rb(i),
            hlsl::BindTarget {
                space: 0,
                register: *counter,
                ..Default::default()
            },
        );
        *counter += 1;
    }
    let special = hlsl::BindTarget {
        space: 0,
        register: cbv,
        ..Default::default()
    };
    (map, special)
}

/// Parses, validates (with the subgroup capability where the kernel uses subgroups, as wgpu-core does for a
/// device with `Features::SUBGROUP`) and translates one module to MSL and HLSL, checked and unchecked; the
/// errors, or the number of translations made.
fn translate(
    src: &str,
    entry: &str,
    layout: &[Bind],
    subgroups: bool,
    zero_init: bool,
) -> Result<usize, String> {
    let module = naga::front::wgsl::parse_str(src)
        .map_err(|e| format!("WGSL: {}", e.emit_to_string(src)))?;
    let (caps, ops) = if subgroups {
        (Capabilities::SUBGROUP, SubgroupOperationSet::all())
    } else {
        (Capabilities::empty(), SubgroupOperationSet::empty())
    };
    let info = Validator::new(ValidationFlags::all(), caps)
        .subgroup_stages(ShaderStages::COMPUTE)
        .subgroup_operations(ops)
        .validate(&module)
        .map_err(|e| format!("validation: {}", e.emit_to_string(src)))?;
    let mut errors = String::new();
    let mut made = 0;
    let msl_versions: &[(u8, u8)] = if subgroups {
        &[MSL_SUBGROUPS, MSL_NEW]
    } else {
        &[MSL_PLAIN, MSL_NEW]
    };
    let (binding_map, special) = hlsl_bindings(layout);
    for checked in [true, false] {
        let policy = if checked {
            naga::proc::BoundsCheckPolicy::Restrict
        } else {
            naga::proc::BoundsCheckPolicy::Unchecked
        };
        for &lang_version in msl_versions {
            let options = msl::Options {
                lang_version,
                per_entry_point_map: msl::EntryPointResourceMap::from([(
                    entry.to_string(),
                    msl_resources(layout),
                )]),
                inline_samplers: Vec::new(),
                spirv_cross_compatibility: false,
                fake_missing_bindings: false,
                bounds_check_policies: naga::proc::BoundsCheckPolicies {
                    index: policy,
                    buffer: policy,
                    image_load: policy,
                    binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
                },
                zero_initialize_workgroup_memory: zero_init,
                force_loop_bounding: checked,
                task_dispatch_limits: None,
                mesh_shader_primitive_indices_clamp: checked,
                ray_query_initialization_tracking: checked,
                emit_int_div_checks: checked,
            };
            let pipeline = msl::PipelineOptions {
                entry_point: Some((naga::ShaderStage::Compute, entry.to_string())),
                allow_and_force_point_size: false,
                vertex_pulling_transform: true,
                vertex_buffer_mappings: Vec::new(),
                binding_array_length_map: Default::default(),
            };
            match msl::write_string(&module, &info, &options, &pipeline) {
                Ok((text, ti))
                    if !text.is_empty() && ti.entry_point_names.iter().all(|n| n.is_ok()) =>
                {
                    made += 1
                }
                Ok((_, ti)) => {
                    let _ = writeln!(
                        errors,
                        "MSL {lang_version:?} checked {checked}: entry points {:?}",
                        ti.entry_point_names
                    );
                }
                Err(e) => {
                    let _ = writeln!(errors, "MSL {lang_version:?} checked {checked}: {e:?}");
                }
            }
        }
        let options = hlsl::Options {
            shader_model: HLSL_SM,
            binding_map: binding_map.clone(),
            fake_missing_bindings: false,
            special_constants_binding: Some(special),
            zero_initialize_workgroup_memory: zero_init,
            restrict_indexing: checked,
            force_loop_bounding: checked,
            task_dispatch_limits: None,
            mesh_shader_primitive_indices_clamp: checked,
            ray_query_initialization_tracking: checked,
            ..Default::default()
        };
        let pipeline = hlsl::PipelineOptions {
            entry_point: Some((naga::ShaderStage::Compute, entry.to_string())),
        };
        let mut text = String::new();
        let result = hlsl::Writer::new(&mut text, &options, &pipeline).write(&module, &info, None);
        match result {
            Ok(r) if !text.is_empty() && r.entry_point_names.iter().all(|n| n.is_ok()) => made += 1,
            Ok(r) => {
                let _ = writeln!(
                    errors,
                    "HLSL checked {checked}: entry points {:?}",
                    r.entry_point_names
                );
            }
            Err(e) => {
                let _ = writeln!(errors, "HLSL {HLSL_SM:?} checked {checked}: {e:?}");
            }
        }
    }
    if errors.is_empty() {
        Ok(made)
    } else {
        Err(errors)
    }
}

/// Row-block counts the backend may run at head dim `d` on Metal or DX12.
fn row_blocks(d: usize) -> Vec<usize> {
    (1..=d / 4)
        .filter(|&ib| d.is_multiple_of(4 * ib) && d * ib <= MAX_THREADS)
        .collect()
}

/// Translates every key; panics naming each one that failed.
fn run(what: &str, keys: &[KernelKey]) {
    let t0 = Instant::now();
    let mut made = 0;
    let mut failed = Vec::new();
    for key in keys {
        // checked does not change the text: both translations are made from each module
        assert!(key.checked);
        match translate(
            &key.source(),
            "gdn_step",
            &STEP_LAYOUT,
            key.subgroups,
            false,
        ) {
            Ok(n) => made += n,
            Err(e) => failed.push(format!("{key:?}:\n{e}")),
        }
    }
    eprintln!(
        "{what}: {} specialisations (x2 runtime checks), {made} translations to MSL and HLSL in {:.1} s",
        keys.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failed.is_empty(),
        "{} of {} specialisations failed:\n{}",
        failed.len(),
        keys.len(),
        failed.join("\n")
    );
}

/// The cross product at head dim `d`: every row-block count, path, state dtype, layout and output dtype.
fn cross(d: usize) -> Vec<KernelKey> {
    let mut keys = Vec::new();
    for row_blocks in row_blocks(d) {
        for subgroups in [false, true] {
            for state in [DType::F32, DType::Bf16] {
                for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
                    for (k, out) in DTYPES.into_iter().enumerate() {
                        // rotated: over the three outputs every input meets every dtype
                        let inputs = std::array::from_fn(|m| DTYPES[(k + m) % 3]);
                        keys.push(KernelKey {
                            d,
                            subgroups,
                            row_blocks,
                            checked: true,
                            state,
                            layout,
                            inputs,
                            out,
                        });
                    }
                }
            }
        }
    }
    keys
}

#[test]
fn row_block_counts_are_the_backends() {
    assert_eq!(row_blocks(16), [1, 2, 4]);
    assert_eq!(row_blocks(48), [1, 2, 3, 4, 6, 12]);
    assert_eq!(row_blocks(128), [1, 2, 4, 8]);
    assert_eq!(row_blocks(1024), [1]);
}

// split in four so that the harness runs them on every core
#[test]
fn msl_hlsl_small_dims() {
    let keys: Vec<KernelKey> = DIMS[..5].iter().copied().flat_map(cross).collect();
    run("d 16..80", &keys);
}

#[test]
fn msl_hlsl_large_dims() {
    let keys: Vec<KernelKey> = DIMS[5..].iter().copied().flat_map(cross).collect();
    run("d 128..1024", &keys);
}

/// Every combination of the four inputs' and the output's dtypes at the seed's d = 128 and four row blocks, on
/// both paths, both state dtypes and both layouts; two tests, one a path.
fn every_dtype_combination(subgroups: bool) {
    let mut keys = Vec::new();
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            for code in 0..3usize.pow(5) {
                let dt = |m: u32| DTYPES[code / 3usize.pow(m) % 3];
                keys.push(KernelKey {
                    d: 128,
                    subgroups,
                    row_blocks: 4,
                    checked: true,
                    state,
                    layout,
                    inputs: [dt(0), dt(1), dt(2), dt(3)],
                    out: dt(4),
                });
            }
        }
    }
    run(
        &format!("d 128, subgroups {subgroups}, every dtype combination"),
        &keys,
    );
}

#[test]
fn msl_hlsl_every_dtype_combination_workgroup_memory() {
    every_dtype_combination(false);
}

#[test]
fn msl_hlsl_every_dtype_combination_subgroups() {
    every_dtype_combination(true);
}

/// The row blocks the backend picks by default (`Options::row_blocks` 4, lowered by halving until the shape and a
/// 1024-thread limit allow it), as `choose_row_blocks` does.
fn default_row_blocks(d: usize) -> usize {
    let mut ib = 4;
    while ib > 1 && (d * ib > MAX_THREADS || !d.is_multiple_of(4 * ib)) {
        ib /= 2;
    }
    ib
}

/// Every head dim the backend accepts (SPEC: a multiple of 16 up to 1024) at its default row blocks, on both
/// paths, both states and both layouts, the output dtype (and the inputs' rotation) moving with d.
#[test]
fn msl_hlsl_every_head_dim() {
    let mut keys = Vec::new();
    for (k, d) in (16..=1024).step_by(16).enumerate() {
        for subgroups in [false, true] {
            for state in [DType::F32, DType::Bf16] {
                for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
                    keys.push(KernelKey {
                        d,
                        subgroups,
                        row_blocks: default_row_blocks(d),
                        checked: true,
                        state,
                        layout,
                        inputs: std::array::from_fn(|m| DTYPES[(k + m) % 3]),
                        out: DTYPES[k % 3],
                    });
                }
            }
        }
    }
    run("every head dim 16..1024 at its default row blocks", &keys);
}

#[test]
fn a_subgroup_kernel_without_the_capability_fails() {
    let key = KernelKey {
        subgroups: true,
        ..KernelKey::plain(64)
    };
    let err = translate(&key.source(), "gdn_step", &STEP_LAYOUT, false, false).unwrap_err();
    assert!(err.contains("validation"), "{err}");
}

#[test]
fn msl_hlsl_copy_kernel() {
    let made = translate(
        include_str!("../src/copy.wgsl"),
        "copy",
        &COPY_LAYOUT,
        false,
        true,
    )
    .unwrap_or_else(|e| panic!("copy.wgsl:\n{e}"));
    assert_eq!(made, 6);
}

#[test]
fn msl_hlsl_chunked_kernels() {
    let t0 = Instant::now();
    let mut made = 0;
    let mut failed = Vec::new();
    let mut n = 0;
    for d in DIMS {
        let mut blocks: Vec<String> = Vec::new();
        for (len, columns) in [16, 32]
            .into_iter()
            .flat_map(|l| [8, 16, 32].map(|c| (l, c)))
        {
            for state in [DType::F32, DType::Bf16] {
                for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
                    for (k, out) in DTYPES.into_iter().enumerate() {
                        let key = KernelKey {
                            state,
                            layout,
                            out,
                            inputs: std::array::from_fn(|m| DTYPES[(k + m) % 3]),
                            ..KernelKey::plain(d)
                        };
                        let src = key.chunk_source(len, columns);
                        // a column count the backend lowers to one already covered gives the same text
                        if blocks.contains(&src) {
                            continue;
                        }
                        n += 1;
                        for entry in gdn_wgpu::CHUNK_ENTRIES {
                            match translate(&src, entry, &STEP_LAYOUT, false, false) {
                                Ok(m) => made += m,
                                Err(e) => failed.push(format!(
                                    "d {d} L {len} BV {columns} {key:?} {entry}:\n{e}"
                                )),
                            }
                        }
                        blocks.push(src);
                    }
                }
            }
        }
    }
    eprintln!(
        "chunked kernels: {n} specialisations x 4 entry points, {made} translations in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
