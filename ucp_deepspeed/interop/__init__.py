"""The hub between training stacks: foreign checkpoint formats read into the universal format and written from it.

- `deepspeed`: DeepSpeed's own universal layout (`ds_to_universal`), both ways.
- `dcp`: PyTorch Distributed Checkpoint folders (`dcp.save` of FSDP2 / torchtitan jobs), both ways.
- `megatron`: megatron-core's own `dist_checkpointing` folders (the `torch_dist` backend), both ways.

Each registers its folders as a foreign format, so `load_checkpoint` of such a folder imports it first.
"""

from ucp_deepspeed.interop.dcp import export_dcp, import_dcp
from ucp_deepspeed.interop.deepspeed import export_deepspeed, import_deepspeed
from ucp_deepspeed.interop.megatron import export_megatron, import_megatron

__all__ = ["export_dcp", "export_deepspeed", "export_megatron", "import_dcp", "import_deepspeed", "import_megatron"]
