"""The special token ids every vocabulary has (SentencePiece models are trained with them), in a
module that models, decoding and data may all import."""

PAD, UNK, BOS, EOS = 0, 1, 2, 3
NEVER = -1e4  # the logit of an id kept out of the softmax (never generated), finite in fp16 and bf16
