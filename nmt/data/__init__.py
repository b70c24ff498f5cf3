"""Data: loading parallel text, SentencePiece, length-bucketed token batches."""
