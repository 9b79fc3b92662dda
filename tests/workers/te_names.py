"""A megatron-core GPT laid out and named as its Transformer Engine spec builds it, on a CPU without TE.

megatron-core's TE spec (`get_gpt_layer_with_transformer_engine_spec`) leaves each layer's `input_layernorm` and
`pre_mlp_layernorm` empty (`IdentityOp`) and fuses the norms into the next linear, `TELayerNormColumnParallelLinear`,
whose parameters are then `self_attention.linear_qkv.layer_norm_weight` (and `layer_norm_bias` for LayerNorm) and
`mlp.linear_fc1.layer_norm_*`. TE cannot be installed here, so `TELayerNormColumnParallelLinear` below is
megatron-core's own ColumnParallelLinear with that norm in front, under TE's parameter names; the spec is
megatron-core's local spec with exactly those modules swapped, and so names and shapes are what the TE spec gives.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp


class TELayerNormColumnParallelLinear(ColumnParallelLinear):
    """A norm, then a column-parallel linear: TE's fused module, by its parameter names."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.normalization, self.eps = config.normalization, config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size))

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        if self.normalization == "LayerNorm":
            normed = torch.nn.functional.layer_norm(
                input_, (input_.shape[-1],), self.layer_norm_weight, self.layer_norm_bias, self.eps
            )
        else:
            normed = torch.nn.functional.rms_norm(input_, (input_.shape[-1],), self.layer_norm_weight, self.eps)
        return super().forward(normed, *args, **kwargs)


def te_named_spec(**local_spec_args):
    """megatron-core's local GPT layer spec with TE's fused-norm layout (dense layers only)."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(**local_spec_args))
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.pre_mlp_layernorm = IdentityOp
    layer.self_attention.submodules.linear_qkv = TELayerNormColumnParallelLinear
    layer.mlp.submodules.linear_fc1 = TELayerNormColumnParallelLinear
    layer.sharded_state_dict_keys_map = {}  # the TE spec's names are megatron-core's sharded keys already
    return spec
