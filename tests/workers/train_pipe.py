"""Train a GPT built as a DeepSpeed `PipelineModule` (the way Megatron-DeepSpeed builds `GPTModelPipe`),
save, and resume it at another pipeline/data-parallel layout or ZeRO stage, checking every state.

The model: a word embedding shared with the output head through `TiedLayerSpec` (the head is a
`forward_fn` on the last stage), a learned position embedding, transformer blocks as `LayerSpec`s
(causal self-attention and an MLP, each block with an integer buffer), a layer with no parameters,
and a final norm with a frozen scale. AdamW with two parameter groups and an LR scheduler.

    save --out DIR --variant NAME ...: train STEPS steps, snapshot every state, save, continue CONT steps;
          rank 0 writes DIR/NAME/reference.pt
    train --variant NAME --ckpt-dir DIR --steps N --ckpt-every K: a training job; on start it resumes from the
          newest complete checkpoint in DIR, whatever layout saved it, and logs `step N loss L world W`
    load --case TARGET SOURCE... ...: build TARGET at this launch's world size, load each SOURCE, compare
          every state with its reference (torch.equal), continue CONT steps and compare the losses;
          rank 0 writes one JSON result per (target, source) to --results. A target `stock:NAME` is
          plain DeepSpeed loading its own universal format (`"load_universal": true`)

A variant fixes the pipeline size, the ZeRO stage, the precision and how layers are split into
stages (`plain` variants train with plain DeepSpeed, so their checkpoints carry no ucp metadata);
data parallelism takes the rest of the world. One launch handles several variants, because
each launch pays for importing DeepSpeed. On a CPU machine, export `DS_ACCELERATOR=cpu` first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator

import common  # tests/workers/common.py, next to this script; puts launch/ on sys.path
import deepspeed
import megatron_cpu  # launch/megatron_cpu.py: megatron-core's CUDA-only helpers, on a CPU
import torch
import torch.distributed as dist
from compare import compare  # tests/workers/compare.py, next to this script
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import ucp_deepspeed
from ucp_deepspeed.geometry.layout import Layout, merge
from ucp_deepspeed.naming.model import param_infos
from ucp_deepspeed.naming.rules import parse_rules
from ucp_deepspeed.runtime.capture import infos, namer
from ucp_deepspeed.sources import list_tags

GLOBAL_BATCH = 8
MICRO_BATCHES = 2  # gradient accumulation steps: the same at every layout, so only summation order changes
SEQ = 8
VOCAB = 256  # the tied embedding outweighs a stage of one block: it crosses a DP partition there only
HIDDEN = 16
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
BLOCKS = 4
STEPS = 3
CONT = 3

LLAMA = {"swiglu": True, "rmsnorm": True, "untied": True, "positions": False, "bias": False}
MDS_VOCAB = 121  # Megatron-DeepSpeed pads it to a multiple of 64 x TP: 128 rows at TP 1 and at TP 2, 7 of them padding
UNTIED_COPIES = "tied_modules.embed.position_embeddings."
"""The learned positions in the tied embedding's copy on the last stage, which no one trains (its tie is the word
embedding's alone): Megatron-DeepSpeed's record counts them pipeline-replicated; a resume takes the first stage's."""
MDS_FFN = 24  # SwiGLU's hidden size: dense_h_to_4h holds [gate; up] on each rank

# Megatron-DeepSpeed's GPTModelPipe at ZeRO-1: what every `mds` variant shares
MDS = {"stage": 1, "dtype": "fp32", "partition": "type:transformer", "mds": {}}

