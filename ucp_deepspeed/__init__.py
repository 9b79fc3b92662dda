"""Universal Checkpointing for DeepSpeed: save distributed, resume on any DP size or ZeRO stage."""
__version__ = "0.1.0"

from ucp_deepspeed.config import UniversalConfig  # noqa: E402
from ucp_deepspeed.convert import convert  # noqa: E402
from ucp_deepspeed.engine import attach, initialize  # noqa: E402
from ucp_deepspeed.errors import CheckpointError  # noqa: E402
from ucp_deepspeed.universal import UniversalCheckpoint  # noqa: E402

__all__ = ["initialize", "attach", "convert", "UniversalCheckpoint", "UniversalConfig", "CheckpointError",
           "__version__"]
