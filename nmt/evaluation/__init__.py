"""Evaluation: BLEU and chrF by source length, paired significance, and the other analyses of a test."""
