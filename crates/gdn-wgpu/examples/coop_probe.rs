//! What cooperative-matrix configurations wgpu 30 exposes on each adapter (`Features::EXPERIMENTAL_COOPERATIVE_MATRIX`,
//! the tensor cores of NVIDIA's Vulkan driver), whether a 16x16x16 f16 x f16 + f32 product compiles and runs, its
//! error against float64 (read back as row-major and as column-major) and the products' throughput (host clock).
//! The probe behind NOTES.md's "Tensor cores are reachable": `cargo run --release -p gdn-wgpu --example coop_probe`.
use std::time::Instant;

const SHADER: &str = r#"
enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read> a: array<f16>;
@group(0) @binding(1) var<storage, read> b: array<f16>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<uniform> reps: vec4<u32>;
@compute @workgroup_size(32)
fn one() {
    let ma = coopLoad<coop_mat16x16<f16, A>>(&a[0], 16u);
    let mb = coopLoad<coop_mat16x16<f16, B>>(&b[0], 16u);
    var mc = coopLoad<coop_mat16x16<f32, C>>(&c[0], 16u);
    mc = coopMultiplyAdd(ma, mb, mc);
    coopStore(mc, &c[0], 16u);
}
@compute @workgroup_size(32)
fn many() {
    let ma = coopLoad<coop_mat16x16<f16, A>>(&a[0], 16u);
    let mb = coopLoad<coop_mat16x16<f16, B>>(&b[0], 16u);
    var m0 = coopLoad<coop_mat16x16<f32, C>>(&c[0], 16u);
    var m1 = m0;
    var m2 = m0;
    var m3 = m0;
    for (var i = 0u; i < reps.x; i++) {
        m0 = coopMultiplyAdd(ma, mb, m0);
        m1 = coopMultiplyAdd(ma, mb, m1);
        m2 = coopMultiplyAdd(ma, mb, m2);
        m3 = coopMultiplyAdd(ma, mb, m3);
    }
    if (reps.y == 12345u) {
        coopStore(m0, &c[256u], 16u);
        coopStore(m1, &c[256u], 16u);
        coopStore(m2, &c[256u], 16u);
        coopStore(m3, &c[256u], 16u);
    }
}
"#;

const SHADER32: &str = r#"
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@compute @workgroup_size(32)
fn one() {
    let ma = coopLoad<coop_mat8x8<f32, A>>(&a[0], 8u);
    let mb = coopLoad<coop_mat8x8<f32, B>>(&b[0], 8u);
    var mc = coopLoad<coop_mat8x8<f32, C>>(&c[0], 8u);
    mc = coopMultiplyAdd(ma, mb, mc);
    coopStore(mc, &c[0], 8u);
}
"#;

fn main() {
    // naga alone first: does the shader parse and validate?
    for (name, src) in [("f16 16x16", SHADER), ("f32 8x8", SHADER32)] {
        match naga::front::wgsl::parse_str(src) {
            Ok(m) => {
                let mut v = naga::valid::Validator::new(
                    naga::valid::ValidationFlags::all(),
                    naga::valid::Capabilities::all(),
                );
                println!("naga {name}: parsed; validate: {:?}", v.validate(&m).err());
            }
            Err(e) => println!("naga {name}: parse error {}", e.emit_to_string(src)),
        }
    }
    pollster::block_on(run());
}

async fn run() {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.flags = wgpu::InstanceFlags::empty();
    desc.backends = wgpu::Backends::PRIMARY;
    let instance = wgpu::Instance::new(desc);
    for adapter in instance.enumerate_adapters(wgpu::Backends::all()).await {
        let info = adapter.get_info();
        let f = adapter.features();
        println!(
            "adapter {} ({:?}, driver {} {}): subgroup {} f16 {} coop {} subgroup sizes {}..{}",
            info.name,
            info.backend,
            info.driver,
            info.driver_info,
            f.contains(wgpu::Features::SUBGROUP),
            f.contains(wgpu::Features::SHADER_F16),
            f.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX),
            info.subgroup_min_size,
            info.subgroup_max_size,
        );
        let props = adapter.cooperative_matrix_properties();
        for p in &props {
            println!("  coop {p:?}");
        }
        if !f.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
            continue;
        }
        let want = |ab, cr, n| {
            props.iter().any(|p| {
                p.m_size == n
                    && p.n_size == n
                    && p.k_size == n
                    && p.ab_type == ab
                    && p.cr_type == cr
            })
        };
        use wgpu::CooperativeScalarType as S;
        let f16ok = want(S::F16, S::F32, 16) && f.contains(wgpu::Features::SHADER_F16);
        let f32ok = want(S::F32, S::F32, 8);
        println!("  f16x16->f32: {f16ok}; f32 8x8: {f32ok}");
        let mut feats =
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::TIMESTAMP_QUERY;
        if f16ok {
            feats |= wgpu::Features::SHADER_F16;
        }
        let (device, queue) = match adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: None,
                required_features: feats,
                required_limits: adapter.limits(),
                // SAFETY: the experimental feature is used only by this probe's own shader, with one subgroup a workgroup
                experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
                ..Default::default()
            })
            .await
        {
            Ok(x) => x,
            Err(e) => {
                println!("  no device: {e}");
                continue;
            }
        };
        if f16ok {
            probe_f16(&device, &queue);
        }
        if f32ok {
            println!("  (f32 8x8 listed; not run)");
        }
    }
}

