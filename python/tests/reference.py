"""A float64 numpy reference of the window step (docs/SPEC.md), on value-major or key-major state pools and
HF-layout conv states, for the tests."""

import numpy as np


def softplus(u):
    return np.where(u > 20, u, np.log1p(np.exp(np.minimum(u, 20))))


class Ref:
    """The layer's parameters in float64, as the tests made them."""

    def __init__(self, conv_w, dt_bias, a_log, norm_w, h_k, h_v, d, head_map="grouped", gate="silu", eps=1e-6):
        self.w = np.asarray(conv_w, np.float64).reshape(-1, 4)
        self.dt = np.asarray(dt_bias, np.float64)
        # the layer computes a = -exp(A_log) in f32
        self.a = -np.exp(np.asarray(a_log, np.float32)).astype(np.float64)
        self.gamma = np.asarray(norm_w, np.float64)
        self.h_k, self.h_v, self.d = h_k, h_v, d
        self.head_map, self.gate, self.eps = head_map, gate, eps

    def g(self, h):
        return h // (self.h_v // self.h_k) if self.head_map == "grouped" else h % self.h_k

    def window(self, S, H, qkv, alpha, beta, z):
        """One sequence's window: S [h_v][v][k] (value-major, float64), H [C][3] (oldest first), rows [T][.].
        Returns y [T][n] and the S, H after each token (lists)."""
        d, h_k, h_v = self.d, self.h_k, self.h_v
        S, H = S.copy(), H.copy()
        ys, states = [], []
        for t in range(qkv.shape[0]):
            x = np.concatenate([H, qkv[t][:, None]], axis=1)  # [C][4]
            s = (x * self.w).sum(axis=1)
            cv = s / (1 + np.exp(-s))
            H = x[:, 1:]
            q = cv[: h_k * d].reshape(h_k, d)
            k = cv[h_k * d : 2 * h_k * d].reshape(h_k, d)
            v = cv[2 * h_k * d :].reshape(h_v, d)
            q = q / np.sqrt((q * q).sum(axis=1, keepdims=True) + self.eps)
            k = k / np.sqrt((k * k).sum(axis=1, keepdims=True) + self.eps)
            y = np.zeros((h_v, d))
            for h in range(h_v):
                gh = self.g(h)
                gate = np.exp(softplus(alpha[t, h] + self.dt[h]) * self.a[h])
                b = 1 / (1 + np.exp(-beta[t, h]))
                kv = S[h] @ k[gh]  # [v]
                delta = (v[h] - gate * kv) * b
                S[h] = gate * S[h] + np.outer(delta, k[gh])
                o = (S[h] @ q[gh]) / np.sqrt(d)
                rs = 1 / np.sqrt((o * o).mean() + self.eps)
                zz = z[t, h * d : (h + 1) * d]
                act = zz / (1 + np.exp(-zz)) if self.gate == "silu" else 1 / (1 + np.exp(-zz))
                y[h] = rs * o * self.gamma * act
            ys.append(y.reshape(-1))
            states.append((S.copy(), H.copy()))
        return np.array(ys), states


def key_major(s_vm):
    """A value-major state [slots][h][v][k] as key-major [slots][k][h][v]."""
    return np.ascontiguousarray(np.transpose(s_vm, (0, 3, 1, 2)))


def value_major(s_km):
    return np.ascontiguousarray(np.transpose(s_km, (0, 2, 3, 1)))
