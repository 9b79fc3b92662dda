"""What each parameter is called across the whole model: layout rules, megatron-core names, experts."""
