"""torch CUDA tensors (gdn's CUDA path on torch's current stream); skipped without torch or a GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import gdn  # noqa: E402
from helpers import C, N, Case, make_layer, rel  # noqa: E402
from test_cpu import check_against_reference  # noqa: E402
from test_torch import run, to_torch  # noqa: E402

DEV = "cuda:0"


def back(x, case):
    case.out = x["out"].float().cpu().numpy()
    case.state = x["state"].float().cpu().numpy()
    case.conv = x["conv"].float().cpu().numpy()


@pytest.mark.parametrize("layout", ["value_major", "key_major"])
def test_f32_matches_the_reference(layout):
    layer, ref = make_layer()
    case = Case(layout=layout)
    s0, c0 = case.state.copy(), case.conv.copy()
    x = to_torch(case, device=DEV)
    run(layer, x, state_layout=layout)
    torch.cuda.synchronize()
    back(x, case)
    check_against_reference(case, ref, s0, c0, tol=1e-5)
    layer.check_faults()


def test_bf16_matches_the_cpu_path():
    layer, _ = make_layer()
    xc, xg = to_torch(Case(), torch.bfloat16, torch.bfloat16, torch.bfloat16), None
    xg = {k: v.to(DEV) for k, v in xc.items()}
    run(layer, xc)
    run(layer, xg)
    for k in ("out", "state", "conv"):
        assert rel(xg[k].float().cpu().numpy(), xc[k].float().numpy()) < 1e-2, k


def test_lengths_decode_and_vllm_conv_view():
    layer, ref = make_layer()
    case = Case()
    x = to_torch(case, device=DEV)
    # the conv state as vLLM keeps it: [slot][w][C] in memory, seen as [slot][C][w]
    conv_t = x["conv"].transpose(1, 2).contiguous().transpose(1, 2)
    lengths = torch.diff(x["cu"]).to(torch.int32)
    gdn.step(layer, x["qkv"], x["a"], x["b"], x["z"], x["state"], conv_t, x["slots"], lengths=lengths,
             commit=x["commit"], out=x["out"])
    y = Case()
    gdn.step(layer, *y.args(), **y.kwargs())
    assert rel(x["out"].cpu().numpy(), y.out) < 1e-5
    assert rel(conv_t.cpu().numpy(), y.conv) < 1e-5
    # decode: one row per sequence, no offsets
    d = Case()
    xd = to_torch(d, device=DEV)
    out = gdn.step(layer, xd["qkv"][:3], xd["a"][:3], xd["b"][:3], xd["z"][:3], xd["state"], xd["conv"],
                   torch.tensor([4, 2, 0], dtype=torch.int32, device=DEV))
    e = Case()
    want = gdn.step(layer, e.qkv[:3], e.a[:3], e.b[:3], e.z[:3], e.state, e.conv, np.array([4, 2, 0], np.int32))
    assert rel(out.cpu().numpy(), want) < 1e-5
    assert rel(xd["state"].cpu().numpy(), e.state) < 1e-5
    layer.check_faults()


def long_case():
    """Prefill-length windows beside short ones: 150 tokens committing all, a decode row, 130 committing after
    100, a 70-token verify, a skipped 80, a 65-token window committing after 10 (below the chunked path's 64:
    token-serial)."""
    case = Case(rows=500)
    case.slots = np.array([3, 1, 0, 5, -1, 2], np.int32)
    case.cu = np.cumsum([0, 150, 1, 130, 70, 80, 65]).astype(np.int32)
    case.commit = np.array([150, 1, 100, 0, 80, 10], np.int32)
    return case


def test_long_windows_match_the_reference():
    layer, ref = make_layer()
    for hint in (None, 8):
        case = long_case()
        s0, c0 = case.state.copy(), case.conv.copy()
        x = to_torch(case, device=DEV)
        # max_seqlen=8 is a wrong hint here: every window then runs token after token, still exact
        run(layer, x, max_seqlen=hint)
        torch.cuda.synchronize()
        back(x, case)
        check_against_reference(case, ref, s0, c0, tol=1e-5)
        layer.check_faults()
    # the first call's chunked scratch is kept until released
    held = gdn.chunk_scratch_bytes()
    assert held > 0
    assert gdn.release_chunk_scratch() == held
    assert gdn.chunk_scratch_bytes() == 0


def test_long_windows_in_bf16_match_the_cpu_path():
    layer, _ = make_layer()
    xc = to_torch(long_case(), torch.bfloat16, torch.bfloat16, torch.bfloat16)
    xg = {k: v.to(DEV) for k, v in xc.items()}
    run(layer, xc)
    run(layer, xg)
    for k in ("out", "state", "conv"):
        assert rel(xg[k].float().cpu().numpy(), xc[k].float().numpy()) < 1e-2, k


def test_graph_capture_and_replay():
    layer, _ = make_layer()
    case = Case()
    x = to_torch(case, device=DEV)
    eager = {k: v.clone() for k, v in x.items()}
    run(layer, eager)  # also compiles the specialisation before the capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            run(layer, x)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    for k in ("out", "state", "conv"):
        assert torch.equal(x[k], eager[k]), k


def test_cuda_bad_input():
    layer, _ = make_layer()
    x = to_torch(Case(), device=DEV)
    before = {k: x[k].clone() for k in ("state", "conv", "out")}
    for name, change in [("state", lambda x: x["state"].cpu()), ("slots", lambda x: x["slots"].cpu())]:
        y = dict(x)
        y[name] = change(x)
        with pytest.raises(ValueError) as e:
            run(layer, y)
        assert str(e.value).startswith(name), str(e.value)
    y = dict(x)
    y["slots"] = torch.tensor([3, 6, 0, -1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="^slots"):
        run(layer, y, validate=True)
    torch.cuda.synchronize()
    for k, v in before.items():
        assert torch.equal(x[k], v), k
    # without validate the kernel skips the bad sequence and reports it
    run(layer, y)
    with pytest.raises(ValueError):
        layer.check_faults()
    layer.check_faults()  # cleared
