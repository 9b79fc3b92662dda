"""Import a Hugging Face `transformers` GPT-2, Llama or Mixtral folder as a weights-only universal checkpoint.

The inverse of `hf.export`, from the same name table (`hf/names.py`) read from the `transformers`
side: names go back to megatron-core's global ones, q/k/v are fused into `linear_qkv` by query
group, gate/up into SwiGLU's `linear_fc1`, and GPT-2's `Conv1D` weights are transposed. The result
holds only fp32 weights (`"weights_only": true` in the manifest, step counters at zero, no
optimizer state), so `load_checkpoint` starts training from it with a fresh optimizer at any
DP/TP/PP/EP layout. GPT-2 folders exported from a grouped-query model repeat each
key/value head; `num_kv_heads` folds them back after checking that the copies are identical.
Tensors are read lazily from the safetensors shards and written one parameter file at a time.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable

import torch
from safetensors import safe_open
from tqdm import tqdm

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import Manifest, ParamRecord
from ucp_deepspeed.format.metadata import FP32
from ucp_deepspeed.format.paths import check_output
from ucp_deepspeed.format.universal import BUFFERS, STATE, param_file, write_manifest, write_object, write_tensors
from ucp_deepspeed.hf.names import Heads, from_hf, links
from ucp_deepspeed.version import __version__


def _reader(hf_dir: str) -> Callable[[str], torch.Tensor]:
    """read(name) over a single-file or sharded safetensors folder."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = json.load(f)["weight_map"]
    else:
        single = os.path.join(hf_dir, "model.safetensors")
        if not os.path.isfile(single):
            raise CheckpointError(hf_dir, "no model.safetensors or model.safetensors.index.json")
        with safe_open(single, framework="pt") as f:
            files = {k: "model.safetensors" for k in f.keys()}

    def read(name: str) -> torch.Tensor:
        if name not in files:
            raise CheckpointError(hf_dir, f"tensor {name} is missing")
        with safe_open(os.path.join(hf_dir, files[name]), framework="pt") as f:
            return f.get_tensor(name).to(torch.float32)

    return read


def import_hf(hf_dir: str, out: str, num_kv_heads: int | None = None, progress: bool = True) -> str:
    """Write a weights-only universal checkpoint of a `transformers` folder; returns `out`."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    kind = config.get("model_type")
    if kind not in ("gpt2", "llama", "mixtral"):
        raise CheckpointError(os.path.join(hf_dir, "config.json"), f"model_type {kind!r} is not gpt2, llama or mixtral")
    if not config.get("tie_word_embeddings", True):
        raise CheckpointError(
            os.path.join(hf_dir, "config.json"),
            "untied output layers are not supported: the "
            "megatron-core models here share the embedding with the output layer",
        )
    read = _reader(hf_dir)
    if kind == "gpt2":
        heads, layers = Heads(config["n_head"], num_kv_heads or config["n_head"]), config["n_layer"]
    else:
        heads = Heads(config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"])
        layers = config["num_hidden_layers"]
    table = links(kind, layers, config.get("num_local_experts", 0) if kind == "mixtral" else 0)
    makers = {link.mcore: functools.partial(from_hf, link, read, heads) for link in table}
    check_output(out, [hf_dir])
    if os.path.isdir(out) and os.listdir(out):
        raise CheckpointError(out, "exists and is not empty; refusing to write into it")
    records, params = [], dict[str, ParamRecord]()
    for name, make in tqdm(makers.items(), desc="ucp import-hf", disable=not progress):
        tensor = make().contiguous()
        records.append(write_tensors(out, param_file(name), {FP32: tensor}))
        params[name] = ParamRecord(tuple(tensor.shape), "float32", 0, True, param_file(name), (FP32,))
    records.append(write_tensors(out, BUFFERS, {}))
    records.append(write_object(out, STATE, {"lr_scheduler": None, "client_state": {}, "optimizer_wrapper": {}}))
    write_manifest(
        out,
        Manifest(
            created_by={
                "ucp_deepspeed": __version__,
                "torch": torch.__version__,
                "transformers_config": config.get("transformers_version"),
            },
            source={
                "path": os.path.abspath(hf_dir),
                "tag": None,
                "fingerprint": [],
                "versions": {},
                "topology": {
                    "dp": 1,
                    "zero_stage": 0,
                    "dtype": "fp32",
                    "tp": 1,
                    "pp": 1,
                    "ep": 1,
                    "optimizer": f"none (Hugging Face {kind} import)",
                },
            },
            counters={"global_steps": 0, "global_samples": 0, "skipped_steps": 0},
            param_groups=(),
            params=params,
            buffers={},
            extra={
                "weights_only": True,
                "notes": [f"weights of a transformers {kind} model; optimizer state starts fresh"],
            },
        ),
        records,
    )
    return out
