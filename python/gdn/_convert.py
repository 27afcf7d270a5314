"""Conversions the native module calls back into: checkpoint tensors to f32 arrays, an HF module's layer."""

import numpy as np


def f32_array(x, name):
    """``x`` (a torch tensor on any device, a numpy array, or anything numpy takes) as a C-contiguous float32
    numpy array: the one copy a layer's weights take."""
    if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor, without importing torch
        x = x.detach().float().cpu().contiguous().numpy()
    try:
        return np.ascontiguousarray(x, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a tensor or array of numbers: {e}") from None


def hf_layer_args(module):
    """The arguments of ``gdn.Layer`` for an HF ``Qwen3_5GatedDeltaNet`` / ``Qwen3NextGatedDeltaNet`` module."""
    for attr in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv1d", "dt_bias", "A_log", "norm"):
        if not hasattr(module, attr):
            raise TypeError(
                f"module: {type(module).__name__} has no '{attr}'; expected a Qwen3_5GatedDeltaNet or "
                "Qwen3NextGatedDeltaNet"
            )
    if module.head_k_dim != module.head_v_dim:
        raise ValueError(
            f"module: head_k_dim {module.head_k_dim} != head_v_dim {module.head_v_dim}; gdn needs one head dim"
        )
    k = getattr(module, "conv_kernel_size", module.conv1d.weight.shape[-1])
    if k != 4:
        raise ValueError(f"module: conv kernel size {k}, gdn's conv has 4 taps")
    if getattr(module.conv1d, "bias", None) is not None:
        raise ValueError("module: conv1d has a bias, gdn's conv has none")
    gate = getattr(module.norm, "activation", "silu")
    eps = getattr(module.norm, "variance_epsilon", getattr(module, "layer_norm_epsilon", 1e-6))
    args = (module.conv1d.weight, module.dt_bias, module.A_log, module.norm.weight)
    kwargs = dict(
        num_k_heads=int(module.num_k_heads),
        num_v_heads=int(module.num_v_heads),
        head_dim=int(module.head_k_dim),
        head_map="grouped",
        gate=gate,
        eps=float(eps),
    )
    return args, kwargs
