"""gdn: the fused Gated DeltaNet window step on an engine's own tensors, in place.

``gdn.Layer`` holds one layer's weights (from the checkpoint's tensors or an HF module); ``gdn.step`` advances
sequences of packed rows on the caller's state pool and conv state (torch tensors on the CPU or a CUDA device,
or numpy arrays). See ``help(gdn.step)`` for every argument's shape and dtype. ``gdn.spec_step`` is the
speculative form (one state pass per step on CUDA, gdn's one-pass CPU step on host memory: the last window's
accepted tokens are committed as the next window runs; ``gdn.spec_buffers`` makes its two extra buffers,
``gdn.commit_held`` commits what a slot holds).
``gdn.hf.patch(model)`` runs an HF Qwen3.5 / Qwen3-Next model's GDN layers through gdn;
``gdn.vllm.gdn_attention_core`` takes the inputs of vLLM's GDN attention core. On CUDA long windows (prefill)
use a workspace kept between calls and shared by a device's layers: ``gdn.chunk_scratch_bytes()`` says how
large it is, ``gdn.release_chunk_scratch()`` frees it.

Conventions: HF transformers' and vLLM's (mixed q|k|v before the conv, raw a/b logits, conv state
``[slot][C][w]`` with the history in its last three columns, value-major state ``[slot][head][v][k]`` as vLLM,
SGLang and FlashInfer keep it), FLA's ``cu_seqlens``.
"""

from gdn._native import Layer, chunk_scratch_bytes, pending_row, release_chunk_scratch, spec_step, step

__all__ = ["Layer", "step", "spec_step", "spec_buffers", "commit_held", "pending_row", "release_chunk_scratch",
           "chunk_scratch_bytes", "hf", "vllm"]


def spec_buffers(layer, slots, device):
    """The speculative step's buffers for a pool of ``slots`` slots on ``device`` (a torch device, or
    ``"numpy"`` for numpy arrays), zeroed (nothing held): ``(pending, held)``, ``pending`` ``[slots,
    gdn.pending_row(layer)]`` float32 and ``held`` ``[slots]`` int32 (see ``gdn.spec_step``)."""
    if device == "numpy":
        import numpy as np

        return np.zeros((slots, pending_row(layer)), np.float32), np.zeros((slots,), np.int32)
    import torch

    pending = torch.zeros((slots, pending_row(layer)), dtype=torch.float32, device=device)
    held = torch.zeros((slots,), dtype=torch.int32, device=device)
    return pending, held


def commit_held(layer, state, conv_state, slots, pending, held, accept, *, state_layout="value_major",
                validate=False):
    """Commits the first ``accept[s]`` tokens of the window slot ``slots[s]`` holds (state and conv history) and
    drops the rest; the slot holds nothing after (a request's end; before reading or forking a slot). One
    ``gdn.spec_step`` of sequences with no rows; ``accept[s] == 0`` only drops the window. Arguments as
    ``gdn.spec_step``'s; ``slots`` and ``accept`` ``[N]`` int32 on the state's device (numpy arrays with numpy
    states)."""
    n = slots.shape[0]
    c, hv, nn = layer.channels, layer.num_v_heads, layer.num_v_heads * layer.head_dim
    if type(state).__module__ == "numpy":
        import numpy as np

        empty = lambda w: np.zeros((0, w), np.float32)  # noqa: E731
        lengths = np.zeros((n,), np.int32)
    else:
        import torch

        dev = state.device
        empty = lambda w: torch.zeros((0, w), dtype=torch.float32, device=dev)  # noqa: E731
        lengths = torch.zeros((n,), dtype=torch.int32, device=dev)
    spec_step(layer, empty(c), empty(hv), empty(hv), empty(nn), state, conv_state, slots, pending, held, accept,
              lengths=lengths, out=empty(nn), state_layout=state_layout, validate=validate)


def __getattr__(name):
    # the engine adapters import torch (and transformers): loaded on first use, so numpy users need neither
    if name in ("hf", "vllm"):
        import importlib

        return importlib.import_module(f"gdn.{name}")
    raise AttributeError(f"module 'gdn' has no attribute {name!r}")