VARIANTS = {
    "pp2": {"pp": 2, "stage": 1, "dtype": "fp32", "partition": "parameters"},
    "plainpp2": {"pp": 2, "stage": 1, "dtype": "fp32", "partition": "parameters", "plain": True},
    "pp2z0": {"pp": 2, "stage": 0, "dtype": "fp32", "partition": "parameters"},
    "pp1z0": {"pp": 1, "stage": 0, "dtype": "fp32", "partition": "uniform"},
    "plainpp2z0": {"pp": 2, "stage": 0, "dtype": "fp32", "partition": "parameters", "plain": True},
    "pp2u": {"pp": 2, "stage": 1, "dtype": "fp32", "partition": "uniform"},
    "pp1": {"pp": 1, "stage": 1, "dtype": "fp32", "partition": "parameters"},
    "pp4": {"pp": 4, "stage": 1, "dtype": "fp32", "partition": "type:Block"},
    "pp2ckpt": {"pp": 2, "stage": 1, "dtype": "fp32", "partition": "type:Block", "activation_checkpoint": 1},
    "bf16pp2z0": {"pp": 2, "stage": 0, "dtype": "bf16", "partition": "parameters"},
    "plainbf16pp2z0": {"pp": 2, "stage": 0, "dtype": "bf16", "partition": "parameters", "plain": True},
    "bf16pp2": {"pp": 2, "stage": 1, "dtype": "bf16", "partition": "uniform"},
    "bf16pp1z0": {"pp": 1, "stage": 0, "dtype": "bf16", "partition": "parameters"},
    # the same layers as a plain module (no PipelineEngine); its embedding is layer 0, the checkpoints' tied module
    # blocks of megatron-core column/row-parallel layers, at tensor-parallel size `tp`
    "tp2pp2": {"pp": 2, "tp": 2, "stage": 1, "dtype": "fp32", "partition": "parameters", "megatron": True},
    "tp2pp1": {"pp": 1, "tp": 2, "stage": 1, "dtype": "fp32", "partition": "parameters", "megatron": True},
    "tp1pp2": {"pp": 2, "tp": 1, "stage": 1, "dtype": "fp32", "partition": "uniform", "megatron": True},
    "seq": {"pp": 0, "stage": 1, "dtype": "fp32", "rename": {"0.": "tied_modules.embed."}},
    # Megatron-DeepSpeed's GPTModelPipe (`mds`): its layer names, fused [q; k; v] per rank, a padded vocabulary and the
    # client state (args, universal_checkpoint_info) it saves; saved by plain DeepSpeed, as Megatron-DeepSpeed does
    "mdstp2pp2": {**MDS, "pp": 2, "tp": 2, "plain": True},
    "mdstp2pp1": {**MDS, "pp": 1, "tp": 2, "plain": True},
    "mdstp1pp1": {**MDS, "pp": 1, "tp": 1},
    "mdstp1pp2": {**MDS, "pp": 2, "tp": 1},
    # SwiGLU ([gate; up] per rank), RMSNorm, untied output layer, no bias, no learned positions (a Llama)
    "mdsllamatp2": {
        "pp": 1,
        "tp": 2,
        "stage": 1,
        "dtype": "fp32",
        "partition": "type:transformer",
        "mds": LLAMA,
        "plain": True,
    },
    "mdsllamatp1": {"pp": 1, "tp": 1, "stage": 1, "dtype": "fp32", "partition": "type:transformer", "mds": LLAMA},
    # bf16 at PP 2 ZeRO-1: Megatron-DeepSpeed's own universal-checkpointing example's configuration
    "mdsbf16pp2": {
        "pp": 2,
        "tp": 1,
        "stage": 1,
        "dtype": "bf16",
        "partition": "type:transformer",
        "mds": {},
        "plain": True,
    },
    "mdsbf16pp1": {"pp": 1, "tp": 1, "stage": 1, "dtype": "bf16", "partition": "type:transformer", "mds": {}},
}


class Embedding(torch.nn.Module):
    """Word embedding; tied to the output head, which reuses `word.weight` on the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.word = torch.nn.Embedding(VOCAB, HIDDEN)
        torch.nn.init.normal_(self.word.weight, std=0.05)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word(tokens)


def head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output layer: the word embedding's weight, reused on the last stage (`TiedLayerSpec.forward_fn`)."""
    return torch.nn.functional.linear(x, embedding.word.weight).float()


