"""Models: the encoder/decoder pairs, plain PyTorch that reads like the papers."""
