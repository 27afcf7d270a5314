"""A small random layer and step for the tests, in numpy float32 (the torch tests convert)."""

import numpy as np

import gdn
from reference import Ref, key_major

D, H_K, H_V = 16, 2, 4
C = (2 * H_K + H_V) * D
N = H_V * D


def make_layer(seed=0, head_map="grouped", gate="silu", conv_shape=(C, 1, 4)):
    rng = np.random.default_rng(seed)
    conv_w = (rng.standard_normal((C, 4)) * 0.5).astype(np.float32).reshape(conv_shape)
    dt = (rng.standard_normal(H_V) * 0.5).astype(np.float32)
    a_log = rng.uniform(-1, 1.5, H_V).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    layer = gdn.Layer(conv_w, dt, a_log, norm_w, num_k_heads=H_K, num_v_heads=H_V, head_dim=D,
                      head_map=head_map, gate=gate)
    ref = Ref(conv_w, dt, a_log, norm_w, H_K, H_V, D, head_map=head_map, gate=gate)
    return layer, ref


class Case:
    """Rows, a pool of `slots` slots (value-major f32 state, [slots][C][w] conv state), sequences."""

    def __init__(self, seed=1, rows=10, slots=6, w=4, layout="value_major"):
        rng = np.random.default_rng(seed)
        self.qkv = rng.standard_normal((rows, C)).astype(np.float32)
        self.a = rng.standard_normal((rows, H_V)).astype(np.float32)
        self.b = rng.standard_normal((rows, H_V)).astype(np.float32)
        self.z = rng.standard_normal((rows, N)).astype(np.float32)
        self.state_vm = (0.3 * rng.standard_normal((slots, H_V, D, D))).astype(np.float32)
        self.layout = layout
        self.state = self.state_vm.copy() if layout == "value_major" else key_major(self.state_vm)
        self.conv = rng.standard_normal((slots, C, w)).astype(np.float32)
        self.conv0 = self.conv.copy()  # the reference starts from these (the step updates `conv` in place)
        # decode on slot 3; a 4-token verify on slot 1; 3 tokens keeping 2 on slot 0; a skipped row 8; row 9 unused
        self.slots = np.array([3, 1, 0, -1], np.int32)
        assert rows >= 10
        self.cu = np.array([0, 1, 5, 8, 10 - 1], np.int32)
        self.commit = np.array([1, 0, 2, 1], np.int32)
        self.out = np.full((rows, N), 7.0, np.float32)

    def args(self):
        return (self.qkv, self.a, self.b, self.z, self.state, self.conv, self.slots)

    def kwargs(self):
        return dict(cu_seqlens=self.cu, commit=self.commit, out=self.out, state_layout=self.layout)

    def reference(self, ref):
        """Expected out rows (dict row -> y), and per slot the expected (S value-major, H) after the step."""
        y_rows, slots_after = {}, {}
        state0 = self.state_vm.astype(np.float64)
        conv0 = self.conv0.astype(np.float64)
        for s in range(len(self.slots)):
            slot, r0, r1, k = int(self.slots[s]), int(self.cu[s]), int(self.cu[s + 1]), int(self.commit[s])
            if slot < 0:
                continue
            y, states = ref.window(state0[slot], conv0[slot][:, -3:], self.qkv[r0:r1].astype(np.float64),
                                   self.a[r0:r1].astype(np.float64), self.b[r0:r1].astype(np.float64),
                                   self.z[r0:r1].astype(np.float64))
            for t in range(r1 - r0):
                y_rows[r0 + t] = y[t]
            if k > 0:
                slots_after[slot] = states[k - 1]
        return y_rows, slots_after


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return np.linalg.norm(x - ref) / (den if den > 0 else 1.0)