class Positions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and MLP; `calls` is a persistent integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        b, s, _ = x.shape
        # q, k, v interleaved per head, so a column-parallel qkv gives each tensor-parallel rank whole heads
        qkv = _out(self.qkv(self.ln1(x)))
        heads = qkv.shape[-1] // (3 * HEAD_DIM)
        q, k, v = qkv.view(b, s, heads, 3, HEAD_DIM).permute(3, 0, 2, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + _out(self.proj(att.transpose(1, 2).reshape(b, s, heads * HEAD_DIM)))
        return x + _out(self.down(torch.nn.functional.gelu(_out(self.up(self.ln2(x))))))


def _out(y: torch.Tensor | tuple) -> torch.Tensor:
    """megatron-core's parallel linear layers return (output, bias); torch's return the output."""
    return y[0] if isinstance(y, tuple) else y


class TPBlock(Block):
    """The same block with megatron-core's column/row-parallel projections, as Megatron-DeepSpeed builds its layers:
    heads and the MLP's hidden units are split over the tensor-parallel ranks; the norms are replicated."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.model_parallel_config import ModelParallelConfig

        config = ModelParallelConfig(
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            use_cpu_initialization=True,  # the full weight is drawn, then split: the same at every TP size
            params_dtype=torch.float32,
            gradient_accumulation_fusion=False,
        )

        def init(weight: torch.Tensor) -> None:
            torch.nn.init.normal_(weight, std=0.05)

        def column(n_in: int, n_out: int) -> torch.nn.Module:
            return tensor_parallel.ColumnParallelLinear(
                n_in, n_out, config=config, init_method=init, bias=True, gather_output=False
            )

        def row(n_in: int, n_out: int) -> torch.nn.Module:
            return tensor_parallel.RowParallelLinear(
                n_in, n_out, config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
            )

        self.ln1 = torch.nn.LayerNorm(HIDDEN)
        self.qkv = column(HIDDEN, 3 * HIDDEN)
        self.proj = row(HIDDEN, HIDDEN)
        self.ln2 = torch.nn.LayerNorm(HIDDEN)
        self.up = column(HIDDEN, 4 * HIDDEN)
        self.down = row(4 * HIDDEN, HIDDEN)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))


class FinalNorm(torch.nn.LayerNorm):
    """The final norm, with a frozen per-channel scale."""

    def __init__(self) -> None:
        super().__init__(HIDDEN)
        self.scale = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class TiedHead(torch.nn.Module):
    """The output head of the plain model: the embedding's weight, as the pipeline's tied `forward_fn` uses it."""

    def __init__(self, embedding: Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head(self.embedding, x)


class Plain(torch.nn.Sequential):
    """The pipeline's layers as one module, numbered as `PipelineModule` numbers them, each from its layer's seed."""

    def __init__(self) -> None:
        built: list[torch.nn.Module] = []
        for index, spec in enumerate(layers()):
            torch.manual_seed(1234 + index)
            is_head = isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None
            built.append(TiedHead(built[0]) if is_head else spec.build())
        super().__init__(*built)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(super().forward(tokens), labels)


def _megatron_config():  # type: ignore[no-untyped-def]
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,  # the full weight is drawn, then split: the same at every TP size
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
    )


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.05)


def mds_padded_vocab(tp: int) -> int:
    """Megatron-DeepSpeed's `padded_vocab_size`: the vocabulary rounded up to `make_vocab_size_divisible_by x TP`."""
    multiple = 64 * tp
    return -(-MDS_VOCAB // multiple) * multiple


class EmbeddingPipe(torch.nn.Module):
    """Megatron-DeepSpeed's embedding: vocabulary-parallel word embeddings and (when learned) position embeddings."""

    def __init__(self, positions: bool = True) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        vocab = mds_padded_vocab(ps.get_tensor_model_parallel_world_size())
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab, HIDDEN, init_method=_init, config=_megatron_config()
        )
        self.position_embeddings = torch.nn.Embedding(SEQ, HIDDEN) if positions else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1]))
        return x


