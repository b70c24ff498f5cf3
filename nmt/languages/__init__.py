"""Language facts: how each language is written (its source-length unit and BLEU tokenizer) and
the target-language tags of multilingual models."""
