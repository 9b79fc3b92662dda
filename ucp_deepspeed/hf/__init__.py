"""Hugging Face transformers checkpoints in and out of the universal format."""
