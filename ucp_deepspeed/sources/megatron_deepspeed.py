"""Layouts of a checkpoint Megatron-DeepSpeed saved, from what it writes beside DeepSpeed's own entries.

Megatron-DeepSpeed's GPT models (`GPTModelPipe`, and `GPTModel` without a pipeline) put a `universal_checkpoint_info`
record into every model-states file: name patterns per category (replicated over tensor-parallel ranks, row-parallel,
vocabulary, SwiGLU's two sub-parameters, pipeline-replicated) with `original_vocab_size` and `padded_vocab_size`,
and the job's `args` (an `argparse.Namespace`) in the client state. Two things the record does not say are read
here too:

- the fused `self_attention.query_key_value` projection, which no category names: Megatron-DeepSpeed lays it out
  `[q; k; v]` on each tensor-parallel rank (since its #441, `ParallelAttention.forward` takes equal thirds, or
  `num_attention_heads` and `num_key_value_heads` of `kv_channels` each with GQA), so the full tensor is each part
  joined over the ranks, not the ranks' slices joined on dim 0 as DeepSpeed's converter joins them;
- the vocabulary's padding rows (`padded_vocab_size` past `original_vocab_size`), which a Megatron-DeepSpeed job
  trains like any other row: they are kept, so a resume that pads to the same size continues exactly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.geometry.layout import Layout
from ucp_deepspeed.sources.autotp import KNOWN_VERSION, Shape, category_layout

_QKV = re.compile(r"(.*\.)?self_attention\.query_key_value\.(weight|bias)")
_PATTERNS = (
    "tp_replicated_parameter_patterns",
    "parameter_with_row_parallelism_patterns",
    "vocabulary_parameter_patterns",
    "parameter_with_2_sub_params_cat_dim_0",
    "pipeline_replicated_parameter_patterns",
    "parameter_to_average_patterns",
)


def is_megatron_deepspeed_record(info: Any, args: Any) -> bool:
    """Whether a model-states file's `universal_checkpoint_info` is Megatron-DeepSpeed's: its vocabulary sizes or
    name categories, beside the `args` Megatron-DeepSpeed saves (AutoTP's record has neither args nor sizes)."""
    return (
        isinstance(info, dict)
        and args is not None
        and ("original_vocab_size" in info or any(key in info for key in _PATTERNS))
        and "affine_map" not in info
    )


def _qkv_parts(name: str, full: int, args: Any, path: str) -> tuple[int, ...]:
    """The sizes of q, k and v in a fused projection of `full` rows: from the saved args when they give the heads,
    else equal thirds (what `ParallelAttention` takes without GQA)."""
    heads, groups, channels = (
        getattr(args, k, None) for k in ("num_attention_heads", "num_key_value_heads", "kv_channels")
    )
    if isinstance(heads, int) and isinstance(channels, int):
        kv = (groups if isinstance(groups, int) and groups else heads) * channels
        parts = (heads * channels, kv, kv)
        if sum(parts) == full:
            return parts
    if full % 3 == 0:
        return (full // 3,) * 3
    raise CheckpointError(
        path, f"'{name}': {full} rows are not q, k and v of the saved args' heads, nor three equal parts"
    )


def megatron_deepspeed_layouts(
    info: Mapping[str, Any], shapes: Sequence[Mapping[str, Shape]], args: Any, path: str
) -> dict[str, Layout]:
    """Each parameter's tensor-parallel layout from Megatron-DeepSpeed's record, its args and the local shapes of
    tensor-parallel ranks 0..tp-1 of one pipeline stage.

    Args:
        info: the `universal_checkpoint_info` of a model-states file.
        shapes: per tensor-parallel rank, the local shape of every parameter it saved.
        args: the saved `args` (Megatron-DeepSpeed's `argparse.Namespace`, read as a namespace).
        path: the file the record came from, for errors.
    Returns:
        name -> Layout of every parameter rank 0 saved.
    """
    version = float(info.get("universal_checkpoint_version", 0.0))
    if version > KNOWN_VERSION:
        raise CheckpointError(path, f"universal checkpoint record version {version}; this reader knows {KNOWN_VERSION}")
    tp = len(shapes)
    out = {}
    for name in shapes[0]:
        local = [tuple(s[name]) for s in shapes if name in s]
        if len(local) != tp:
            raise CheckpointError(path, f"'{name}' is saved by {len(local)} of {tp} tensor-parallel ranks")
        fused = None
        if _QKV.fullmatch(name) and tp > 1:
            fused = Layout("split", 0, parts=_qkv_parts(name, local[0][0] * tp, args, path))
        out[name] = category_layout(info, name, local, version, path, fused=fused, keep_padding=True)
    return out
