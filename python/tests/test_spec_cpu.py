"""gdn.spec_step on the CPU (numpy arrays: gdn's CPU pool's one-pass step, each slot staged with its held window
in its `pending` row) against the two-pass flow through gdn.step (verify the window; next step commit its first k
tokens, then verify the next), bitwise: outputs, states, conv states and held lengths over random steps, with
commit_held, forks and resets the engine's way; bad input changes nothing."""

import numpy as np
import pytest

import gdn
from helpers import C, D, H_V, N, make_layer

SLOTS = 5


class TwoPass:
    """The seed's flow on its own state and conv state: a held window's rows kept here, committed through
    gdn.step before the next window."""

    def __init__(self, layer, state, conv, layout):
        self.layer, self.state, self.conv, self.layout = layer, state, conv, layout
        self.held = {}  # slot -> (qkv, a, b, z) rows of the window it holds

    def commit(self, slots, accept):
        parts = [(s, k) for s, k in zip(slots, accept) if s in self.held and k > 0]
        if parts:
            cat = [np.concatenate([self.held[s][i][:k] for s, k in parts]) for i in range(4)]
            cu = np.concatenate([[0], np.cumsum([k for _, k in parts])]).astype(np.int32)
            sl = np.array([s for s, _ in parts], np.int32)
            gdn.step(self.layer, *cat, self.state, self.conv, sl, cu_seqlens=cu, state_layout=self.layout)
        for s in slots:
            self.held.pop(s, None)

    def step(self, x, slots, cu, commit, accept):
        self.commit([s for s in slots if s >= 0], [a for s, a in zip(slots, accept) if s >= 0])
        out = np.zeros((x[0].shape[0], N), np.float32)
        gdn.step(self.layer, *x, self.state, self.conv, np.array(slots, np.int32), cu_seqlens=np.array(cu, np.int32),
                 commit=np.array(commit, np.int32), out=out, state_layout=self.layout)
        for i, s in enumerate(slots):
            if s >= 0 and commit[i] == 0:
                self.held[s] = tuple(t[cu[i]:cu[i + 1]].copy() for t in x)
        return out

    def lens(self):
        return [self.held[s][0].shape[0] if s in self.held else 0 for s in range(SLOTS)]


@pytest.mark.parametrize("layout", ["value_major", "key_major"])
def test_cpu_spec_step_is_bitwise_the_two_pass_flow(layout):
    layer, _ = make_layer()
    rng = np.random.default_rng(5)
    shape = (SLOTS, H_V, D, D) if layout == "value_major" else (SLOTS, D, H_V, D)
    st = (0.3 * rng.standard_normal(shape)).astype(np.float32)
    cv = rng.standard_normal((SLOTS, C, 4)).astype(np.float32)
    one = (st.copy(), cv.copy())
    pending, held = gdn.spec_buffers(layer, SLOTS, "numpy")
    two = TwoPass(layer, st.copy(), cv.copy(), layout)
    accepted = 0
    for step in range(60):
        n = int(rng.integers(1, 5))
        slots = [int(s) for s in rng.permutation(SLOTS)[:n]]
        if n > 1 and rng.integers(0, 5) == 0:
            slots[1] = -1
        lens = [int(rng.integers(1, 7)) for _ in slots]
        commit = [0 if rng.random() < 0.6 else int(rng.integers(1, ln + 1)) for ln in lens]
        hl = two.lens()
        accept = [0 if s < 0 else int(rng.integers(0, hl[s] + 1)) for s in slots]
        accepted += sum(accept)
        cu = [0] + [int(v) for v in np.cumsum(lens)]
        x = tuple(rng.standard_normal((cu[-1], w)).astype(np.float32) for w in (C, H_V, H_V, N))
        out_two = two.step(x, slots, cu, commit, accept)
        out_one = np.zeros_like(out_two)
        gdn.spec_step(layer, *x, one[0], one[1], np.array(slots, np.int32), pending, held, np.array(accept, np.int32),
                      cu_seqlens=np.array(cu, np.int32), commit=np.array(commit, np.int32), out=out_one,
                      state_layout=layout)
        assert np.array_equal(out_one.view(np.uint32), out_two.view(np.uint32)), f"step {step}: outputs differ"
        assert (held & 0xFF).tolist() == two.lens(), f"step {step}: held lengths"
        op = int(rng.integers(0, 12))
        if op == 0:
            hs = [s for s in range(SLOTS) if two.lens()[s] > 0]
            if hs:
                ks = [int(rng.integers(0, two.lens()[s] + 1)) for s in hs]
                two.commit(hs, ks)
                gdn.commit_held(layer, one[0], one[1], np.array(hs, np.int32), pending, held, np.array(ks, np.int32),
                                state_layout=layout)
        elif op == 1:
            a, b = (int(v) for v in rng.permutation(SLOTS)[:2])
            for t in (one[0], one[1], pending, held, two.state, two.conv):
                t[b] = t[a]
            if a in two.held:
                two.held[b] = two.held[a]
            else:
                two.held.pop(b, None)
        elif op == 2:
            a = int(rng.integers(0, SLOTS))
            for t in (one[0], one[1], held, two.state, two.conv):
                t[a] = 0
            two.held.pop(a, None)
        assert np.array_equal(one[0].view(np.uint32), two.state.view(np.uint32)), f"step {step}: states differ"
        assert np.array_equal(one[1].view(np.uint32), two.conv.view(np.uint32)), f"step {step}: conv states differ"
    assert accepted > 20


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
