"""Bad input for every argument: the named exception, and nothing touched."""

import numpy as np
import pytest

import gdn
from helpers import C, N, Case, make_layer

LAYER, _ = make_layer()


def call(mutate, validate=False):
    """Runs a step of a fresh case after `mutate(args)`; returns the case and the exception."""
    case = Case()
    args = dict(zip(["qkv", "a", "b", "z", "state", "conv_state", "slots"], case.args()))
    args.update(case.kwargs())
    mutate(args)
    snapshot = [np.array(v, copy=True) for v in (case.state, case.conv, case.out)]
    with pytest.raises((TypeError, ValueError)) as e:
        gdn.step(LAYER, args.pop("qkv"), args.pop("a"), args.pop("b"), args.pop("z"), args.pop("state"),
                 args.pop("conv_state"), args.pop("slots"), validate=validate, **args)
    for before, now in zip(snapshot, (case.state, case.conv, case.out)):
        assert np.array_equal(before, now), "a tensor was touched by a step that failed"
    return e


def setter(name, value):
    def f(args):
        args[name] = value(args[name]) if callable(value) else value
    return f


def wider(x, extra=1):
    """The same values with one more column, as a view of the first ones is not needed: a wrong width."""
    return np.concatenate([x, x[:, :extra]], axis=1)


def noncontig_last(x):
    """The same shape, the last dimension strided (every second element of a buffer twice as wide)."""
    buf = np.repeat(x, 2, axis=-1)
    return buf[..., ::2]


def readonly(x):
    y = x.copy()
    y.flags.writeable = False
    return y


def shares_memory_of_qkv(args):
    # out as a view into qkv's buffer
    args["out"] = args["qkv"][:, :N]


