"""Check-N-Run (NSDI'22) differential and quantized checkpoints, plugged into the runtime as an extension."""
