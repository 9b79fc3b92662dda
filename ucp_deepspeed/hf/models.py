"""One two-way config table per Hugging Face architecture: a `transformers` config against a megatron-core `ModelSpec`.

`spec_of` reads a config the way `transformers` does (its own config class fills the defaults a
`config.json` leaves out, and reads old and new RoPE keys alike) and says which megatron-core GPT
computes the same function. A config field that changes the function and that megatron-core's GPT
cannot carry is a `CheckpointError` naming the field, never a silent drop. `config_of` is the way
back: the fields the spec determines, over the original `config.json` when the weights came from
one (its token ids and other fields megatron-core has no place for). `megatron_kwargs` gives the
`TransformerConfig` and `GPTModel` arguments that build the model of a spec.

    gpt2     GPT2LMHeadModel: LayerNorm, learned positions, biases everywhere, GELU (`gelu_new` is the
             tanh approximation), tied output layer
    llama    LlamaForCausalLM: RMSNorm, RoPE (Llama 3.1 scaling too), SwiGLU, grouped-query attention;
             attention and MLP biases together or not at all (megatron-core's `add_bias_linear`)
    mistral  MistralForCausalLM: Llama plus sliding-window attention
    qwen2    Qwen2ForCausalLM: Llama with q/k/v biases only (`add_qkv_bias`)
    mixtral  MixtralForCausalLM: Mistral with top-k routed SwiGLU experts (softmax over the top k)
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import replace
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.model import ModelSpec

ARCHS = ("gpt2", "llama", "mistral", "qwen2", "mixtral")
CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}
_GATED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Llama 3.1's RoPE scaling, the only one megatron-core's GPT has (its factors other than `factor` are fixed)."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise CheckpointError("transformers", "is not installed; pip install 'ucp_deepspeed[hf]'") from None
    return transformers


def _refuse(where: str, field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(where, f"{field}={value!r}: {why}")


def read_config(hf_dir: str) -> tuple[Any, dict[str, Any]]:
    """The `transformers` config object of a model folder and its `config.json` as written; no code runs."""
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"cannot be read as JSON ({exc})") from None
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind not in ARCHS:
        raise _refuse(path, "model_type", kind, f"not one of {', '.join(ARCHS)}")
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.for_model(kind).__class__.from_dict(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(path, f"transformers refuses this {kind} config ({exc!r})") from None
    return config, raw


def _rope(config: Any, where: str) -> tuple[float, float]:
    """(theta, Llama 3.1 scaling factor or 0) from either the old keys (`rope_theta`, `rope_scaling`) or v5's
    `rope_parameters`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0))
    if partial != 1.0:
        raise _refuse(where, "partial_rotary_factor", partial, "this architecture's RoPE here covers whole heads")
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    scaling = (
        params if params.get("rope_type", "default") != "default" else dict(getattr(config, "rope_scaling", None) or {})
    )
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, 0.0
    field = "rope_parameters" if params else "rope_scaling"
    if kind != "llama3" or any(float(scaling.get(k, -1)) != v for k, v in _LLAMA3_ROPE.items()):
        raise _refuse(
            where,
            field,
            scaling,
            "megatron-core's GPT has only Llama 3.1's RoPE scaling "
            f"(rope_type llama3 with {_LLAMA3_ROPE}); this one would be dropped",
        )
    return theta, float(scaling["factor"])


