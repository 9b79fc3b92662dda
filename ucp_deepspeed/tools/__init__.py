"""The `ucp` command: convert, inspect, verify, compare and the Hugging Face bridges."""
