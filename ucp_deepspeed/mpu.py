"""Deprecated: `ucp_deepspeed.mpu` was the home of the megatron-core adapter; use `ucp_deepspeed.MegatronMpu` and
`ucp_deepspeed.register_megatron_experts`. This alias warns and goes in the next release."""

from ucp_deepspeed import _moved

__getattr__ = _moved(__name__, ("MegatronMpu", "register_megatron_experts"))
