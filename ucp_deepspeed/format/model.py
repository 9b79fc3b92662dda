"""What a megatron-core GPT computes, recorded at save: the fields an export needs that tensor shapes leave open.

A `ModelSpec` is written into the save metadata of a megatron-core `GPTModel` and copied into the
universal manifest (`"model"`), so `ucp export-hf` needs no flags and an import says which
megatron-core model to build. Field names are megatron-core's (`TransformerConfig`, `GPTModel`).
`unmapped` holds megatron-core settings that change the function at values no Hugging Face
architecture here expresses (e.g. `qk_layernorm: true`); an export refuses them by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

ACTIVATIONS = ("gelu", "gelu_tanh", "silu")
"""Activations by name: exact GELU, GELU's tanh approximation (GPT-2's `gelu_new`), SiLU (SwiGLU when gated)."""


@dataclass(frozen=True)
class ModelSpec:
    """A megatron-core GPT's architecture, in megatron-core's terms."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    """Unpadded when `checkpoint.universal.vocab_size` is set, else the embedding's padded rows."""
    max_sequence_length: int
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu"
    """One of `ACTIVATIONS`, or the dotted name of another function (which no export maps)."""
    gated_linear_unit: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling_factor: float = 0.0
    """Llama 3.1's RoPE frequency scaling (megatron-core's `rope_scaling`) by this factor; 0 for none."""
    window_size: int = 0
    """Sliding-window attention: each token attends to the last `window_size` tokens, itself included (HF's
    `sliding_window`; megatron-core's `window_size=(w - 1, 0)`); 0 for full causal attention."""
    tied: bool = True
    """The output layer shares the word embedding (`share_embeddings_and_output_weights`)."""
    num_moe_experts: int = 0
    moe_router_topk: int = 0
    unmapped: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if min(self.num_layers, self.hidden_size, self.num_attention_heads, self.num_query_groups) < 1:
            raise ValueError("model has no layers, width or heads")
        if self.num_attention_heads % self.num_query_groups or self.kv_channels < 1 or self.vocab_size < 1:
            raise ValueError(
                f"model's {self.num_attention_heads} heads do not split into {self.num_query_groups} query groups, "
                "or it has no head width or vocabulary"
            )

    def encode(self) -> dict[str, Any]:
        """The JSON form."""
        return asdict(self)

    @classmethod
    def decode(cls, raw: Any) -> ModelSpec:
        """Parse and type-check the JSON form (ValueError on anything malformed)."""
        if not isinstance(raw, dict):
            raise ValueError("model is not an object")
        known = {f.name: f for f in fields(cls)}
        unknown = set(raw) - set(known)
        if unknown:
            raise ValueError(f"model has unknown fields {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            kind = known[name].type
            ok = {
                "int": type(value) is int and value >= 0,
                "float": type(value) in (int, float),
                "str": isinstance(value, str),
                "bool": isinstance(value, bool),
            }.get(str(kind), isinstance(value, dict))
            if not ok:
                raise ValueError(f"model.{name} is {value!r}, not a {kind}")
            values[name] = float(value) if kind == "float" else value
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"model lacks fields ({exc})") from None

    @property
    def moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_moe_experts > 0
