"""On-disk IO, the lowest layer: CRC-32 checksums, a pickle reader that runs no code, the lazy torch-zip reader."""