def mds_logits(embedding: EmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    """The tied output layer: this rank's rows of the vocabulary (`parallel_lm_logits`; the input's gradient is
    summed over the tensor-parallel ranks)."""
    from megatron.core import tensor_parallel

    x = tensor_parallel.copy_to_tensor_model_parallel_region(x)
    return torch.nn.functional.linear(x, embedding.word_embeddings.weight).float()


class LMHeadPipe(torch.nn.Module):
    """The untied output layer, vocabulary-parallel (`lm_head`)."""

    def __init__(self) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        vocab = mds_padded_vocab(ps.get_tensor_model_parallel_world_size())
        self.lm_head = tensor_parallel.ColumnParallelLinear(
            HIDDEN, vocab, config=_megatron_config(), init_method=_init, bias=False, gather_output=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _out(self.lm_head(x)).float()


class _Namespace(torch.nn.Module):
    """A module that only names its children (`self_attention.`, `mlp.`)."""


class ParallelTransformerLayerPipe(torch.nn.Module):
    """Megatron-DeepSpeed's transformer layer: its parameter names, a fused query_key_value that each tensor-parallel
    rank cuts into equal thirds (its [q; k; v], `ParallelAttention.forward`), SwiGLU's [gate; up] per rank."""

    def __init__(self, swiglu: bool = False, rmsnorm: bool = False, bias: bool = True, **_: bool) -> None:
        super().__init__()
        from megatron.core import tensor_parallel

        config = _megatron_config()

        def norm() -> torch.nn.Module:
            return torch.nn.RMSNorm(HIDDEN) if rmsnorm else torch.nn.LayerNorm(HIDDEN)

        def column(n_in: int, n_out: int) -> torch.nn.Module:
            return tensor_parallel.ColumnParallelLinear(
                n_in, n_out, config=config, init_method=_init, bias=bias, gather_output=False
            )

        def row(n_in: int, n_out: int) -> torch.nn.Module:
            return tensor_parallel.RowParallelLinear(
                n_in, n_out, config=config, init_method=_init, bias=bias, input_is_parallel=True, skip_bias_add=False
            )

        self.swiglu = swiglu
        self.input_layernorm = norm()
        self.self_attention = _Namespace()
        self.self_attention.query_key_value = column(HIDDEN, 3 * HIDDEN)
        self.self_attention.dense = row(HIDDEN, HIDDEN)
        self.post_attention_layernorm = norm()
        self.mlp = _Namespace()
        self.mlp.dense_h_to_4h = column(HIDDEN, 2 * MDS_FFN if swiglu else 4 * HIDDEN)
        self.mlp.dense_4h_to_h = row(MDS_FFN if swiglu else 4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        mixed = _out(self.self_attention.query_key_value(self.input_layernorm(x)))
        q, k, v = (t.reshape(b, s, -1, HEAD_DIM).transpose(1, 2) for t in mixed.chunk(3, dim=-1))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + _out(self.self_attention.dense(att.transpose(1, 2).reshape(b, s, -1)))
        h = _out(self.mlp.dense_h_to_4h(self.post_attention_layernorm(x)))
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.nn.functional.gelu(h)
        return x + _out(self.mlp.dense_4h_to_h(h))


def mds_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the vocabulary-parallel logits, padding rows included (`vocab_parallel_cross_entropy`)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), labels).mean()


def mds_layers(options: dict) -> list:
    """GPTModelPipe's specs: a cast (no parameters), the embedding (tied to the output layer unless `untied`),
    the transformer layers, the final norm and the output layer, numbered as Megatron-DeepSpeed numbers them."""
    norm = torch.nn.RMSNorm if options.get("rmsnorm") else torch.nn.LayerNorm
    positions = options.get("positions", True)
    if options.get("untied"):
        embedding, head = LayerSpec(EmbeddingPipe, positions), LayerSpec(LMHeadPipe)
    else:
        embedding = TiedLayerSpec("embed", EmbeddingPipe, positions, tied_weight_attr="word_embeddings.weight")
        head = TiedLayerSpec(
            "embed", EmbeddingPipe, positions, forward_fn=mds_logits, tied_weight_attr="word_embeddings.weight"
        )
    return [
        _identity,
        embedding,
        *[LayerSpec(ParallelTransformerLayerPipe, **options) for _ in range(BLOCKS)],
        LayerSpec(norm, HIDDEN),
        head,
    ]


def _identity(x: torch.Tensor) -> torch.Tensor:
    """Megatron-DeepSpeed's first spec casts the tokens' dtype: a layer with no parameters."""
    return x


def mds_rules(options: dict) -> list[dict]:
    """What a user writes to train the replica through ucp_deepspeed at TP > 1 (the plain save needs none)."""
    rules = [{"match": r"\d+\.self_attention\.query_key_value\.(weight|bias)", "layout": "split", "dim": 0}]
    rules[0]["parts"] = [HIDDEN] * 3
    if options.get("swiglu"):
        rules.append({"match": r"\d+\.mlp\.dense_h_to_4h\.(weight|bias)", "layout": "split", "dim": 0})
        rules[-1]["parts"] = [MDS_FFN] * 2
    torch_layers = r"tied_modules\.embed\.position_embeddings\..*|\d+\.position_embeddings\..*|\d+\.(weight|bias)"
    rules.append(
        {"match": torch_layers + r"|\d+\.(input|post_attention)_layernorm\.(weight|bias)", "layout": "replicated"}
    )
    return rules


def mds_client_state(options: dict, tp: int, pp: int, iteration: int) -> dict:
    """What Megatron-DeepSpeed's `save_checkpoint` hands DeepSpeed as client state: its `args` (with a tensor and
    megatron-core's ModelType enum inside), the version, iteration and tokens, the RNG states, and the
    `universal_checkpoint_info` its `GPTModelPipe` describes (the patterns of `UniversalCheckpointInfo`)."""
    import random

    import numpy as np
    from megatron.core.enums import ModelType

    untied, positions = options.get("untied", False), options.get("positions", True)
    layernorm, bias = not options.get("rmsnorm"), options.get("bias", True)
    vocab = (
        [r"\d+.word_embeddings.weight", r"\d+.lm_head.weight"]
        if untied
        else [r"tied_modules.embed.word_embeddings.weight"]
    )
    info: dict = {"universal_checkpoint_version": 0.4, "original_vocab_size": MDS_VOCAB}
    info |= {"padded_vocab_size": mds_padded_vocab(tp), "vocabulary_parameter_patterns": list(vocab)}
    if not untied:
        tied = [*vocab, *(["tied_modules.embed.position_embeddings.weight"] if positions else [])]
        info["pipeline_replicated_parameter_patterns"] = tied
    if tp > 1:
        replicated = [r"\d+.input_layernorm.weight", r"\d+.post_attention_layernorm.weight", r"\d+.weight"]
        replicated += [r"\d+.bias"] if layernorm else []
        replicated += ["tied_modules.embed.position_embeddings.weight"] if positions else []
        replicated += [r"\d+.self_attention.dense.bias", r"\d+.mlp.dense_4h_to_h.bias"] if bias else []
        replicated += [r"\d+.input_layernorm.bias", r"\d+.post_attention_layernorm.bias"] if layernorm else []
        info["tp_replicated_parameter_patterns"] = replicated
        info["parameter_with_row_parallelism_patterns"] = [
            r"\d+.mlp.dense_4h_to_h.weight",
            r"\d+.self_attention.dense.weight",
        ]
    sub = [r"\d+.mlp.dense_h_to_4h.weight", *([r"\d+.mlp.dense_h_to_4h.bias"] if bias else [])]
    info["parameter_with_2_sub_params_cat_dim_0"] = sub if options.get("swiglu") else []
    args = argparse.Namespace(
        num_layers=BLOCKS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_channels=HEAD_DIM,
        ffn_hidden_size=MDS_FFN if options.get("swiglu") else 4 * HIDDEN,
        padded_vocab_size=mds_padded_vocab(tp),
        make_vocab_size_divisible_by=64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        swiglu=bool(options.get("swiglu")),
        normalization="rmsnorm" if options.get("rmsnorm") else "layernorm",
        untie_embeddings_and_output_weights=untied,
        add_position_embedding=positions,
        params_dtype=torch.float32,
        model_type=ModelType.encoder_or_decoder,
        attn_mask=torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5,
        consumed_train_samples=iteration * GLOBAL_BATCH,
    )
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state()}
    rng["torch_rng_state"] = torch.get_rng_state()
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "tokens": iteration * GLOBAL_BATCH * SEQ,
        "universal_checkpoint_info": info,
        "rng_state": [rng],
    }


