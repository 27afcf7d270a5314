"""The CPU backend on numpy float32 arrays against the float64 numpy reference: values, in-place semantics."""

import numpy as np
import pytest

import gdn
from helpers import C, D, H_K, H_V, N, Case, make_layer, rel
from reference import value_major


def check_against_reference(case, ref, before_state, before_conv, tol=1e-5):
    y_rows, after = case.reference(ref)
    for r in range(case.out.shape[0]):
        if r in y_rows:
            assert rel(case.out[r], y_rows[r]) < tol, f"row {r}"
        else:
            assert np.all(case.out[r] == 7.0), f"row {r} is no running sequence's and was written"
    state_vm = case.state if case.layout == "value_major" else value_major(case.state)
    for slot in range(case.state.shape[0]):
        if slot in after:
            s, h = after[slot]
            assert rel(state_vm[slot], s) < tol, f"state slot {slot}"
            assert rel(case.conv[slot][:, -3:], h) < tol, f"conv slot {slot}"
            # the columns before the history are neither read nor written
            assert np.array_equal(case.conv[slot][:, :-3], before_conv[slot][:, :-3])
        else:
            assert np.array_equal(case.state[slot], before_state[slot]), f"slot {slot} changed"
            assert np.array_equal(case.conv[slot], before_conv[slot]), f"conv slot {slot} changed"


@pytest.mark.parametrize("layout", ["value_major", "key_major"])
@pytest.mark.parametrize("head_map", ["grouped", "tiled"])
def test_mixed_step_matches_the_reference(layout, head_map):
    layer, ref = make_layer(head_map=head_map)
    case = Case(layout=layout)
    s0, c0 = case.state.copy(), case.conv.copy()
    got = gdn.step(layer, *case.args(), **case.kwargs())
    assert got is case.out
    check_against_reference(case, ref, s0, c0)


def test_sigmoid_gate_and_a_2d_conv_weight():
    layer, ref = make_layer(gate="sigmoid", conv_shape=(C, 4))
    case = Case()
    s0, c0 = case.state.copy(), case.conv.copy()
    gdn.step(layer, *case.args(), **case.kwargs())
    check_against_reference(case, ref, s0, c0)


def test_lengths_give_the_same_bits_as_cu_seqlens():
    layer, _ = make_layer()
    a, b = Case(), Case()
    gdn.step(layer, *a.args(), **a.kwargs())
    kw = b.kwargs()
    del kw["cu_seqlens"]
    gdn.step(layer, *b.args(), lengths=np.diff(b.cu).astype(np.int32), **kw)
    assert np.array_equal(a.out, b.out) and np.array_equal(a.state, b.state) and np.array_equal(a.conv, b.conv)


def test_decode_without_offsets_and_out_allocated():
    layer, ref = make_layer()
    case = Case()
    slots = np.array([4, 2], np.int32)
    out = gdn.step(layer, case.qkv[:2], case.a[:2], case.b[:2], case.z[:2], case.state, case.conv, slots)
    assert out.shape == (2, N) and out.dtype == np.float32
    for i, slot in enumerate(slots):
        y, st = ref.window(case.state_vm[slot].astype(np.float64), Case().conv[slot][:, -3:].astype(np.float64),
                           case.qkv[i : i + 1].astype(np.float64), case.a[i : i + 1].astype(np.float64),
                           case.b[i : i + 1].astype(np.float64), case.z[i : i + 1].astype(np.float64))
        assert rel(out[i], y[0]) < 1e-5
        assert rel(case.state[slot], st[0][0]) < 1e-5


def test_verify_writes_nothing_but_out():
    layer, _ = make_layer()
    case = Case()
    case.commit[:] = 0
    s0, c0 = case.state.copy(), case.conv.copy()
    gdn.step(layer, *case.args(), **case.kwargs())
    assert np.array_equal(case.state, s0) and np.array_equal(case.conv, c0)
    assert not np.all(case.out[:8] == 7.0)


