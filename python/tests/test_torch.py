"""torch tensors on the CPU (bf16 and f32); skipped where torch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gdn  # noqa: E402
from helpers import C, D, H_K, H_V, N, Case, make_layer, rel  # noqa: E402
from test_cpu import check_against_reference  # noqa: E402


def to_torch(case, dtype=torch.float32, state_dtype=torch.float32, conv_dtype=torch.float32, device="cpu"):
    t = lambda x, dt: torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dt)  # noqa: E731
    i = lambda x: torch.from_numpy(x).to(device)  # noqa: E731
    return dict(
        qkv=t(case.qkv, dtype), a=t(case.a, dtype), b=t(case.b, dtype), z=t(case.z, dtype),
        state=t(case.state, state_dtype), conv=t(case.conv, conv_dtype), slots=i(case.slots), cu=i(case.cu),
        commit=i(case.commit), out=t(case.out, dtype),
    )


def run(layer, x, **kw):
    return gdn.step(layer, x["qkv"], x["a"], x["b"], x["z"], x["state"], x["conv"], x["slots"],
                    cu_seqlens=x["cu"], commit=x["commit"], out=x["out"], **kw)


def test_f32_torch_equals_numpy_bitwise():
    layer, _ = make_layer()
    npc, tc = Case(), Case()
    gdn.step(layer, *npc.args(), **npc.kwargs())
    x = to_torch(tc)
    run(layer, x)
    assert np.array_equal(x["out"].numpy(), npc.out)
    assert np.array_equal(x["state"].numpy(), npc.state)
    assert np.array_equal(x["conv"].numpy(), npc.conv)


def test_layer_from_torch_parameters_and_from_hf():
    layer_np, _ = make_layer()
    rng = np.random.default_rng(0)
    conv_w = (rng.standard_normal((C, 4)) * 0.5).astype(np.float32).reshape(C, 1, 4)
    dt = (rng.standard_normal(H_V) * 0.5).astype(np.float32)
    a_log = rng.uniform(-1, 1.5, H_V).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.from_numpy(norm_w).to(torch.bfloat16).float())
            self.variance_epsilon = 1e-6
            self.activation = "silu"

    class FakeHF(torch.nn.Module):  # the attributes Qwen3_5GatedDeltaNet has
        def __init__(self):
            super().__init__()
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = H_K, H_V, D, D
            self.conv_kernel_size = 4
            self.conv1d = torch.nn.Conv1d(C, C, 4, groups=C, bias=False, padding=3)
            with torch.no_grad():
                self.conv1d.weight.copy_(torch.from_numpy(conv_w))
            self.dt_bias = torch.nn.Parameter(torch.from_numpy(dt))
            self.A_log = torch.nn.Parameter(torch.from_numpy(a_log))
            self.norm = Norm()

    m = FakeHF()
    layer = gdn.Layer.from_hf(m)
    assert isinstance(layer, gdn.Layer) and layer.gate == "silu" and layer.head_map == "grouped"
    a, b = Case(), Case()
    gdn.step(layer_np, *a.args(), **a.kwargs())
    gdn.step(layer, *b.args(), **b.kwargs())
    assert rel(b.out, a.out) < 1e-2  # the norm weight went through bf16
    with pytest.raises(TypeError, match="module"):
        gdn.Layer.from_hf(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bf16_inputs_and_state_match_the_reference(state_dtype):
    layer, ref = make_layer()
    case = Case()
    # inputs rounded to bf16 first, so that the reference sees the values the step sees
    for k in ("qkv", "a", "b", "z", "state", "state_vm", "conv", "conv0"):
        setattr(case, k, torch.from_numpy(getattr(case, k)).to(torch.bfloat16).float().numpy())
    s0, c0 = case.state.copy(), case.conv.copy()
    x = to_torch(case, torch.bfloat16, state_dtype, torch.bfloat16)
    run(layer, x)
    case.out = x["out"].float().numpy()
    case.state = x["state"].float().numpy()
    case.conv = x["conv"].float().numpy()
    check_against_reference(case, ref, s0, c0, tol=2e-2)


def test_new_out_is_bf16_like_qkv():
    layer, _ = make_layer()
    x = to_torch(Case(), torch.bfloat16)
    x["out"] = None
    y = run(layer, x)
    assert y.dtype == torch.bfloat16 and y.shape == (10, N) and torch.all(y[9] == 0)


def test_torch_bad_inputs_name_the_argument():
    layer, _ = make_layer()
    for name, change, exc in [
        ("qkv", lambda x: x["qkv"].double(), TypeError),
        ("state", lambda x: x["state"].half(), TypeError),
        ("slots", lambda x: x["slots"].long(), TypeError),
        ("z", lambda x: x["z"].t().contiguous().t(), ValueError),
        ("state", lambda x: x["state"].transpose(2, 3), ValueError),
        ("conv", lambda x: x["conv"][:1].expand(6, C, 4), ValueError),
        ("state", lambda x: torch.empty_like(x["state"], device="meta"), ValueError),
    ]:
        x = to_torch(Case())
        orig = [x[k] for k in ("state", "conv", "out")]
        before = [v.clone() for v in orig]
        x[name] = change(x)
        with pytest.raises(exc) as e:
            run(layer, x)
        arg = {"conv": "conv_state"}.get(name, name)
        assert str(e.value).startswith(arg), str(e.value)
        for now, v in zip(orig, before):
            assert torch.equal(now, v)