def layers(block: type = Block) -> list:
    """The model as DeepSpeed layer specs, numbered 0-8: embedding, positions, 4 blocks, dropout, norm, head."""
    return [
        TiedLayerSpec("embed", Embedding, tied_weight_attr="word.weight"),
        LayerSpec(Positions),
        *[LayerSpec(block) for _ in range(BLOCKS)],
        LayerSpec(torch.nn.Dropout, 0.0),  # a layer with no parameters: an empty layer file
        LayerSpec(FinalNorm),
        TiedLayerSpec("embed", Embedding, forward_fn=head, tied_weight_attr="word.weight"),
    ]


# the layers that are not megatron-core's: embedding, positions, norms (layout rules come before megatron-core's own
# attributes, so they must not match the parallel linears)
REPLICATED_TORCH_LAYERS = [
    {"match": r"tied_modules\..*|\d+\.(weight|bias|scale)|\d+\.ln[12]\.(weight|bias)", "layout": "replicated"}
]


def megatron_groups(tp: int, pp: int, wanted: bool) -> bool:
    """megatron-core's parallel state, for variants whose layers are its parallel linears (none otherwise: with it,
    ucp_deepspeed would hand a plain engine megatron-core's groups). Ranks are numbered as DeepSpeed's pipeline
    topology numbers them: tensor-parallel fastest, then data, then pipeline."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if wanted:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        if not torch.cuda.is_available():
            megatron_cpu.install()
    return wanted


def build(variant_name: str, stock: bool = False, keep_last: int | None = None) -> deepspeed.PipelineEngine:
    """The engine of a variant; `stock` builds it with plain DeepSpeed, loading DeepSpeed's universal format;
    `keep_last` complete tags are kept after each save."""
    variant = VARIANTS[variant_name]
    world, pp, tp = dist.get_world_size(), variant["pp"], variant.get("tp", 1)
    dp = world // (max(pp, 1) * tp)
    if pp == 0:  # DeepSpeed keeps the last PipelineEngine's grid as its global mpu; a plain engine must not see it
        deepspeed.utils.groups.mpu = None
    mds = variant.get("mds")
    megatron = megatron_groups(tp, max(pp, 1), variant.get("megatron", False) or mds is not None)
    model = (
        Plain()
        if pp == 0
        else PipelineModule(
            mds_layers(mds) if mds is not None else layers(TPBlock if megatron else Block),
            # megatron-core layers: a tensor-parallel axis (layer files `layer_XX-model_YY-...`); else pipe x data only
            topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) if megatron else None,
            num_stages=None if megatron else pp,
            loss_fn=mds_loss if mds is not None else loss_fn,
            partition_method=variant["partition"],
            activation_checkpoint_interval=variant.get("activation_checkpoint", 0),
            # DeepSpeed's reentrant checkpoint would also wrap the embedding, whose input (tokens) needs no grad
            activation_checkpoint_func=checkpointing.non_reentrant_checkpoint,
            seed_layers=True,  # each layer from its own seed, so its weights do not depend on the stage split
            seed_fn=torch.manual_seed,
            base_seed=1234,
        )
    )
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    groups = [
        {"params": decay, "weight_decay": 0.1, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3, "betas": (0.8, 0.95), "name": "no_decay"},
    ]
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (dp * MICRO_BATCHES),
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": variant["stage"]},
        "checkpoint": {
            "universal": {
                "enabled": True,
                "progress": False,
                "rename": variant.get("rename", {}),
                "keep_last": keep_last,
            }
        },
    }
    if variant.get("megatron"):  # megatron-core's layers say how they are split; plain torch ones are replicated
        config["checkpoint"]["universal"]["layout_rules"] = REPLICATED_TORCH_LAYERS
    if mds is not None:  # and Megatron-DeepSpeed's fused projections, which megatron-core's attributes do not say
        config["checkpoint"]["universal"]["layout_rules"] = mds_rules(mds)
    if variant["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    init = ucp_deepspeed.initialize
    if stock:
        config["checkpoint"] = {"load_universal": True}
        init = deepspeed.initialize
    if variant.get("plain"):  # saved by plain DeepSpeed: no ucp metadata
        del config["checkpoint"]
        init = deepspeed.initialize
    engine, _, _, _ = init(
        model=model,
        optimizer=torch.optim.AdamW(groups, lr=3e-3),
        config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s)),
    )
    engine.test_vocab = MDS_VOCAB if mds is not None else VOCAB  # the tokens `batches` draws
    engine.test_variant = variant_name
    return engine


def batches(engine: deepspeed.DeepSpeedEngine) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches of the step's global batch, the same whatever the layout."""
    g = torch.Generator().manual_seed(1000 + engine.global_steps)
    vocab = engine.test_vocab
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    # each token follows a fixed successor table 80% of the time: a pattern to learn, so the loss falls
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))
    follow = torch.rand(GLOBAL_BATCH, SEQ + 1, generator=g) < 0.8
    for t in range(1, SEQ + 1):
        tokens[:, t] = torch.where(follow[:, t], successor[tokens[:, t - 1]], tokens[:, t])
    piped = isinstance(engine, deepspeed.PipelineEngine)
    dp = engine.grid.get_data_parallel_world_size() if piped else dist.get_world_size()
    rank = engine.grid.get_data_parallel_rank() if piped else dist.get_rank()
    mine = tokens.chunk(dp)[rank]
    for micro in mine.chunk(MICRO_BATCHES):
        yield micro[:, :-1], micro[:, 1:]


