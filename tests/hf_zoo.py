"""Tiny `transformers` models shaped like the ones people fine-tune: real configs, scaled down, random weights.

Each keeps its model's distinguishing choices (GQA ratio, untied head, biases, RoPE theta and
scaling, sliding window, experts) at sizes a CPU test can run; none is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 70
SEQ = 8
TOKENS_SEED = 99

ZOO: dict[str, dict[str, Any]] = {
    # GPT-2: MHA, learned positions, gelu_new, biases everywhere, tied; weights large enough that the MLP's inputs
    # reach where exact GELU and its tanh approximation differ
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 16,
        "initializer_range": 0.2,
    },
    # Llama 3.1 8B: untied, GQA 4:1, theta 5e5, llama3 RoPE scaling, ffn 3.5x
    "llama3": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 224,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # a Llama with attention and MLP biases, tied, multi-head
    "llama-bias": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 64,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
    },
    # Mistral 7B v0.1: untied, GQA 4:1, sliding window (4 here, inside the 8-token test sequences)
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 224,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "sliding_window": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
    },
    # Qwen2 0.5B: tied, GQA, q/k/v biases, theta 1e6, eps 1e-6
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
    },
    # Mixtral 8x7B: untied, GQA 4:1, top-2 of 4 experts (8 there), theta 1e6
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
    },
}


def tokens() -> torch.Tensor:
    """The fixed tokens every logits comparison runs on."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(TOKENS_SEED))


def make(name: str, out: Path, seed: int = 0, max_shard_size: str = "40KB", dtype: torch.dtype = torch.float32) -> Path:
    """Save a randomly initialised model of `ZOO[name]` as `transformers` does (sharded safetensors and an index),
    with its logits on `tokens()` in `out/logits.pt`."""
    import transformers

    fields = dict(ZOO[name])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), vocab_size=VOCAB, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a dropped or misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.to(dtype).save_pretrained(out, max_shard_size=max_shard_size)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens()).logits
    torch.save({"tokens": tokens(), "logits": logits}, out / "logits.pt")
    return out