def test_commit_first_k_equals_a_k_token_commit_bitwise():
    layer, _ = make_layer()
    long, short = Case(), Case()
    one = np.array([2], np.int32)
    gdn.step(layer, long.qkv[:5], long.a[:5], long.b[:5], long.z[:5], long.state, long.conv, one,
             lengths=np.array([5], np.int32), commit=np.array([3], np.int32))
    gdn.step(layer, short.qkv[:3], short.a[:3], short.b[:3], short.z[:3], short.state, short.conv, one,
             lengths=np.array([3], np.int32))
    assert np.array_equal(long.state, short.state) and np.array_equal(long.conv, short.conv)


def test_a_sequence_alone_equals_it_in_a_mixed_call_bitwise():
    layer, _ = make_layer()
    mixed, alone = Case(), Case()
    gdn.step(layer, *mixed.args(), **mixed.kwargs())
    r = slice(5, 8)
    out = gdn.step(layer, alone.qkv[r], alone.a[r], alone.b[r], alone.z[r], alone.state, alone.conv,
                   np.array([0], np.int32), commit=np.array([2], np.int32), lengths=np.array([3], np.int32))
    assert np.array_equal(out, mixed.out[r]) and np.array_equal(alone.state[0], mixed.state[0])


def test_strided_rows_vllm_conv_view_and_strided_out():
    """Rows as column slices of one fused projection, the conv state as vLLM's transposed view
    ([slot][w][C] in memory, seen as [slot][C][w]), the output as a slice of a wider buffer."""
    layer, ref = make_layer()
    base = Case()
    fused = np.concatenate([base.qkv, base.z, base.b, base.a], axis=1)  # one projection's output
    qkv, z = fused[:, :C], fused[:, C : C + N]
    b, a = fused[:, C + N : C + N + H_V], fused[:, C + N + H_V :]
    conv_mem = np.ascontiguousarray(np.transpose(base.conv, (0, 2, 1)))  # [slot][w][C]
    conv = np.transpose(conv_mem, (0, 2, 1))
    wide = np.full((base.out.shape[0], 2 * N), 7.0, np.float32)
    out = wide[:, N:]
    s0, c0 = base.state.copy(), base.conv.copy()
    gdn.step(layer, qkv, a, b, z, base.state, conv, base.slots, cu_seqlens=base.cu, commit=base.commit, out=out)
    assert np.all(wide[:, :N] == 7.0)
    base.out, base.conv = out, conv
    check_against_reference(base, ref, s0, c0)


def test_a_wider_conv_state_and_a_strided_state_pool():
    layer, ref = make_layer()
    base = Case(w=6)
    big = np.zeros((base.state.shape[0], 2) + base.state.shape[1:], np.float32)
    big[:, 0] = base.state
    base.state = big[:, 0]  # slot stride twice a slot
    s0, c0 = base.state.copy(), base.conv.copy()
    gdn.step(layer, *base.args(), **base.kwargs())
    check_against_reference(base, ref, s0, c0)
    assert np.all(big[:, 1] == 0)


def test_layer_properties_and_repr():
    layer, _ = make_layer()
    assert (layer.num_k_heads, layer.num_v_heads, layer.head_dim, layer.channels) == (H_K, H_V, D, C)
    assert layer.head_map == "grouped" and layer.gate == "silu"
    assert "gdn.Layer" in repr(layer)


def test_repeated_steps_reuse_the_scratch_pool():
    layer, _ = make_layer()
    a, b = Case(), Case()
    for _ in range(3):
        gdn.step(layer, *a.args(), **a.kwargs())
    for _ in range(3):
        gdn.step(layer, *b.args(), **b.kwargs())
    assert np.array_equal(a.state, b.state) and np.array_equal(a.out, b.out)


def test_chunk_scratch_calls_without_a_long_cuda_window():
    # no CUDA step may have run (then both are 0); either way a release leaves nothing held
    assert gdn.chunk_scratch_bytes() >= 0
    assert gdn.release_chunk_scratch() >= 0
    assert gdn.chunk_scratch_bytes() == 0
