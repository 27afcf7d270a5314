"""gdn: the fused Gated DeltaNet window step on an engine's own tensors, in place.

``gdn.Layer`` holds one layer's weights (from the checkpoint's tensors or an HF module); ``gdn.step`` advances
sequences of packed rows on the caller's state pool and conv state (torch tensors on the CPU or a CUDA device,
or numpy arrays). See ``help(gdn.step)`` for every argument's shape and dtype. ``gdn.hf.patch(model)`` runs an
HF Qwen3.5 / Qwen3-Next model's GDN layers through gdn; ``gdn.vllm.gdn_attention_core`` takes the inputs of
vLLM's GDN attention core.

Conventions: HF transformers' and vLLM's (mixed q|k|v before the conv, raw a/b logits, conv state
``[slot][C][w]`` with the history in its last three columns, value-major state ``[slot][head][v][k]`` as vLLM,
SGLang and FlashInfer keep it), FLA's ``cu_seqlens``.
"""

from gdn._native import Layer, step

__all__ = ["Layer", "step", "hf", "vllm"]


def __getattr__(name):
    # the engine adapters import torch (and transformers): loaded on first use, so numpy users need neither
    if name in ("hf", "vllm"):
        import importlib

        return importlib.import_module(f"gdn.{name}")
    raise AttributeError(f"module 'gdn' has no attribute {name!r}")
