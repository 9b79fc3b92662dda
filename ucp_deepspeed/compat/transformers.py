"""The reach into transformers and accelerate: a Hugging Face model's config, and the two per-process restores
`install()` widens to other world sizes (the Trainer's RNG restore and `Accelerator.load_state`'s).

Neither library is imported unless already loaded or asked for, so the `ucp` command imports none of them.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NamedTuple


def hf_model_config(module: Any) -> dict[str, Any] | None:
    """The `config.json` contents of a `transformers` model (what `save_pretrained` writes), None for other modules."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        return None
    config: dict[str, Any] = json.loads(module.config.to_json_string(use_diff=False))
    return config


class Hook(NamedTuple):
    """A function another library looks up by name when it runs: the object that holds it and the attribute name,
    so `install()` can replace it there and `uninstall()` put it back."""

    owner: Any
    name: str


def trainer_rng_restore() -> Hook | None:
    """The HF Trainer's per-process RNG restore (a private method); None without transformers."""
    try:
        import transformers.trainer as trainer
    except ImportError:
        return None
    return Hook(owner=trainer.Trainer, name="_load_rng_state")


def accelerate_state_restore() -> Hook | None:
    """The function `Accelerator.load_state` calls by its module-level name; None without accelerate."""
    try:
        import accelerate.accelerator as accelerator
    except ImportError:
        return None
    return Hook(owner=accelerator, name="load_accelerator_state")
