"""The speculative step's test, written once for numpy (the CPU) and torch (CUDA): random steps of gdn.spec_step
against the two-pass flow through gdn.step (verify the window; next step commit its first k tokens, then verify
the next), bitwise, with commit_held, forks and resets the engine's way. `Arrays` makes the arrays of one kind."""

import numpy as np

import gdn
from helpers import C, H_V, N


class Arrays:
    """numpy (`torch=None`) or torch tensors on `device`: int32 vectors, f32 zeros, rows from numpy, copies,
    concatenation and bitwise equality."""

    def __init__(self, torch=None, device=None):
        self.torch, self.device = torch, device

    def ints(self, v):
        if self.torch is None:
            return np.array(v, np.int32)
        return self.torch.tensor(v, dtype=self.torch.int32, device=self.device)

    def zeros(self, shape):
        if self.torch is None:
            return np.zeros(shape, np.float32)
        return self.torch.zeros(shape, dtype=self.torch.float32, device=self.device)

    def rows(self, a, dtype=None):
        return a if self.torch is None else self.torch.from_numpy(a).to(self.device, dtype)

    def copy(self, t):
        return t.copy() if self.torch is None else t.clone()

    def cat(self, ts):
        return np.concatenate(ts) if self.torch is None else self.torch.cat(ts)

    def same(self, a, b):
        if self.torch is None:
            return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        return self.torch.equal(a, b)

    def buffers(self, layer, slots):
        return gdn.spec_buffers(layer, slots, "numpy" if self.torch is None else self.device)


class TwoPass:
    """The seed's flow on its own state and conv state: a held window's rows kept here, committed through
    gdn.step before the next window."""

    def __init__(self, xp, layer, state, conv, layout, slots):
        self.xp, self.layer, self.state, self.conv, self.layout, self.slots = xp, layer, state, conv, layout, slots
        self.held = {}  # slot -> (qkv, a, b, z) rows of the window it holds

    def commit(self, slots, accept):
        """Commits the first accept[i] rows of slot slots[i]'s held window; drops the windows."""
        xp = self.xp
        parts = [(s, k) for s, k in zip(slots, accept) if s in self.held and k > 0]
        if parts:
            cat = [xp.cat([self.held[s][i][:k] for s, k in parts]) for i in range(4)]
            cu = xp.ints([0] + [int(v) for v in np.cumsum([k for _, k in parts])])
            gdn.step(self.layer, *cat, self.state, self.conv, xp.ints([s for s, _ in parts]), cu_seqlens=cu,
                     state_layout=self.layout)
        for s in slots:
            self.held.pop(s, None)

    def step(self, x, slots, cu, commit, accept):
        xp = self.xp
        self.commit([s for s in slots if s >= 0], [a for s, a in zip(slots, accept) if s >= 0])
        out = xp.zeros((x[0].shape[0], N))
        gdn.step(self.layer, *x, self.state, self.conv, xp.ints(slots), cu_seqlens=xp.ints(cu),
                 commit=xp.ints(commit), out=out, state_layout=self.layout)
        for i, s in enumerate(slots):
            if s >= 0 and commit[i] == 0:
                self.held[s] = tuple(xp.copy(t[cu[i]:cu[i + 1]]) for t in x)
        return out

    def lens(self):
        return [self.held[s][0].shape[0] if s in self.held else 0 for s in range(self.slots)]


def random_steps(xp, layer, st, cv, layout, rng, io_dtype=None, steps=60, validate=lambda step: False):
    """`steps` random speculative steps of up to four sequences on `st`, `cv` (their slot count) through
    gdn.spec_step and through the two-pass flow, compared bitwise after each; returns the tokens accepted."""
    slots_n = st.shape[0]
    one = (xp.copy(st), xp.copy(cv))
    pending, held = xp.buffers(layer, slots_n)
    two = TwoPass(xp, layer, xp.copy(st), xp.copy(cv), layout, slots_n)
    accepted = 0
    for step in range(steps):
        n = int(rng.integers(1, 5))
        slots = [int(s) for s in rng.permutation(slots_n)[:n]]
        if n > 1 and rng.integers(0, 5) == 0:
            slots[1] = -1
        lens = [int(rng.integers(1, 7)) for _ in slots]
        commit = [0 if rng.random() < 0.6 else int(rng.integers(1, ln + 1)) for ln in lens]
        hl = two.lens()
        accept = [0 if s < 0 else int(rng.integers(0, hl[s] + 1)) for s in slots]
        accepted += sum(accept)
        cu = [0] + [int(v) for v in np.cumsum(lens)]
        x = tuple(xp.rows(rng.standard_normal((cu[-1], w)).astype(np.float32), io_dtype) for w in (C, H_V, H_V, N))
        out_two = two.step(x, slots, cu, commit, accept)
        out_one = xp.zeros(tuple(out_two.shape))
        gdn.spec_step(layer, *x, one[0], one[1], xp.ints(slots), pending, held, xp.ints(accept),
                      cu_seqlens=xp.ints(cu), commit=xp.ints(commit), out=out_one, state_layout=layout,
                      validate=validate(step))
        assert xp.same(out_one, out_two), f"step {step}: outputs differ"
        assert [int(v) & 0xFF for v in held] == two.lens(), f"step {step}: held lengths"
        op = int(rng.integers(0, 12))
        if op == 0:
            # commit what every holding slot holds
            hs = [s for s in range(slots_n) if two.lens()[s] > 0]
            if hs:
                ks = [int(rng.integers(0, two.lens()[s] + 1)) for s in hs]
                two.commit(hs, ks)
                gdn.commit_held(layer, one[0], one[1], xp.ints(hs), pending, held, xp.ints(ks), state_layout=layout)
        elif op == 1:
            a, b = (int(v) for v in rng.permutation(slots_n)[:2])
            for t in (one[0], one[1], pending, held, two.state, two.conv):
                t[b] = t[a]
            if a in two.held:
                two.held[b] = two.held[a]
            else:
                two.held.pop(b, None)
        elif op == 2:
            a = int(rng.integers(0, slots_n))
            for t in (one[0], one[1], held, two.state, two.conv):
                t[a] = 0
            two.held.pop(a, None)
        assert xp.same(one[0], two.state), f"step {step}: states differ"
        assert xp.same(one[1], two.conv), f"step {step}: conv states differ"
    return accepted
