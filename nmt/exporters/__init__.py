"""Exporters: a trained model written in another toolkit's format."""
