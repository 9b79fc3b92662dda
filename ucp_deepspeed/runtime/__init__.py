"""The live side: capture an engine's state at save, restore it at load, and wire both into DeepSpeed."""