CASES = [
    # (argument named, exception, mutation)
    ("qkv", TypeError, setter("qkv", lambda x: x.astype(np.float64))),
    ("qkv", TypeError, setter("qkv", lambda x: x.tolist())),
    ("a", TypeError, setter("a", lambda x: x.astype(np.int32))),
    ("b", TypeError, setter("b", lambda x: x.astype(np.float64))),
    ("z", TypeError, setter("z", lambda x: x.astype(np.int64))),
    ("state", TypeError, setter("state", lambda x: x.astype(np.float16))),
    ("conv_state", TypeError, setter("conv_state", lambda x: x.astype(np.float64))),
    ("slots", TypeError, setter("slots", lambda x: x.astype(np.int64))),
    ("cu_seqlens", TypeError, setter("cu_seqlens", lambda x: x.astype(np.int64))),
    ("commit", TypeError, setter("commit", lambda x: x.astype(np.float32))),
    ("out", TypeError, setter("out", lambda x: x.astype(np.float64))),
    ("qkv", ValueError, setter("qkv", wider)),
    ("qkv", ValueError, setter("qkv", lambda x: x[None])),
    ("a", ValueError, setter("a", lambda x: x[:-1])),
    ("b", ValueError, setter("b", wider)),
    ("z", ValueError, setter("z", lambda x: x[:, :-1])),
    ("state", ValueError, setter("state", lambda x: np.ascontiguousarray(x[:, :, :, :-1]))),
    ("state", ValueError, setter("state", lambda x: x[0])),
    ("conv_state", ValueError, setter("conv_state", lambda x: np.ascontiguousarray(x[:, :, :2]))),
    ("conv_state", ValueError, setter("conv_state", lambda x: x[:-1])),
    ("conv_state", ValueError, setter("conv_state", lambda x: x[:, :-1])),
    ("slots", ValueError, setter("slots", lambda x: x[None])),
    ("cu_seqlens", ValueError, setter("cu_seqlens", lambda x: x[:-1])),
    ("commit", ValueError, setter("commit", lambda x: x[:-1])),
    ("out", ValueError, setter("out", lambda x: x[:-1])),
    # strides: no silent copies
    ("qkv", ValueError, setter("qkv", noncontig_last)),
    ("qkv", ValueError, setter("qkv", lambda x: x[::-1])),
    ("z", ValueError, setter("z", noncontig_last)),
    ("a", ValueError, setter("a", noncontig_last)),
    ("state", ValueError, setter("state", lambda x: np.swapaxes(x, 2, 3))),
    ("slots", ValueError, setter("slots", lambda x: np.repeat(x, 2)[::2])),
    ("cu_seqlens", ValueError, setter("cu_seqlens", lambda x: np.repeat(x, 2)[::2])),
    ("out", ValueError, setter("out", noncontig_last)),
    # memory the step writes
    ("out", ValueError, setter("out", readonly)),
    ("state", ValueError, setter("state", readonly)),
    ("conv_state", ValueError, setter("conv_state", lambda x: np.broadcast_to(x[:1], x.shape))),
    ("conv_state", ValueError, setter("conv_state", lambda x: np.lib.stride_tricks.as_strided(
        x, x.shape, (x.strides[0], 4, 4)))),
    ("out", ValueError, shares_memory_of_qkv),
    # values of the index tensors
    ("slots", ValueError, setter("slots", np.array([3, 6, 0, -1], np.int32))),
    ("slots", ValueError, setter("slots", np.array([3, 1, 3, -1], np.int32))),
    ("commit", ValueError, setter("commit", np.array([1, 0, 4, 1], np.int32))),
    ("commit", ValueError, setter("commit", np.array([1, -1, 2, 1], np.int32))),
    ("cu_seqlens", ValueError, setter("cu_seqlens", np.array([0, 1, 5, 4, 9], np.int32))),
    ("cu_seqlens", ValueError, setter("cu_seqlens", np.array([0, 1, 5, 8, 11], np.int32))),
    ("state_layout", ValueError, setter("state_layout", "row_major")),
]


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("name,exc,mutate", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_argument_raises_naming_it(name, exc, mutate, validate):
    e = call(mutate, validate)
    assert e.type is exc, f"{e.type.__name__}: {e.value}"
    assert str(e.value).startswith(name), str(e.value)


def test_lengths_bad_values():
    def no_cu(v):
        def f(args):
            del args["cu_seqlens"]
            args["lengths"] = np.array(v, np.int32)
        return f
    for v in ([1, 4, 0, 1], [1, 4, 3, 3], [1, 4, 3]):
        e = call(no_cu(v))
        assert str(e.value).startswith("lengths"), str(e.value)


def test_both_offsets_and_lengths():
    def f(args):
        args["lengths"] = np.diff(args["cu_seqlens"]).astype(np.int32)
    e = call(f)
    assert e.type is TypeError and "lengths" in str(e.value)


def test_decode_needs_a_row_per_sequence():
    def f(args):
        del args["cu_seqlens"]
        del args["commit"]
        args["slots"] = np.arange(11, dtype=np.int32) % 6
    e = call(f)
    assert "qkv" in str(e.value) or "slots" in str(e.value)


def test_not_a_layer():
    case = Case()
    with pytest.raises(TypeError, match="layer"):
        gdn.step(object(), *case.args(), **case.kwargs())


@pytest.mark.parametrize("which,shape", [("conv_weight", (C, 3)), ("dt_bias", (5,)), ("A_log", (4, 1)),
                                         ("norm_weight", (17,))])
def test_layer_bad_shapes(which, shape):
    args = dict(conv_weight=np.zeros((C, 1, 4), np.float32), dt_bias=np.zeros(4, np.float32),
                A_log=np.zeros(4, np.float32), norm_weight=np.ones(16, np.float32))
    args[which] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=which):
        gdn.Layer(args["conv_weight"], args["dt_bias"], args["A_log"], args["norm_weight"], num_k_heads=2,
                  num_v_heads=4, head_dim=16)


def test_layer_bad_config():
    w, v, d = np.zeros((C, 4), np.float32), np.zeros(4, np.float32), np.ones(16, np.float32)
    with pytest.raises(ValueError, match="head_map"):
        gdn.Layer(w, v, v, d, num_k_heads=2, num_v_heads=4, head_dim=16, head_map="diagonal")
    with pytest.raises(ValueError, match="gate"):
        gdn.Layer(w, v, v, d, num_k_heads=2, num_v_heads=4, head_dim=16, gate="relu")
    with pytest.raises(ValueError):
        gdn.Layer(w, v, v, d, num_k_heads=3, num_v_heads=4, head_dim=16)
    with pytest.raises(TypeError, match="dt_bias"):
        gdn.Layer(w, "x", v, d, num_k_heads=2, num_v_heads=4, head_dim=16)