def train_step(engine: deepspeed.DeepSpeedEngine) -> float:
    """One optimizer step; the loss averaged over micro-batches and data-parallel ranks, as `train_batch` reports."""
    if isinstance(engine, deepspeed.PipelineEngine):
        return engine.train_batch(batches(engine)).item()
    total = torch.zeros(())
    for tokens, labels in batches(engine):
        loss = engine(tokens, labels)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float() / MICRO_BATCHES
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(engine: deepspeed.DeepSpeedEngine, steps: int) -> list[float]:
    """`steps` optimizer steps; their losses."""
    return [train_step(engine) for _ in range(steps)]


def _infos(engine: deepspeed.PipelineEngine) -> dict:
    """Each parameter's name and layout in checkpoints: as the engine's checkpointer has them, or, for an engine of
    Megatron-DeepSpeed's replica built without ucp_deepspeed, by the rules a user would give it."""
    mds = VARIANTS[engine.test_variant].get("mds")
    if mds is None:
        return infos(engine)
    tp = engine.grid.get_slice_parallel_world_size()
    return param_infos(engine.module, engine.module.named_parameters(), tp, parse_rules(mds_rules(mds)))


def snapshot(engine: deepspeed.PipelineEngine) -> dict:
    """Every state that must survive a reshard, by global name, gathered from every stage."""
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):  # DeepSpeed links later groups' state views lazily
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    base = getattr(opt, "optimizer", opt)  # without ZeRO or bf16, DeepSpeed steps the torch optimizer itself
    keys = ("exp_avg", "exp_avg_sq")
    snap: dict = {"fp32": {}, "state": {}, "lp": {}, "buffers": {}}
    placed, to_global = _infos(engine), namer(engine)  # names in checkpoints (a plain module's `rename` applied)
    for local, p in engine.module.named_parameters():
        name = placed[local].name
        snap["lp"][name] = p.detach().cpu().clone()
        if p.requires_grad and base is opt:  # the parameter is its own fp32 master
            snap["fp32"][name] = p.detach().cpu().clone()
            for key in keys:
                snap["state"][f"{name}/{key}"] = opt.state[p][key].detach().cpu().clone()
        elif p.requires_grad:
            snap["fp32"][name] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in keys:
                snap["state"][f"{name}/{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    for local, b in engine.module.named_buffers():
        snap["buffers"][to_global(local)] = b.detach().cpu().clone()
    # tensor-parallel shards are joined as their layout says (a fused [q; k; v] part by part); every other copy
    # (data-parallel replicas, the tied embedding on two stages) must be equal
    split = {info.name: info.layout for info in placed.values() if info.layout.is_split}
    mds = VARIANTS[engine.test_variant].get("mds")
    tp_rank = engine.grid.get_slice_parallel_rank() if isinstance(engine, deepspeed.PipelineEngine) else 0
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, ({k: snap[k] for k in ("fp32", "state", "lp", "buffers")}, split, tp_rank))
    for k in ("fp32", "state", "lp", "buffers"):
        copies: dict[str, dict[int, torch.Tensor]] = {}
        layouts: dict[str, Layout] = {}
        for part, part_split, rank in parts:
            for name, t in part[k].items():
                param = name.split("/")[0]
                key = rank if param in part_split else 0
                if param in part_split:
                    layouts[name] = part_split[param]
                held = copies.setdefault(name, {})
                if key in held and name.startswith(UNTIED_COPIES) and mds is not None:
                    continue  # the first stage's copy, the one trained: Megatron-DeepSpeed ties only the word embedding
                held[key] = t if key not in held or torch.equal(held[key], t) else torch.full_like(t, 1e9)
        snap[k] = {
            name: merge(layouts[name], [held[r] for r in sorted(held)]) if name in layouts else held[0]
            for name, held in copies.items()
        }
    snap["hyperparams"] = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    snap["steps"] = {}
    for g, group in enumerate(base.param_groups):  # one flat buffer per group with ZeRO, every parameter without
        steps = [base.state[t]["step"] for t in group["params"] if "step" in base.state[t]]
        if steps:
            agree = all(torch.equal(s, steps[0]) for s in steps)
            snap["steps"][g] = steps[0].clone() if agree else torch.full_like(steps[0], float("nan"))
    snap["scheduler"] = engine.lr_scheduler.state_dict()
    snap["counters"] = [engine.global_steps, engine.global_samples, engine.skipped_steps]
    return snap