def spec_of(config: Any, where: str, kv_heads: int | None = None) -> tuple[str, ModelSpec]:
    """(architecture, the megatron-core GPT computing what `config` describes); `kv_heads` folds a GPT-2 export of
    a grouped-query model back. Raises naming the first field megatron-core cannot carry."""
    arch = config.model_type
    if kv_heads and arch != "gpt2":
        raise _refuse(where, "model_type", arch, "--num-kv-heads folds GPT-2 exports only; this config has its own")
    tied = bool(getattr(config, "tie_word_embeddings", arch == "gpt2"))
    if arch == "gpt2":
        act = config.activation_function
        if act not in _GPT2_ACTIVATIONS:
            raise _refuse(where, "activation_function", act, f"not one of {sorted(_GPT2_ACTIVATIONS)}")
        for field, plain in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if bool(getattr(config, field, plain)) != plain:
                raise _refuse(where, field, not plain, "changes attention scaling, which megatron-core's GPT fixes")
        if getattr(config, "add_cross_attention", False):
            raise _refuse(where, "add_cross_attention", True, "a decoder-only GPT has no cross-attention")
        heads = config.n_head
        return arch, ModelSpec(
            num_layers=config.n_layer,
            hidden_size=config.n_embd,
            ffn_hidden_size=config.n_inner or 4 * config.n_embd,
            num_attention_heads=heads,
            num_query_groups=kv_heads or heads,
            kv_channels=config.n_embd // heads,
            vocab_size=config.vocab_size,
            max_sequence_length=config.n_positions,
            normalization="LayerNorm",
            layernorm_epsilon=float(config.layer_norm_epsilon),
            activation=_GPT2_ACTIVATIONS[act],
            add_bias_linear=True,
            position_embedding_type="learned_absolute",
            tied=tied,
        )
    act = config.hidden_act
    if act not in _GATED_ACTIVATIONS:
        raise _refuse(where, "hidden_act", act, f"not one of {sorted(_GATED_ACTIVATIONS)}")
    if arch == "llama":
        attention_bias, mlp_bias = bool(config.attention_bias), bool(getattr(config, "mlp_bias", False))
        if attention_bias != mlp_bias:
            raise _refuse(
                where,
                "mlp_bias",
                mlp_bias,
                f"with attention_bias={attention_bias}: megatron-core's add_bias_linear gives attention and MLP "
                "layers biases together or not at all",
            )
        bias, qkv_bias = attention_bias, False
    else:
        bias, qkv_bias = False, arch == "qwen2"
    window = 0
    if arch == "qwen2" and getattr(config, "use_sliding_window", False):
        raise _refuse(
            where,
            "use_sliding_window",
            True,
            "Qwen2's window applies to some layers only (max_window_layers), which megatron-core's GPT does not do",
        )
    if arch in ("mistral", "mixtral") and getattr(config, "sliding_window", None):
        window = int(config.sliding_window)
        if window >= config.max_position_embeddings:
            window = 0  # a window as long as any sequence is full attention
    experts = topk = 0
    if arch == "mixtral":
        if float(getattr(config, "router_jitter_noise", 0.0)):
            raise _refuse(
                where, "router_jitter_noise", config.router_jitter_noise, "megatron-core's router has no jitter"
            )
        experts, topk = config.num_local_experts, config.num_experts_per_tok
    theta, factor = _rope(config, where)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return arch, ModelSpec(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
        kv_channels=head_dim,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        normalization="RMSNorm",
        layernorm_epsilon=float(config.rms_norm_eps),
        activation=_GATED_ACTIVATIONS[act],
        gated_linear_unit=True,
        add_bias_linear=bias,
        add_qkv_bias=qkv_bias,
        position_embedding_type="rope",
        rotary_base=theta,
        rope_scaling_factor=factor,
        window_size=window,
        tied=tied,
        num_moe_experts=experts,
        moe_router_topk=topk,
    )


def arch_for(spec: ModelSpec, hf_config: dict[str, Any] | None = None) -> str:
    """The architecture an export of `spec` takes: the imported one's if it still fits, else the plainest that does."""
    origin = (hf_config or {}).get("model_type")
    if origin in ARCHS and not _misfits(origin, spec):
        return origin
    for arch in ("gpt2", "mixtral", "qwen2", "llama", "mistral"):
        if not _misfits(arch, spec):
            return arch
    return "llama"  # config_of names what does not fit


