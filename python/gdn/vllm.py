"""The GDN layer core with the inputs vLLM's ``GatedDeltaNetAttention`` hands its core
(``vllm/model_executor/layers/mamba/gdn_linear_attn.py``), for a vLLM plug-in.

vLLM runs the core as three kernels (``causal_conv1d_update`` / ``causal_conv1d_fn``, then
``fused_recurrent_gated_delta_rule`` / ``chunk_gated_delta_rule``) and the gated RMS norm
(``self.norm(core_attn_out, z)``) after it. :func:`gdn_attention_core` is all of that in one gdn
step, on vLLM's own cache tensors, in place. A plug-in calls it where vLLM calls
``torch.ops.vllm.gdn_attention_core`` and then skips ``self.norm``: the output is already normed and
gated.
"""

from __future__ import annotations

import gdn


def gdn_attention_core(
    layer,
    mixed_qkv,
    b,
    a,
    z,
    core_attn_out,
    conv_state,
    ssm_state,
    state_indices,
    query_start_loc,
    commit=None,
    validate=False,
    max_query_len=None,
):
    """One varlen GDN step on vLLM's tensors; returns ``core_attn_out``.

    Arguments, by vLLM's names (per tensor-parallel rank: use ``layer.shard(rank, world)``):

    - ``layer``: a :class:`gdn.Layer` (``gdn.Layer(conv1d.weight, dt_bias, A_log, norm.weight, ...)``
      with ``head_map="grouped"``, ``gate="silu"``).
    - ``mixed_qkv``: ``[num_actual_tokens, C]``, q|k|v before the conv (the first ``C`` columns of
      ``in_proj_qkvz``'s output may be passed as the strided view vLLM has). bf16/f16/f32.
    - ``b``, ``a``: ``[num_actual_tokens, h_v]``, the raw ``in_proj_ba`` halves (beta and gate logits).
    - ``z``: ``[num_actual_tokens, h_v * d]`` (or ``[tokens, h_v, d]``), the output gate input.
    - ``core_attn_out``: ``[num_actual_tokens, h_v * d]`` (or ``[tokens, h_v, d]``), written with
      ``norm(core, z)``: what vLLM's ``self.norm`` would return.
    - ``conv_state``: ``self.kv_cache[0].transpose(-1, -2)``, ``[num_slots, C, K - 1]`` (a strided
      view: channels contiguous), the model's dtype. Updated in place for committing sequences.
    - ``ssm_state``: ``self.kv_cache[1]``, ``[num_slots, h_v, d_v, d_k]`` (value-major), f32 or bf16.
    - ``state_indices``: int32 ``[num_seqs]``, ``non_spec_state_indices_tensor``: each sequence's
      slot; ``-1`` (vLLM's padding, ``PAD_SLOT_ID``) skips the sequence.
    - ``query_start_loc``: int32 ``[num_seqs + 1]``, ``non_spec_query_start_loc`` (cu_seqlens).
    - ``commit``: int32 ``[num_seqs]`` or None (not vLLM's ``num_accepted_tokens``, which counts the
      *previous* step's accepted tokens and picks a start state among per-token ones). None commits
      every sequence's whole window (prefill, decode). Given, sequence s keeps the state after its
      first ``commit[s]`` tokens of this window (0: verify only, nothing written). vLLM's speculative
      path maps to a verify (0) and, once the acceptance is known, a call committing the accepted
      prefix; gdn's Rust API folds the two into one state pass (``LayerPool::step_spec``), not yet
      exposed here.
    - ``validate``: check slot and ``query_start_loc`` values on the host first (synchronises).
    - ``max_query_len``: vLLM's ``max_query_len`` of the batch (or None), passed on as ``max_seqlen``: a
      decode batch (1) then runs gdn's decode kernel and skips the chunked prefill path's launches (B 256,
      bf16 state, H200: 288 us a call against 363 without it).
    """
    # a view (an error where none exists), so that the step writes core_attn_out itself
    out = core_attn_out.view(core_attn_out.shape[0], -1)
    gdn.step(
        layer,
        mixed_qkv,
        a,
        b,
        z.view(z.shape[0], -1),
        ssm_state,
        conv_state,
        state_indices,
        cu_seqlens=query_start_loc,
        commit=commit,
        out=out,
        state_layout="value_major",
        validate=validate,
        max_seqlen=max_query_len,
    )
    return core_attn_out
