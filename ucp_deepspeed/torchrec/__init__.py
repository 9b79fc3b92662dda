"""Universal checkpoints of TorchRec `DistributedModelParallel` models, with Check-N-Run's differential and quantized
saves: a job saved at one world size and sharding plan resumes at another (`TorchRecCheckpointer`); TorchRec's own
`dcp.save` comes in (`import_dcp`) and goes back out for `dcp.load` at another plan (`export_dcp`)."""

from __future__ import annotations

from ucp_deepspeed.torchrec.checkpointer import Resumed, TorchRecCheckpointer
from ucp_deepspeed.torchrec.dcp import export_dcp, import_dcp

__all__ = ["Resumed", "TorchRecCheckpointer", "export_dcp", "import_dcp"]
