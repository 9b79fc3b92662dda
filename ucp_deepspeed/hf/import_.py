"""Import a Hugging Face `transformers` GPT-2, Llama, Mistral, Qwen2 or Mixtral folder as a weights-only universal
checkpoint.

The config is read by `transformers`' own config class and mapped to the megatron-core model that
computes the same function (`hf/models.py`), refusing by name any field that model cannot carry;
the manifest records that model and the original `config.json`. Every tensor of the folder must
have a place in the name table (`hf/names.py`), read from the `transformers` side: names go back
to megatron-core's global ones, q/k/v are fused into `linear_qkv` by query group, gate/up into
SwiGLU's `linear_fc1`, and GPT-2's `Conv1D` weights are transposed. The result
holds only fp32 weights (`"weights_only": true` in the manifest, step counters at zero, no
optimizer state), so `load_checkpoint` starts training from it with a fresh optimizer at any
DP/TP/PP/EP layout. GPT-2 folders exported from a grouped-query model repeat each
key/value head; `num_kv_heads` folds them back after checking that the copies are identical.
Tensors are read lazily from the safetensors shards and written one parameter file at a time.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Counters, SourceRecord, recorded_sections
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.paths import check_output
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.format.writer import TrainingState, UniversalWriter
from ucp_deepspeed.hf.models import read_config, spec_of
from ucp_deepspeed.hf.names import Heads, from_hf, hf_shapes, links
from ucp_deepspeed.io import storage as st

_DERIVED = re.compile(r"(.*\.)?(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)")
"""Buffers older `transformers` versions saved that are computed from the config, not learned."""
_BASE_PREFIXES = ("transformer.", "model.")
"""What a `*ForCausalLM` adds to its base model's names; files saved from the base model (the Hub's own GPT-2)
lack it."""


class _Folder:
    """The tensors of a single-file or sharded safetensors folder, read lazily by `transformers`' causal-LM name."""

    def __init__(self, hf_dir: str, expected: set[str]):
        self.root = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    files = json.load(f)["weight_map"]
                if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                    raise ValueError("weight_map is not an object of file names")
            except (OSError, KeyError, ValueError) as exc:
                raise CheckpointError(index, f"is not a safetensors index ({exc!r})") from None
            for file in set(files.values()):
                if os.path.basename(file) != file:
                    raise CheckpointError(index, f"shard {file!r} is not a file name in the folder")
        else:
            single = os.path.join(hf_dir, "model.safetensors")
            if not os.path.isfile(single):
                raise CheckpointError(hf_dir, "no model.safetensors or model.safetensors.index.json")
            with safe_open(single, framework="pt") as f:
                files = {k: "model.safetensors" for k in f.keys()}
        self.stored: dict[str, str] = files
        self.names = {self._causal(k, expected): k for k in files}  # causal-LM name -> name in the file

    @staticmethod
    def _causal(stored: str, expected: set[str]) -> str:
        """The causal-LM name of a stored one: a base model's file (no `transformer.` prefix) maps onto `expected`."""
        if stored in expected:
            return stored
        return next((f"{p}{stored}" for p in _BASE_PREFIXES if f"{p}{stored}" in expected), stored)

    def _open(self, name: str) -> tuple[Any, str]:
        if name not in self.names:
            raise CheckpointError(self.root, f"tensor {name} is missing")
        stored = self.names[name]
        return safe_open(os.path.join(self.root, self.stored[stored]), framework="pt"), stored

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the file's header."""
        handle, stored = self._open(name)
        with handle as f:
            return tuple(f.get_slice(stored).get_shape())

    def read(self, name: str) -> torch.Tensor:
        """One tensor, upcast to fp32 (exact from bf16 and fp16)."""
        handle, stored = self._open(name)
        with handle as f:
            return f.get_tensor(stored).to(torch.float32)

    def check_all_used(self, used: set[str], tied_to: str | None) -> None:
        """Refuse tensors the name table has no place for: importing them would silently drop them."""
        for name in sorted(set(self.names) - used):
            if _DERIVED.fullmatch(name):
                continue
            if name == "lm_head.weight" and tied_to is not None:
                if torch.equal(self.read(name), self.read(tied_to)):
                    continue
                raise CheckpointError(
                    self.root, f"lm_head.weight differs from {tied_to}, but tie_word_embeddings is true"
                )
            raise CheckpointError(
                self.root, f"tensor {name} has no place in the megatron-core model; it would be dropped"
            )


