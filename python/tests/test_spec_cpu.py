"""gdn.spec_step on the CPU (numpy arrays: gdn's CPU pool's one-pass step, each slot staged with its held window
in its `pending` row) against the two-pass flow through gdn.step, bitwise (`spec_flow.random_steps`); bad input
changes nothing."""

import numpy as np
import pytest

import gdn
from helpers import C, D, H_V, N, make_layer
from spec_flow import Arrays, random_steps

SLOTS = 5


@pytest.mark.parametrize("layout", ["value_major", "key_major"])
def test_cpu_spec_step_is_bitwise_the_two_pass_flow(layout):
    layer, _ = make_layer()
    rng = np.random.default_rng(5)
    shape = (SLOTS, H_V, D, D) if layout == "value_major" else (SLOTS, D, H_V, D)
    st = (0.3 * rng.standard_normal(shape)).astype(np.float32)
    cv = rng.standard_normal((SLOTS, C, 4)).astype(np.float32)
    assert random_steps(Arrays(), layer, st, cv, layout, rng) > 20


def test_cpu_spec_step_bad_input_changes_nothing():
    layer, _ = make_layer()
    rng = np.random.default_rng(6)
    st = (0.3 * rng.standard_normal((SLOTS, H_V, D, D))).astype(np.float32)
    cv = rng.standard_normal((SLOTS, C, 4)).astype(np.float32)
    pending, held = gdn.spec_buffers(layer, SLOTS, "numpy")
    x = [rng.standard_normal((3, w)).astype(np.float32) for w in (C, H_V, H_V, N)]
    i32 = lambda v: np.array(v, np.int32)  # noqa: E731
    cu, slots, commit = i32([0, 3]), i32([2]), i32([0])
    gdn.spec_step(layer, *x, st, cv, slots, pending, held, i32([0]), cu_seqlens=cu, commit=commit)
    assert (held & 0xFF).tolist() == [0, 0, 3, 0, 0]
    before = [t.copy() for t in (st, cv, pending, held)]

    def unchanged():
        for t, b in zip((st, cv, pending, held), before):
            assert np.array_equal(t.view(np.uint8), b.view(np.uint8))

    # an accepted count above what the slot holds
    with pytest.raises(ValueError, match="^accept"):
        gdn.spec_step(layer, *x, st, cv, slots, pending, held, i32([4]), cu_seqlens=cu, commit=commit)
    unchanged()
    # a held word whose pending row does not hold that window
    held2 = held.copy()
    held2[2] = 2
    with pytest.raises(ValueError, match="pending"):
        gdn.spec_step(layer, *x, st, cv, slots, pending, held2, i32([1]), cu_seqlens=cu, commit=commit)
    unchanged()
    # wrong shapes and dtypes
    for kw, match in [
        (dict(pending=pending[:, :-4]), "^pending"),
        (dict(held=held.astype(np.float32)), "^held"),
        (dict(held=held[:4]), "^held"),
        (dict(accept=i32([0, 0])), "^accept"),
    ]:
        args = dict(pending=pending, held=held, accept=i32([0]))
        args.update(kw)
        with pytest.raises((ValueError, TypeError), match=match):
            gdn.spec_step(layer, *x, st, cv, slots, args["pending"], args["held"], args["accept"], cu_seqlens=cu,
                          commit=commit)
        unchanged()
    # committing what is held, then holding nothing
    gdn.commit_held(layer, st, cv, slots, pending, held, i32([2]))
    assert (held & 0xFF).tolist() == [0] * SLOTS