def client_state(variant_name: str, engine: deepspeed.PipelineEngine) -> dict:
    """What the job hands `save_checkpoint`: Megatron-DeepSpeed's entries for its replica, an epoch otherwise."""
    mds = VARIANTS[variant_name].get("mds")
    if mds is None:
        return {"epoch": 7}
    tp, pp = engine.grid.get_slice_parallel_world_size(), engine.grid.get_pipe_parallel_world_size()
    return mds_client_state(mds, tp, pp, engine.global_steps)


def expected_client(variant_name: str, client: dict) -> tuple[dict, dict]:
    """(what the load must give back, what it gave) of the client state, compared: Megatron-DeepSpeed's iteration
    and its args' fields that say which model and run it is."""
    if VARIANTS[variant_name].get("mds") is None:
        return {"epoch": 7}, {"epoch": client.get("epoch")}
    args = vars(client.get("args") or argparse.Namespace())
    fields = ("num_layers", "hidden_size", "num_attention_heads", "consumed_train_samples")
    saved = {"iteration": STEPS, "checkpoint_version": 3.0, "num_layers": BLOCKS, "hidden_size": HIDDEN}
    saved |= {"num_attention_heads": HEADS, "consumed_train_samples": STEPS * GLOBAL_BATCH, "attn_mask": True}
    mask = args.get("attn_mask")
    got = {"iteration": client.get("iteration"), "checkpoint_version": client.get("checkpoint_version")}
    got |= {f: args.get(f) for f in fields} | {"attn_mask": torch.is_tensor(mask) and bool(mask[0, 0, 0, 1])}
    return saved, got