def _misfits(arch: str, spec: ModelSpec) -> list[tuple[str, Any, Any]]:
    """(megatron-core field, its value, what `arch` needs) for each field of `spec` the architecture cannot express."""
    if arch == "gpt2":
        need: dict[str, Any] = {
            "normalization": "LayerNorm",
            "gated_linear_unit": False,
            "add_bias_linear": True,  # which gives linear_qkv its bias whatever add_qkv_bias says
            "position_embedding_type": "learned_absolute",
            "num_moe_experts": 0,
            "window_size": 0,
            "kv_channels": spec.hidden_size // spec.num_attention_heads,
        }
        acts = set(_GPT2_ACTIVATIONS.values())
    else:
        need = {
            "normalization": "RMSNorm",
            "gated_linear_unit": True,
            "position_embedding_type": "rope",
            "rotary_percent": 1.0,
        }
        if arch == "qwen2":
            need |= {"add_bias_linear": False, "add_qkv_bias": True}
        elif arch != "llama":
            need |= {"add_bias_linear": False, "add_qkv_bias": False}
        elif not spec.add_bias_linear:  # with add_bias_linear, linear_qkv has its bias whatever add_qkv_bias says
            need["add_qkv_bias"] = False
        if arch not in ("mistral", "mixtral"):
            need["window_size"] = 0
        if arch != "mixtral":
            need["num_moe_experts"] = 0
        elif not spec.moe:
            need["num_moe_experts"] = "at least 1"
        acts = set(_GATED_ACTIVATIONS.values())
    out = [(k, getattr(spec, k), v) for k, v in need.items() if getattr(spec, k) != v]
    if spec.activation not in acts:
        out.append(("activation", spec.activation, sorted(acts)))
    out += [(k, v, "its plain value") for k, v in spec.unmapped.items()]
    return out


def _rope_fields(spec: ModelSpec, cls: Any) -> dict[str, Any]:
    """RoPE's config fields in the form the installed `transformers` writes: v5's `rope_parameters`, or
    `rope_theta` and `rope_scaling` before it."""
    scaling = (
        {"rope_type": "llama3", "factor": spec.rope_scaling_factor, **_LLAMA3_ROPE}
        if spec.rope_scaling_factor
        else None
    )
    if hasattr(cls(), "rope_parameters"):  # transformers 5
        return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": spec.rotary_base}}
    return {"rope_theta": spec.rotary_base, "rope_scaling": scaling}


def config_of(spec: ModelSpec, arch: str, hf_config: dict[str, Any] | None, dtype: str, where: str) -> dict[str, Any]:
    """The `config.json` of `spec` exported as `arch` with weights of `dtype`: the spec's fields over `hf_config`
    (the imported model's own, when of the same architecture), as `transformers`' `save_pretrained` writes it."""
    bad = _misfits(arch, spec)
    if bad:
        field, value, need = bad[0]
        raise _refuse(where, field, value, f"a {arch} model needs {need}; this megatron-core model is not one")
    transformers = _transformers()
    cls = transformers.AutoConfig.for_model(arch).__class__
    # the original, with the defaults its config.json left out filled in, so that "not given" stays so
    base = cls.from_dict(hf_config).to_dict() if hf_config and hf_config.get("model_type") == arch else {}
    for legacy in ("rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype", "transformers_version"):
        base.pop(legacy, None)
    fields: dict[str, Any] = {"architectures": [CLASSES[arch]], "model_type": arch, "tie_word_embeddings": spec.tied}
    if arch == "gpt2":
        act = str(base.get("activation_function"))
        fields |= {
            "vocab_size": spec.vocab_size,
            "n_positions": spec.max_sequence_length,
            "n_embd": spec.hidden_size,
            "n_layer": spec.num_layers,
            "n_head": spec.num_attention_heads,
            # None is GPT-2's way of saying 4x
            "n_inner": None
            if base and base.get("n_inner") is None and spec.ffn_hidden_size == 4 * spec.hidden_size
            else spec.ffn_hidden_size,
            "activation_function": act
            if _GPT2_ACTIVATIONS.get(act) == spec.activation
            else "gelu_new"
            if spec.activation == "gelu_tanh"
            else spec.activation,
            "layer_norm_epsilon": spec.layernorm_epsilon,
        }
        if not base:  # dropout is for training; an export is for inference and fine-tuning from it
            fields |= {
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "bos_token_id": None,
                "eos_token_id": None,
            }
    else:
        act = str(base.get("hidden_act"))
        fields |= {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn_hidden_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_query_groups,
            "max_position_embeddings": spec.max_sequence_length,
            "rms_norm_eps": spec.layernorm_epsilon,
            "hidden_act": act
            if _GATED_ACTIVATIONS.get(act) == spec.activation
            else {"gelu_tanh": "gelu_pytorch_tanh"}.get(spec.activation, spec.activation),
            **_rope_fields(spec, cls),
        }
        if not (
            base and base.get("head_dim") is None and spec.kv_channels * spec.num_attention_heads == spec.hidden_size
        ):
            fields["head_dim"] = spec.kv_channels  # else left as the original had it: unset, meaning hidden / heads
        if arch == "llama":
            fields |= {"attention_bias": spec.add_bias_linear, "mlp_bias": spec.add_bias_linear}
        if arch in ("mistral", "mixtral"):
            fields["sliding_window"] = spec.window_size or None
        if arch == "qwen2":
            fields |= {"use_sliding_window": False, "sliding_window": None}
        if arch == "mixtral":
            fields |= {"num_local_experts": spec.num_moe_experts, "num_experts_per_tok": spec.moe_router_topk}
            if not base:
                fields |= {"router_aux_loss_coef": 0.0, "output_router_logits": False}
        if not base:
            fields |= {"bos_token_id": None, "eos_token_id": None}
    fields["dtype" if hasattr(cls(), "dtype") else "torch_dtype"] = dtype
    return cls.from_dict({**base, **fields}).to_diff_dict()  # what `save_pretrained` writes


