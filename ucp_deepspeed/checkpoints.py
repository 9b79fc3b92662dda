"""Deprecated: `ucp_deepspeed.checkpoints` was the home of the tag helpers; use `ucp_deepspeed.resume_tag` and
`ucp_deepspeed.prune`. This alias warns and goes in the next release."""

from ucp_deepspeed import _moved

__getattr__ = _moved(__name__, ("resume_tag", "prune"))
