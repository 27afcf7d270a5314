"""gdn.spec_step (the one-pass speculative step on torch CUDA tensors) against the two-pass flow through
gdn.step, bitwise (`spec_flow.random_steps`); bad input. Skipped without torch or a GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import gdn  # noqa: E402
from helpers import C, H_V, N, make_layer  # noqa: E402
from spec_flow import Arrays, random_steps  # noqa: E402

DEV = "cuda:0"
SLOTS = 6


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
    xp = Arrays(torch, DEV)
    assert random_steps(xp, layer, st, cv, layout, rng, io_dtype, validate=lambda step: step % 2 == 0) > 20
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
