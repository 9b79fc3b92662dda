"""The reach into megatron-core: its modules (transformer layers, MoE layers and their expert containers), the
tensor-parallel attributes it sets on parameters, and a `GPTModel`'s architecture read off its config and layers.

megatron-core is imported inside the functions that need it, so the `ucp` command imports none of it.
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Any, NamedTuple


def is_megatron_moe(module: Any) -> bool:
    """A megatron-core `MoELayer`."""
    return type(module).__name__ == "MoELayer" and type(module).__module__.startswith("megatron.core.transformer.moe")


class GroupedExperts(enum.Enum):
    """How a megatron-core grouped-GEMM expert module keeps its local experts' weights."""

    TE = "te"
    """TEGroupedMLP: one weight per local expert (`linear_fc1.weight<i>`)."""
    FUSED = "fused"
    """GroupedMLP: all local experts in one `weight1` / `weight2`."""


def megatron_grouped_experts(module: Any) -> GroupedExperts | None:
    """How a megatron-core grouped-GEMM expert module keeps its experts' weights (their names differ from
    SequentialMLP's); None for anything else."""
    if not type(module).__module__.startswith("megatron.core.transformer.moe"):
        return None
    return {"TEGroupedMLP": GroupedExperts.TE, "GroupedMLP": GroupedExperts.FUSED}.get(type(module).__name__)


def is_megatron_transformer_layer(module: Any) -> bool:
    """A megatron-core `TransformerLayer` (or a subclass defined in megatron-core)."""
    return is_megatron_module(module) and any(c.__name__ == "TransformerLayer" for c in type(module).__mro__)


