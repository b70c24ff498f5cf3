"""What a translator returns, written: scores a model gives no probability to (-inf, NaN) are
null in every JSON output (translate.py's jsonl rows, score rows, the server's answers), which
strict JSON readers accept; TSV keeps the number as text."""

from __future__ import annotations

import json
import math

import pytest

from nmt.inference.translations import Hypothesis, Translation, response_item, score_row, translation_rows


def strict(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))


def test_non_finite_scores_are_null_in_json_and_text_in_tsv():
    forced = Translation([Hypothesis("a b", -math.inf, -math.inf), Hypothesis("a", math.nan, -1.23456)])
    assert strict(translation_rows(7, forced, "jsonl")[0]) == {"line": 7, "text": "a b", "score": None}
    assert [strict(r) for r in translation_rows(7, forced, "jsonl", nbest=2)] == [
        {"line": 7, "rank": 1, "score": None, "logprob": None, "text": "a b"},
        {"line": 7, "rank": 2, "score": None, "logprob": -1.2346, "text": "a"}]
    assert translation_rows(7, forced, "tsv", nbest=2)[0] == "7\t1\t-inf\t-inf\ta b"
    assert strict(score_row(3, [-0.5, -math.inf], "jsonl", per_token=True)) == \
        {"line": 3, "logprob": None, "mean": None, "tokens": 2, "token_logprobs": [-0.5, None]}
    assert score_row(3, [-0.5, -math.inf], "tsv", per_token=False) == "-inf\t-inf\t2"
    answer = json.dumps(response_item(forced, nbest=2, attention=False), allow_nan=False)
    assert strict(answer) == {"text": "a b", "score": None, "nbest": [{"text": "a b", "score": None},
                                                                       {"text": "a", "score": None}]}