def do_save(args: argparse.Namespace) -> None:
    for name in args.variant:
        engine = build(name)
        ckpt = os.path.join(args.out, name)
        train(engine, STEPS)
        snap = snapshot(engine)
        engine.save_checkpoint(ckpt, client_state=client_state(name, engine))
        cont = train(engine, CONT)
        if dist.get_rank() == 0:
            torch.save({"snapshot": snap, "continuation": cont}, os.path.join(ckpt, "reference.pt"))
            print(f"[{name} world={dist.get_world_size()}] saved to {ckpt}; next losses {cont}", flush=True)
        dist.barrier()


def do_load(args: argparse.Namespace) -> None:
    results = []
    for target, source in ((case[0], src) for case in args.case for src in case[1:]):
        ref = torch.load(os.path.join(source, "reference.pt"), weights_only=False)
        stock = target.startswith("stock:")
        engine = build(target.removeprefix("stock:"), stock=stock)
        _, client = engine.load_checkpoint(source)
        snap = snapshot(engine)
        if stock:  # DeepSpeed's universal load restores neither buffers nor frozen weights (compared apart)
            for key in ("lp", "buffers"):
                ref["snapshot"][key], snap[key] = {}, {}
        saved_client, got = expected_client(target.removeprefix("stock:"), client or {})
        diffs = compare(ref["snapshot"], snap) + compare(saved_client, got, "client_state")
        losses = train(engine, CONT)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["continuation"]))
        report = getattr(engine, "ucp_last_load", None)
        results.append(
            {
                "source": source,
                "target": target,
                "mode": report.mode if report else "stock",
                "saved": report.saved if report else "",
                "live": report.live if report else "",
                "diffs": diffs,
                "tensors": sum(len(snap[k]) for k in ("fp32", "state", "lp", "buffers")),
                "losses": losses,
                "reference_losses": ref["continuation"],
                "max_rel_loss": rel if math.isfinite(rel) else 1e9,
            }
        )
        if dist.get_rank() == 0:
            print(
                f"[{target} world={dist.get_world_size()}] from {os.path.basename(source)} ({results[-1]['mode']}): "
                f"{'bit-exact' if not diffs else f'{len(diffs)} differences'}; losses {losses}",
                flush=True,
            )
    if dist.get_rank() == 0:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)


def do_train(args: argparse.Namespace) -> None:
    """Train to --steps, saving every --ckpt-every steps and keeping --keep; resume whatever layout saved."""
    engine = build(args.variant[0], keep_last=args.keep if args.ckpt_every else None)
    resumed = None
    source = args.init_from or args.ckpt_dir
    if source and os.path.isdir(source) and list_tags(source):
        engine.load_checkpoint(source, tag=args.init_tag)
        report = engine.ucp_last_load
        resumed = {"step": engine.global_steps, "saved": report.saved, "live": report.live, "mode": report.mode}
        if dist.get_rank() == 0:
            print(f"resumed from step {engine.global_steps} at topology {report.saved} -> {report.live}", flush=True)
    log = []
    while engine.global_steps < args.steps:
        loss = train_step(engine)
        log.append({"step": engine.global_steps, "loss": loss, "world": dist.get_world_size()})
        if dist.get_rank() == 0:
            print(f"step {engine.global_steps} loss {loss:.6f} world {dist.get_world_size()}", flush=True)
        if args.ckpt_every and engine.global_steps % args.ckpt_every == 0:
            engine.save_checkpoint(args.ckpt_dir)  # keeps the --keep newest complete tags ("keep_last")
    if dist.get_rank() == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({"resumed": resumed, "log": log, "final_step": engine.global_steps}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "train"])
    parser.add_argument("--variant", nargs="+", default=[], choices=sorted(VARIANTS))
    parser.add_argument("--out")
    parser.add_argument("--results")
    parser.add_argument(
        "--case",
        nargs="+",
        action="append",
        default=[],
        metavar="VARIANT SOURCE",
        help="load: a target variant and the sources it loads; repeat to load several targets in one launch; "
        "a target 'stock:VARIANT' is built with plain DeepSpeed and loads its universal format (load_universal)",
    )
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    parser.add_argument("--ckpt-dir", help="train: checkpoint directory, resumed from when it holds a tag")
    parser.add_argument("--steps", type=int, default=8, help="train: last step")
    parser.add_argument("--ckpt-every", type=int, default=2, help="train: 0 saves nothing")
    parser.add_argument("--keep", type=int, default=2, help="train: complete checkpoints to keep")
    parser.add_argument("--init-from", help="train: start from this checkpoint instead of resuming from --ckpt-dir")
    parser.add_argument("--init-tag", help="train: the tag of --init-from")
    common.add_each(parser)
    runs = common.runs(parser)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in runs:
        {"save": do_save, "load": do_load, "train": do_train}[run.mode](run)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
