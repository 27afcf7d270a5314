"""gdn.spec_step (the one-pass speculative step on torch CUDA tensors) against the two-pass flow through
gdn.step (verify the window; next step commit its first k tokens, then verify the next), bitwise: outputs, states,
conv states and held lengths over random steps, with commit_held, forks and resets the engine's way; bad input.
Skipped without torch or a GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import gdn  # noqa: E402
from helpers import C, H_V, N, make_layer  # noqa: E402

DEV = "cuda:0"
SLOTS = 6


class TwoPass:
    """The seed's flow on its own state and conv state: a held window's rows kept here, committed through
    gdn.step before the next window."""

    def __init__(self, layer, state, conv, layout):
        self.layer, self.state, self.conv, self.layout = layer, state, conv, layout
        self.held = {}  # slot -> (qkv, a, b, z) rows of the window it holds

    def commit(self, slots, accept):
        """Commits the first accept[i] rows of slot slots[i]'s held window; drops the windows."""
        parts = [(s, k) for s, k in zip(slots, accept) if s in self.held and k > 0]
        if parts:
            rows = [self.held[s] for s, _ in parts]
            cat = [torch.cat([r[i][:k] for r, (_, k) in zip(rows, parts)]) for i in range(4)]
            lens = [k for _, k in parts]
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=DEV)
            sl = torch.tensor([s for s, _ in parts], dtype=torch.int32, device=DEV)
            gdn.step(self.layer, *cat, self.state, self.conv, sl, cu_seqlens=cu, state_layout=self.layout)
        for s in slots:
            self.held.pop(s, None)

    def step(self, x, slots, cu, commit, accept):
        self.commit([s for s in slots if s >= 0], [a for s, a in zip(slots, accept) if s >= 0])
        out = torch.zeros((x[0].shape[0], N), dtype=torch.float32, device=DEV)
        gdn.step(self.layer, *x, self.state, self.conv, torch.tensor(slots, dtype=torch.int32, device=DEV),
                 cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV),
                 commit=torch.tensor(commit, dtype=torch.int32, device=DEV), out=out, state_layout=self.layout)
        for i, s in enumerate(slots):
            if s >= 0 and commit[i] == 0:
                self.held[s] = tuple(t[cu[i]:cu[i + 1]].clone() for t in x)
        return out

    def lens(self):
        return [self.held[s][0].shape[0] if s in self.held else 0 for s in range(SLOTS)]


def make_state(rng, layout, state_dtype, conv_dtype):
    d = 16
    shape = (SLOTS, H_V, d, d) if layout == "value_major" else (SLOTS, d, H_V, d)
    st = torch.from_numpy((0.3 * rng.standard_normal(shape)).astype(np.float32)).to(DEV, state_dtype)
    cv = torch.from_numpy(rng.standard_normal((SLOTS, C, 4)).astype(np.float32)).to(DEV, conv_dtype)
    return st, cv


