"""Where each element of a parameter lives: ZeRO fragments of flat partitions, tensor-parallel layouts."""
