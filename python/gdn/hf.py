"""gdn as a drop-in for HF transformers' Gated DeltaNet layers.

``gdn.hf.patch(model)`` replaces the forward of every ``Qwen3_5GatedDeltaNet`` (and
``Qwen3NextGatedDeltaNet``) module of ``model`` so that ``model(...)`` and ``model.generate(...)`` run
the layer's conv, gates, delta rule, readout and gated RMS norm as one gdn step; the input and
output projections stay HF's. Prompt and decode windows alike go through it.

State: HF's own cache object holds it. The patched layer initialises the cache layer's
``conv_states[0]`` as ``[batch, C, conv_kernel_size]`` in the model's dtype (HF's shape: the
history is the last three columns, as HF keeps it) and ``recurrent_states[0]`` as ``[batch, h_v,
d, d]`` in f32 **value-major** (each head's matrix is ``[v][k]``, vLLM's and FlashInfer's layout:
the transpose of what HF's own kernels keep). A cache filled by the patched layers is therefore
read only by patched layers: patch before the first forward and keep the patch for the cache's
life. Beam reordering (``reorder_cache``) and ``reset`` work unchanged (they index the batch).
Cache rollback (``activate_past_recording`` / ``crop``, used by assisted generation) is refused
with an error.
"""

from __future__ import annotations

import types

import torch

import gdn

_KINDS = ("Qwen3_5GatedDeltaNet", "Qwen3NextGatedDeltaNet")


def patch(model) -> int:
    """Patches every GDN layer of ``model`` in place; returns how many were patched.

    Raises ``ValueError`` if the model has none. Calling it twice is harmless.
    """
    n = 0
    for module in model.modules():
        if type(module).__name__ in _KINDS:
            if not getattr(module, "_gdn_patched", False):
                module._gdn_original_forward = module.forward
                module.forward = types.MethodType(_forward, module)
                module._gdn_patched = True
            n += 1
    if n == 0:
        raise ValueError(
            "no Qwen3_5GatedDeltaNet or Qwen3NextGatedDeltaNet module in this model"
        )
    return n


def unpatch(model) -> None:
    """Restores HF's own forward of every patched layer (a cache filled while patched is not valid
    for it: see the module docstring)."""
    for module in model.modules():
        if getattr(module, "_gdn_patched", False):
            module.forward = module._gdn_original_forward
            del module._gdn_original_forward
            module._gdn_patched = False
            module.__dict__.pop("_gdn_layer", None)


def _layer(module) -> "gdn.Layer":
    # built once from the module's weights (a host copy at build time)
    layer = module.__dict__.get("_gdn_layer")
    if layer is None:
        layer = gdn.Layer.from_hf(module)
        module.__dict__["_gdn_layer"] = layer
    return layer


def _projections(module, hidden_states):
    """mixed qkv [B, T, C], z [B, T, n], b and a [B, T, h_v] as the module's projections give them."""
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z and b, a interleaved per key head
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
        )
        bsz, t = hidden_states.shape[:2]
        mixed = torch.cat(
            (q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)), dim=-1
        )
        return mixed, z.reshape(bsz, t, -1), b, a
    return (
        module.in_proj_qkv(hidden_states),
        module.in_proj_z(hidden_states),
        module.in_proj_b(hidden_states),
        module.in_proj_a(hidden_states),
    )


def _states(module, cache_params, bsz, device, dtype):
    """The cache layer's conv and recurrent state (created at the first window), or fresh zeros when
    there is no cache; and whether the step commits."""
    h_v, d = module.num_v_heads, module.head_v_dim
    if module.head_k_dim != d:
        raise ValueError(
            f"gdn needs equal key and value head dims, got {module.head_k_dim} and {d}"
        )
    conv_shape = (bsz, module.conv_dim, module.conv_kernel_size)
    state_shape = (bsz, h_v, d, d)
    if cache_params is None:
        return (
            torch.zeros(state_shape, dtype=torch.float32, device=device),
            torch.zeros(conv_shape, dtype=dtype, device=device),
            False,
        )
    cl = cache_params.layers[module.layer_idx]
    if cl.record_past:
        raise NotImplementedError(
            "gdn.hf: cache rollback (record_past / crop) is not supported by the patched layers"
        )
    if not cache_params.has_previous_state(module.layer_idx, state_idx=0):
        if not cl.is_conv_states_initialized[0]:
            cl.lazy_initialization(
                conv_states=torch.zeros(conv_shape, dtype=dtype, device=device),
                conv_kernel_size=module.conv_kernel_size,
            )
        if not cl.is_recurrent_states_initialized[0]:
            cl.lazy_initialization(
                recurrent_states=torch.zeros(state_shape, dtype=torch.float32, device=device)
            )
    conv, state = cl.conv_states[0], cl.recurrent_states[0]
    if tuple(conv.shape) != conv_shape or tuple(state.shape) != state_shape:
        raise ValueError(
            f"gdn.hf: the cache holds conv {tuple(conv.shape)} and state {tuple(state.shape)}, "
            f"this window needs {conv_shape} and {state_shape} (batch changed without a new cache?)"
        )
    if not cache_params.has_previous_state(module.layer_idx, state_idx=0):
        conv.zero_()
        state.zero_()
        cl.has_previous_state[0] = True
    return state, conv, True


def _indices(module, bsz, t, dev, commits):
    """Slots 0..bsz, every length t, and the commits (None: all; zeros: verify), kept per shape so a
    decode step creates no tensors."""
    cache = module.__dict__.setdefault("_gdn_indices", {})
    key = (bsz, t, str(dev), commits)
    got = cache.get(key)
    if got is None:
        got = (
            torch.arange(bsz, dtype=torch.int32, device=dev),
            torch.full((bsz,), t, dtype=torch.int32, device=dev),
            None if commits else torch.zeros(bsz, dtype=torch.int32, device=dev),
        )
        if len(cache) > 64:
            cache.clear()
        cache[key] = got
    return got


def _forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_mask_to_padding_states

    if kwargs.get("cu_seq_lens_q") is not None:
        raise NotImplementedError(
            "gdn.hf: packed (padding-free) batches with cu_seq_lens_q are not supported by the patched layers"
        )
    if str(self.activation).lower() not in ("silu", "swish"):
        raise NotImplementedError(
            f"gdn.hf: the conv activation is {self.activation!r}; gdn's conv is followed by SiLU"
        )

    hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
    bsz, t, _ = hidden_states.shape
    mixed, z, b, a = _projections(self, hidden_states)
    state, conv, commits = _states(self, cache_params, bsz, hidden_states.device, mixed.dtype)
    rows = bsz * t
    slots, lengths, commit = _indices(self, bsz, t, hidden_states.device, commits)
    y = gdn.step(
        _layer(self),
        mixed.reshape(rows, -1),
        a.reshape(rows, -1),
        b.reshape(rows, -1),
        z.reshape(rows, -1),
        state,
        conv,
        slots,
        lengths=lengths,
        commit=commit,
        state_layout="value_major",
        max_seqlen=t,
    )
    return self.out_proj(y.reshape(bsz, t, -1))
