"""Tensor-parallel shards (Layer.shard): the shards' steps side by side equal the unsharded step."""

import numpy as np
import pytest

import gdn
from helpers import Case, H_K, make_layer


@pytest.mark.parametrize("head_map", ["grouped", "tiled"])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", ["value_major", "key_major"])
def test_shards_side_by_side_equal_the_whole(head_map, world, layout):
    layer, _ = make_layer(head_map=head_map)
    whole = Case(layout=layout)
    gdn.step(layer, *whole.args(), **whole.kwargs())
    full = Case(layout=layout)  # the same inputs, untouched
    out = full.out.copy()
    state, conv = full.state.copy(), full.conv.copy()
    heads_axis = 1 if layout == "value_major" else 2
    for rank in range(world):
        s = layer.shard(rank, world)
        m = s.shard_map
        assert s.num_k_heads == H_K // world and m["key_heads"] == list(range(rank * s.num_k_heads,
                                                                              (rank + 1) * s.num_k_heads))
        vh, ch, cols = m["value_heads"], m["channels"], m["columns"]
        st = np.ascontiguousarray(np.take(full.state, vh, axis=heads_axis))
        cv = np.ascontiguousarray(full.conv[:, ch])
        y = np.full((full.out.shape[0], len(cols)), 7.0, np.float32)
        gdn.step(s, np.ascontiguousarray(full.qkv[:, ch]), np.ascontiguousarray(full.a[:, vh]),
                 np.ascontiguousarray(full.b[:, vh]), np.ascontiguousarray(full.z[:, cols]), st, cv, full.slots,
                 cu_seqlens=full.cu, commit=full.commit, out=y, state_layout=layout)
        out[:, cols] = y
        if layout == "value_major":
            state[:, vh] = st
        else:
            state[:, :, vh] = st
        conv[:, ch] = cv
    assert np.array_equal(out, whole.out)
    assert np.array_equal(state, whole.state)
    assert np.array_equal(conv, whole.conv)


def test_bad_shards():
    layer, _ = make_layer()
    assert layer.shard_map is None
    with pytest.raises(ValueError, match="world"):
        layer.shard(0, 3)
    with pytest.raises(ValueError, match="rank"):
        layer.shard(2, 2)
