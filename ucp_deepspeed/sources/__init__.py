"""Readers for DeepSpeed's native on-disk layout: rank files, model states, metadata."""

from ucp_deepspeed.format.paths import list_tags
from ucp_deepspeed.sources.native import NativeCheckpoint, resolve_tag

__all__ = ["NativeCheckpoint", "list_tags", "resolve_tag"]
