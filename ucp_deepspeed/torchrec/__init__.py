"""Universal checkpoints of TorchRec `DistributedModelParallel` models, with Check-N-Run's differential and quantized
saves: a job saved at one world size and sharding plan resumes at another (`TorchRecCheckpointer`)."""

from __future__ import annotations

from ucp_deepspeed.torchrec.checkpointer import Resumed, TorchRecCheckpointer

__all__ = ["Resumed", "TorchRecCheckpointer"]