fn buf(device: &wgpu::Device, bytes: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
    use wgpu::util::DeviceExt;
    device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: bytes,
        usage,
    })
}

fn probe_f16(device: &wgpu::Device, queue: &wgpu::Queue) {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: None,
        source: wgpu::ShaderSource::Wgsl(SHADER.into()),
    });
    // A, B: values exact in f16 with spread exponents; C: f32 with low bits set
    let mut seed = 12345u64;
    let mut rnd = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f64 / (1u64 << 31) as f64) * 2.0 - 1.0
    };
    // k / 1024 with |k| < 1024 (and b / 128 more): exact in f16
    let a: Vec<f64> = (0..256)
        .map(|_| (rnd() * 1023.0).round() / 1024.0)
        .collect();
    let b: Vec<f64> = (0..256)
        .map(|_| (rnd() * 1023.0).round() / 8192.0)
        .collect();
    let ah: Vec<u16> = a.iter().map(|&x| f16_bits(x)).collect();
    let bh: Vec<u16> = b.iter().map(|&x| f16_bits(x)).collect();
    let c: Vec<f32> = (0..512)
        .map(|i| if i < 256 { (rnd() * 1e-3) as f32 } else { 0.0 })
        .collect();
    let st =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let ab = buf(device, bytemuck::cast_slice(&ah), st);
    let bb = buf(device, bytemuck::cast_slice(&bh), st);
    let cb = buf(device, bytemuck::cast_slice(&c), st);
    let reps = 4096u32;
    let ub = buf(
        device,
        bytemuck::cast_slice(&[reps, 0u32, 0, 0]),
        wgpu::BufferUsages::UNIFORM,
    );
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: None,
        entries: &(0..4)
            .map(|i| wgpu::BindGroupLayoutEntry {
                binding: i,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: if i == 3 {
                        wgpu::BufferBindingType::Uniform
                    } else {
                        wgpu::BufferBindingType::Storage { read_only: i < 2 }
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect::<Vec<_>>(),
    });
    let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: None,
        bind_group_layouts: &[Some(&layout)],
        immediate_size: 0,
    });
    let pipe = |entry: &str| {
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: None,
            layout: Some(&pl),
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        })
    };
    let (p1, pm) = (pipe("one"), pipe("many"));
    let bg = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &layout,
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: ab.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: bb.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 2,
                resource: cb.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 3,
                resource: ub.as_entire_binding(),
            },
        ],
    });
    let read = wgpu::util::DeviceExt::create_buffer_init(
        device,
        &wgpu::util::BufferInitDescriptor {
            label: None,
            contents: &[0u8; 1024],
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        },
    );
    let mut enc = device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&p1);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    enc.copy_buffer_to_buffer(&cb, 0, &read, 0, 1024);
    queue.submit([enc.finish()]);
    read.slice(..).map_async(wgpu::MapMode::Read, |_| {});
    device.poll(wgpu::PollType::wait_indefinitely()).ok();
    let got: Vec<f32> =
        bytemuck::cast_slice(&read.slice(..).get_mapped_range().expect("mapped")).to_vec();
    // row-major A [16][16] (stride 16, column-major load? both tried below)
    let mut err_rm = 0.0f64;
    let mut err_cm = 0.0f64;
    let mut scale = 0.0f64;
    for r in 0..16 {
        for col in 0..16 {
            let (mut rm, mut cm) = (c[r * 16 + col] as f64, c[col * 16 + r] as f64);
            for k in 0..16 {
                rm += a[r * 16 + k] * b[k * 16 + col];
                cm += a[k * 16 + r] * b[col * 16 + k];
            }
            err_rm = err_rm.max((got[r * 16 + col] as f64 - rm).abs());
            err_cm = err_cm.max((got[col * 16 + r] as f64 - cm).abs());
            scale = scale.max(rm.abs());
        }
    }
    println!("  f16 product: max |err| as row-major {err_rm:.3e}, as column-major {err_cm:.3e} (|C| max {scale:.3e}); got[0..4] {:?}", &got[..4]);
    // throughput: 1024 workgroups (one subgroup each) x reps x 4 products of 16x16x16
    for groups in [1024u32, 4096] {
        let t = Instant::now();
        let n = 5;
        for _ in 0..n {
            let mut enc = device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pm);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups(groups, 1, 1);
            }
            queue.submit([enc.finish()]);
            device.poll(wgpu::PollType::wait_indefinitely()).ok();
        }
        let s = t.elapsed().as_secs_f64() / n as f64;
        let flops = groups as f64 * reps as f64 * 4.0 * 2.0 * 4096.0;
        // host clock around submit and wait, so a lower bound on the products' rate
        println!("  many: {groups} subgroups x {reps} x 4 products: {:.3} ms, {:.1} TFLOP/s (host clock)", s * 1e3, flops / s / 1e12);
    }
}

/// f16 bits of a value exact in f16 (normal range; zero)
fn f16_bits(x: f64) -> u16 {
    if x == 0.0 {
        return 0;
    }
    let b = (x as f32).to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let man = (b >> 13) & 0x3ff;
    assert!(exp > 0 && exp < 31, "outside f16's normal range");
    sign | ((exp as u16) << 10) | man as u16
}