def import_hf(hf_dir: str, out: str, num_kv_heads: int | None = None, progress: bool = True) -> str:
    """Write a weights-only universal checkpoint of a `transformers` folder; returns `out`.

    Args:
        hf_dir: a folder with `config.json` and `model.safetensors` (or shards and their index); a URL of one on an
            object store is fetched into a temporary folder first, as `from_pretrained` fetches from the Hub.
        out: the universal folder to create (must not exist or be empty).
        num_kv_heads: for a GPT-2 folder exported from a grouped-query model, the key/value heads to fold back to.
    Returns:
        `out`, whose manifest records the megatron-core model (`model`) and the original `config.json`.
    Example:
        >>> import_hf("Llama-3.2-1B", "llama.universal")
        >>> # build the model from ModelSpec.decode(manifest["model"]) with hf.models.megatron_kwargs, then
        >>> engine.load_checkpoint("llama.universal")
    """
    if st.is_url(hf_dir):
        with tempfile.TemporaryDirectory(prefix="ucp_import_hf_") as local:
            for rel in st.find(hf_dir):
                st.copy(st.join(hf_dir, rel), os.path.join(local, rel))
            return _import(local, st.normalize(hf_dir), out, num_kv_heads, progress)
    return _import(hf_dir, os.path.abspath(hf_dir), out, num_kv_heads, progress)


def _import(hf_dir: str, origin: str, out: str, num_kv_heads: int | None, progress: bool) -> str:
    config, raw = read_config(hf_dir)
    arch, spec = spec_of(config, os.path.join(hf_dir, "config.json"), num_kv_heads)
    heads = Heads(spec.num_attention_heads, spec.num_query_groups)
    table = links(arch, spec)
    folder = _Folder(hf_dir, {n for link in table for n in link.hf})
    folder.check_all_used({n for link in table for n in link.hf}, None if not spec.tied else table[0].hf[0])
    for link in table:  # every shape, before anything is written
        for name, shape in zip(link.hf, hf_shapes(link, heads)):
            if folder.shape(name) != shape:
                raise CheckpointError(
                    hf_dir, f"{name} has shape {folder.shape(name)}; the config says {shape} (for {link.mcore})"
                )
    check_output(out, [hf_dir, origin])
    if st.isdir(out) and st.listdir(out):
        raise CheckpointError(out, "exists and is not empty; refusing to write into it")
    with UniversalWriter(root=out) as writer:
        for link in tqdm(table, desc="ucp import-hf", disable=not progress):
            tensor = from_hf(link, folder.read, heads).contiguous()
            if tuple(tensor.shape) != link.shape:
                raise CheckpointError(
                    hf_dir, f"{', '.join(link.hf)} make {link.mcore} of shape {tuple(tensor.shape)}, not {link.shape}"
                )
            writer.add_param(link.mcore, {FP32: tensor}, group=0)
        writer.add_buffers({})
        writer.set_state(TrainingState())
        writer.finish(
            source=SourceRecord(
                origin,
                None,
                Topology(dp=1, zero_stage=0, dtype="fp32", optimizer=f"none (Hugging Face {arch} import)"),
                {"transformers": str(raw["transformers_version"])} if raw.get("transformers_version") else {},
            ),
            counters=Counters(),
            extra={
                "weights_only": True,
                "notes": [f"weights of a transformers {arch} model; optimizer state starts fresh"],
                **recorded_sections(spec, raw),
            },
        )
    return out