@pytest.mark.parametrize("layout,state_dtype,io_dtype", [
    ("value_major", torch.float32, torch.float32),
    ("key_major", torch.float32, torch.float32),
    ("value_major", torch.bfloat16, torch.bfloat16),
])
def test_spec_step_is_bitwise_the_two_pass_flow(layout, state_dtype, io_dtype):
    layer, _ = make_layer()
    rng = np.random.default_rng(3)
    st, cv = make_state(rng, layout, state_dtype, io_dtype)
    one = (st.clone(), cv.clone())
    pending, held = gdn.spec_buffers(layer, SLOTS, DEV)
    two = TwoPass(layer, st.clone(), cv.clone(), layout)
    for step in range(60):
        n = int(rng.integers(1, 5))
        slots = [int(s) for s in rng.permutation(SLOTS)[:n]]
        if n > 1 and rng.integers(0, 5) == 0:
            slots[1] = -1
        lens = [int(rng.integers(1, 7)) for _ in slots]
        commit = [0 if rng.random() < 0.6 else int(rng.integers(1, ln + 1)) for ln in lens]
        hl = two.lens()
        accept = [0 if s < 0 else int(rng.integers(0, hl[s] + 1)) for s in slots]
        cu = [0] + list(np.cumsum(lens))
        r = cu[-1]
        x = tuple(torch.from_numpy(rng.standard_normal((r, w)).astype(np.float32)).to(DEV, io_dtype)
                  for w in (C, H_V, H_V, N))
        out_two = two.step(x, slots, cu, commit, accept)
        out_one = torch.zeros_like(out_two)
        gdn.spec_step(layer, *x, one[0], one[1], torch.tensor(slots, dtype=torch.int32, device=DEV), pending, held,
                      torch.tensor(accept, dtype=torch.int32, device=DEV),
                      cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV),
                      commit=torch.tensor(commit, dtype=torch.int32, device=DEV), out=out_one, state_layout=layout,
                      validate=step % 2 == 0)
        assert torch.equal(out_one, out_two), f"step {step}: outputs differ"
        assert (held & 0xFF).tolist() == two.lens(), f"step {step}: held lengths"
        op = int(rng.integers(0, 12))
        if op == 0:
            # commit what every holding slot holds
            hs = [s for s in range(SLOTS) if two.lens()[s] > 0]
            if hs:
                ks = [int(rng.integers(0, two.lens()[s] + 1)) for s in hs]
                two.commit(hs, ks)
                gdn.commit_held(layer, one[0], one[1], torch.tensor(hs, dtype=torch.int32, device=DEV), pending,
                                held, torch.tensor(ks, dtype=torch.int32, device=DEV), state_layout=layout)
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
        assert torch.equal(one[0], two.state), f"step {step}: states differ"
        assert torch.equal(one[1], two.conv), f"step {step}: conv states differ"
    torch.cuda.synchronize()
    layer.check_faults()


def test_spec_step_bad_input():
    layer, _ = make_layer()
    rng = np.random.default_rng(4)
    st, cv = make_state(rng, "value_major", torch.float32, torch.float32)
    pending, held = gdn.spec_buffers(layer, SLOTS, DEV)
    x = [torch.from_numpy(rng.standard_normal((3, w)).astype(np.float32)).to(DEV) for w in (C, H_V, H_V, N)]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    cu, slots, commit = i32([0, 3]), i32([2]), i32([0])
    gdn.spec_step(layer, *x, st, cv, slots, pending, held, i32([0]), cu_seqlens=cu, commit=commit)
    assert (held & 0xFF).tolist() == [0, 0, 3, 0, 0, 0]
    before = [t.clone() for t in (st, cv, pending, held)]

    def unchanged():
        torch.cuda.synchronize()
        for t, b in zip((st, cv, pending, held), before):
            assert torch.equal(t, b)

    # an accepted count above what the slot holds: validate catches it on the host
    with pytest.raises(ValueError, match="^accept"):
        gdn.spec_step(layer, *x, st, cv, slots, pending, held, i32([4]), cu_seqlens=cu, commit=commit, validate=True)
    unchanged()
    # wrong shapes, dtypes, devices
    for kw, match in [
        (dict(pending=pending[:, :-4]), "^pending"),
        (dict(pending=pending.cpu()), "^pending"),
        (dict(held=held.float()), "^held"),
        (dict(held=held[:4]), "^held"),
        (dict(accept=i32([0, 0])), "^accept"),
    ]:
        args = dict(pending=pending, held=held, accept=i32([0]))
        args.update(kw)
        with pytest.raises((ValueError, TypeError), match=match):
            gdn.spec_step(layer, *x, st, cv, slots, args["pending"], args["held"], args["accept"], cu_seqlens=cu,
                          commit=commit)
        unchanged()
    # without validate the kernel skips the sequence and reports it
    gdn.spec_step(layer, *x, st, cv, slots, pending, held, i32([4]), cu_seqlens=cu, commit=commit)
    unchanged()
    with pytest.raises(ValueError):
        layer.check_faults()
    layer.check_faults()
    # a window held on the GPU cannot go on on the CPU (each device's pending rows are its own): an error, and
    # nothing of the CPU copies changes
    host = [t.cpu() for t in (st, cv, pending, held)]
    with pytest.raises(ValueError, match="pending"):
        gdn.spec_step(layer, *[t.cpu() for t in x], *host[:2], slots.cpu(), *host[2:], i32([0]).cpu(),
                      cu_seqlens=cu.cpu(), commit=commit.cpu())
    for t, b in zip(host, (st, cv, pending, held)):
        assert torch.equal(t, b.cpu())