def activation_func(name: str) -> Any:
    """The callable megatron-core's `TransformerConfig.activation_func` takes for an activation name."""
    funcs = {
        "gelu": torch.nn.functional.gelu,
        "silu": torch.nn.functional.silu,
        "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
    }
    if name not in funcs:
        raise ValueError(f"no megatron-core activation for {name!r}")
    return funcs[name]


def megatron_kwargs(spec: ModelSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TransformerConfig arguments, GPTModel arguments) that build the model of `spec`; add the parallel sizes,
    dtypes and fusion switches of your run, and pad `vocab_size` for tensor parallelism.

    Example:
        >>> config, _ = read_config("llama-folder")
        >>> arch, spec = spec_of(config, "llama-folder")
        >>> tc, gpt = megatron_kwargs(spec)
        >>> model = GPTModel(TransformerConfig(**tc, tensor_model_parallel_size=2), layer_spec, **gpt)
    """
    if spec.unmapped:
        raise ValueError(f"megatron-core settings {sorted(spec.unmapped)} are recorded but not rebuilt here")
    transformer = {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_query_groups": spec.num_query_groups,
        "kv_channels": spec.kv_channels,
        "normalization": spec.normalization,
        "layernorm_epsilon": spec.layernorm_epsilon,
        "activation_func": activation_func(spec.activation),
        "gated_linear_unit": spec.gated_linear_unit,
        "add_bias_linear": spec.add_bias_linear,
        "add_qkv_bias": spec.add_qkv_bias,
    }
    if spec.window_size:
        transformer["window_size"] = (spec.window_size - 1, 0)
    if spec.moe:
        transformer |= {"num_moe_experts": spec.num_moe_experts, "moe_router_topk": spec.moe_router_topk}
    gpt = {
        "vocab_size": spec.vocab_size,
        "max_sequence_length": spec.max_sequence_length,
        "share_embeddings_and_output_weights": spec.tied,
        "position_embedding_type": spec.position_embedding_type,
    }
    if spec.position_embedding_type == "rope":
        gpt |= {"rotary_base": spec.rotary_base, "rotary_percent": spec.rotary_percent}
        if spec.rope_scaling_factor:
            gpt |= {"rope_scaling": True, "rope_scaling_factor": spec.rope_scaling_factor}
    return transformer, gpt


def with_heads(spec: ModelSpec, qkv_rows: int, heads: int | None, kv_heads: int | None, where: str) -> ModelSpec:
    """`spec` with head counts given by hand, checked against `linear_qkv`'s rows; the head width follows from them
    (it need not be hidden / heads)."""
    heads = heads or spec.num_attention_heads
    kv_heads = kv_heads or (spec.num_query_groups if heads == spec.num_attention_heads else heads)
    per_head = heads + 2 * kv_heads
    if heads % kv_heads or qkv_rows % per_head:
        raise CheckpointError(
            where,
            f"{heads} heads and {kv_heads} key/value heads do not fit linear_qkv "
            f"({qkv_rows} rows for hidden size {spec.hidden_size}); pass --num-heads / --num-kv-heads",
        )
    return replace(spec, num_attention_heads=heads, num_query_groups=kv_heads, kv_channels=qkv_rows // per_head)
