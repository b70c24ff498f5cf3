"""Checkpoint and release files: their format, opening them for use, releases, resuming, fine-tuning."""