@functools.cache
def megatron_fused_norms() -> dict[str, str]:
    """Transformer Engine's fused-norm parameter prefixes inside a megatron-core transformer layer -> the local
    spec's, read from megatron-core's own map between the two (its local GPT layer spec's
    `sharded_state_dict_keys_map`: `input_layernorm.` <-> `self_attention.linear_qkv.layer_norm_`, ...)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return {te: local for local, te in get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map.items()}


def is_megatron_module(module: Any) -> bool:
    """A module defined by megatron-core (its parameters carry tensor-parallel attributes)."""
    return type(module).__module__.startswith("megatron.core")


class MegatronSplit(NamedTuple):
    """How megatron-core splits a tensor-parallel parameter: the dimension, how many fused parts each rank's slice
    holds (`partition_stride`: 2 for a gated MLP's fc1), and whether it is the vocab-parallel embedding or output."""

    dim: int
    stride: int
    vocab_parallel: bool


def megatron_split(p: Any) -> MegatronSplit | None:
    """How megatron-core splits a tensor-parallel parameter over its ranks; None when it is replicated."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    return MegatronSplit(
        dim=int(p.partition_dim),
        stride=int(getattr(p, "partition_stride", 1)),
        vocab_parallel=bool(getattr(p, "is_embedding_or_output_parameter", False)),
    )


def megatron_layer_number(module: Any) -> int | None:
    """The 1-based global layer number of a megatron-core transformer layer; None for other modules."""
    number = getattr(module, "layer_number", None)
    return number if isinstance(number, int) and is_megatron_module(module) else None


def megatron_tied_output_stage(module: Any) -> bool:
    """A megatron-core model on a last pipeline stage (not also the first) whose output layer is a copy of
    the word embedding."""
    return (
        is_megatron_module(module)
        and bool(getattr(module, "share_embeddings_and_output_weights", False))
        and bool(getattr(module, "post_process", False))
        and not getattr(module, "pre_process", True)
    )


# Function-changing megatron-core settings and their plain values; any other value is recorded as unmapped.
# (`apply_query_key_layer_scaling` is not one: the softmax multiplies its divisor back.)
_PLAIN_MEGATRON = {
    "qk_layernorm": False,
    "qk_l2_norm": False,
    "layernorm_zero_centered_gamma": False,
    "apply_residual_connection_post_layernorm": False,
    "rotary_interleaved": False,
    "no_rope_freq": None,
    "multi_latent_attention": False,
    "softmax_scale": None,
    "softmax_type": "vanilla",
    "window_attn_skip_freq": None,
    "attention_output_gate": False,
    "experimental_attention_variant": None,
    "linear_attention_freq": None,
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_topk_limited_devices": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_force_load_balancing": False,
    "moe_shared_expert_intermediate_size": None,
    "moe_layer_freq": 1,
    "moe_input_jitter_eps": None,
    "moe_apply_probs_on_input": False,
    "moe_expert_capacity_factor": None,
    "moe_latent_size": None,
    "mtp_num_layers": None,
}
_LLAMA3_CONTEXT, _LLAMA3_LOW, _LLAMA3_HIGH = 8192, 1.0, 4.0


def _activation_name(fn: Any) -> str:
    import torch.nn.functional as F

    if fn is F.gelu:
        return "gelu"
    if fn is F.silu:
        return "silu"
    tanh = {"approximate": "tanh"}
    if isinstance(fn, functools.partial) and fn.func is F.gelu and not fn.args and fn.keywords == tanh:
        return "gelu_tanh"
    try:
        from megatron.core.transformer import utils as mutils
    except ImportError:
        mutils = None
    if mutils is not None and any(fn is getattr(mutils, n, None) for n in ("openai_gelu", "gelu_impl")):
        return "gelu_tanh"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _llama3_factor(rope: Any, base: float) -> float | None:
    """The factor of megatron-core's Llama 3.1 RoPE scaling, measured on the frequencies it changed and checked by
    recomputing them all; 0 when it changed none (no head is that slow); None when they fit no factor."""
    import torch

    inv_freq = rope.inv_freq.detach().float().cpu()
    dim = 2 * inv_freq.numel()
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = 0.0
    for f, scaled in zip(reversed(plain.tolist()), reversed(inv_freq.tolist())):  # slowest first
        wavelen = 2 * math.pi / f
        if wavelen > _LLAMA3_CONTEXT / _LLAMA3_LOW:  # divided by the factor
            factor = f / scaled
        elif wavelen >= _LLAMA3_CONTEXT / _LLAMA3_HIGH:  # interpolated: scaled = f * ((1 - s) / factor + s)
            s = (_LLAMA3_CONTEXT / wavelen - _LLAMA3_LOW) / (_LLAMA3_HIGH - _LLAMA3_LOW)
            factor = (1 - s) / (scaled / f - s) if scaled / f != s else 0.0
        break
    if not factor:
        return 0.0 if torch.equal(plain, inv_freq) else None
    factor = round(factor, 4)
    return factor if torch.allclose(rope._apply_scaling(plain, factor=factor), inv_freq, rtol=1e-5) else None


def megatron_gpt_architecture(module: Any) -> dict[str, Any] | None:
    """The fields of a `ModelSpec` (format/model.py) read off a megatron-core `GPTModel` (any pipeline stage);
    None for other modules. `vocab_size` is the padded one the model was built with."""
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError:
        return None
    if not isinstance(module, GPTModel):
        return None
    c = module.config
    window = getattr(c, "window_size", None)
    unmapped: dict[str, Any] = {k: getattr(c, k) for k, v in _PLAIN_MEGATRON.items() if getattr(c, k, v) != v}
    if window is not None and window[1] != 0:
        unmapped["window_size"] = list(window)
    if c.num_moe_experts and getattr(c, "moe_router_load_balancing_type", "aux_loss") == "sinkhorn":
        unmapped["moe_router_load_balancing_type"] = "sinkhorn"  # routes by a sigmoid at inference
    rope = module.position_embedding_type in ("rope", "yarn", "mrope")
    rotary = getattr(module, "rotary_pos_emb", None) if module.position_embedding_type == "rope" else None
    factor: float | None = 0.0
    if rotary is not None:
        if getattr(rotary, "seq_len_interpolation_factor", None) is not None:
            unmapped["seq_len_interpolation_factor"] = rotary.seq_len_interpolation_factor
        if getattr(module, "rotary_scaling", False):
            factor = _llama3_factor(rotary, float(module.rotary_base))
            if factor is None:
                unmapped["rope_scaling"] = "frequencies that fit no Llama 3.1 factor"
    return {
        "num_layers": int(c.num_layers),
        "hidden_size": int(c.hidden_size),
        "ffn_hidden_size": int((c.moe_ffn_hidden_size if c.num_moe_experts else None) or c.ffn_hidden_size),
        "num_attention_heads": int(c.num_attention_heads),
        "num_query_groups": int(c.num_query_groups or c.num_attention_heads),
        "kv_channels": int(c.kv_channels),
        "vocab_size": int(module.vocab_size),
        "max_sequence_length": int(module.max_sequence_length),
        "normalization": str(c.normalization),
        "layernorm_epsilon": float(c.layernorm_epsilon),
        "activation": _activation_name(c.activation_func),
        "gated_linear_unit": bool(c.gated_linear_unit),
        "add_bias_linear": bool(c.add_bias_linear),
        "add_qkv_bias": bool(getattr(c, "add_qkv_bias", False)),
        "position_embedding_type": str(module.position_embedding_type),
        "rotary_base": float(module.rotary_base) if rope else 10000.0,
        "rotary_percent": float(module.rotary_percent) if rope else 1.0,
        "rope_scaling_factor": factor or 0.0,
        "window_size": int(window[0]) + 1 if window is not None and window[1] == 0 else 0,
        "tied": bool(module.share_embeddings_and_output_weights),
        "num_moe_experts": int(c.num_moe_experts or 0),
        "moe_router_topk": int(c.moe_router_topk) if c.num_moe_experts else 0,
        "unmapped": {k: v if isinstance(v, (bool, int, float, str, list)) else repr(v) for k, v in unmapped.items()},
    }
