"""gdn: the fused Gated DeltaNet window step on an engine's own tensors, in place.

``gdn.Layer`` holds one layer's weights (from the checkpoint's tensors or an HF module); ``gdn.step`` advances
sequences of packed rows on the caller's state pool and conv state (torch tensors on the CPU or a CUDA device,
or numpy arrays). See ``help(gdn.step)`` for every argument's shape and dtype.

Conventions: HF transformers' and vLLM's (mixed q|k|v before the conv, raw a/b logits, conv state
``[slot][C][w]`` with the history in its last three columns, value-major state ``[slot][head][v][k]`` as vLLM,
SGLang and FlashInfer keep it), FLA's ``cu_seqlens``.
"""

from gdn._native import Layer, step

__all__ = ["Layer", "step"]
