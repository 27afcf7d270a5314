// A memory-copy kernel for the copy ceiling: vec4 loads and stores, grid-stride over the buffer.

@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;

@compute @workgroup_size(256)
fn copy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = arrayLength(&src);
    let stride = nwg.x * 256u;
    for (var i = gid.x; i < n; i += stride) {
        dst[i] = src[i];
    }
}
