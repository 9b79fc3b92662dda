"""Conversion: plan what each universal file needs from the rank files, then stream it there."""

from ucp_deepspeed.convert.core import convert

__all__ = ["convert"]
