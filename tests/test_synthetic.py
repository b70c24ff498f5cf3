import statistics
from pathlib import Path

import pytest

from nmt.data.synthetic import GENDER, SRC, TGT, VERB_SUFFIX, generate_pairs, translate, write_corpus

TINY = Path(__file__).parent / "data" / "tiny"
SRC_NOUNS = {w + s: (i, s == "s") for i, w in enumerate(SRC["noun"]) for s in ("", "s")}  # form -> (noun, plural)
TGT_VERBS = {w + s: (i, agr) for i, w in enumerate(TGT["verb"]) for agr, s in VERB_SUFFIX.items()}
TGT_NOUNS = {w + s for w in TGT["noun"] for s in ("", "n")}
TGT_ADJS = {w + s for w in TGT["adj"] for s in ("", "n")}


def split_clauses(words: list[str], conjunctions: list[str]) -> list[list[str]]:
    clauses: list[list[str]] = [[]]
    for w in words:
        if w in conjunctions:
            clauses.append([])
        else:
            clauses[-1].append(w)
    return clauses


def test_same_seed_same_corpus_other_seed_differs():
    assert generate_pairs(50, seed=3) == generate_pairs(50, seed=3)
    assert generate_pairs(50, seed=3) != generate_pairs(50, seed=4)


def test_source_lengths_spread_uniformly():
    lengths = [len(src.split()) for src, _ in generate_pairs(2000)]
    assert 5 <= min(lengths) <= 7 and 78 <= max(lengths) <= 80
    for low, high in [(5, 10)] + [(lo, lo + 10) for lo in range(10, 70, 10)] + [(70, 81)]:
        share = sum(low <= n < high for n in lengths) / len(lengths)
        assert share >= 0.05, (low, high, share)


def test_natural_lengths_are_short_skewed_with_a_long_tail():
    lengths = [len(src.split()) for src, _ in generate_pairs(4000, seed=2, min_len=3, max_len=60, lengths="natural")]
    assert 3 <= min(lengths) and max(lengths) <= 60
    assert 14 <= statistics.median(lengths) <= 16  # the median_len default
    assert statistics.mean(lengths) > statistics.median(lengths)  # right-skewed
    assert 0.005 < sum(n > 50 for n in lengths) / len(lengths) < 0.03  # a thin, present tail
    with pytest.raises(ValueError, match="unknown sentence length distribution 'zipf'; choose one of uniform, natural"):
        generate_pairs(1, lengths="zipf")


def test_target_is_a_function_of_the_source():
    pairs = generate_pairs(2000, seed=5, min_len=3, max_len=4)
    seen: dict[str, str] = {}
    for src, tgt in pairs:
        assert seen.setdefault(src, tgt) == tgt
    assert len(seen) < len(pairs)  # some sources repeat, so the check above bites
    for src, tgt in generate_pairs(300, seed=6):  # the rule-based parse-and-render agrees
        assert translate(src) == tgt


def test_languages_are_disjoint_and_fixed_across_seeds():
    src_words = {w for seed in (1, 2) for src, _ in generate_pairs(100, seed) for w in src.split()}
    tgt_words = {w for seed in (1, 2) for _, tgt in generate_pairs(100, seed) for w in tgt.split()}
    assert src_words <= {w for ws in SRC.values() for w in ws} | set(SRC_NOUNS)
    assert not src_words & tgt_words


def test_verb_ends_clause_and_agrees_with_distant_subject():
    far = moved = 0
    for src, tgt in generate_pairs(300, seed=7):
        src_clauses = split_clauses(src.split(), SRC["conj"])
        tgt_clauses = split_clauses(tgt.split(), TGT["conj"])
        assert len(src_clauses) == len(tgt_clauses)
        for s, t in zip(src_clauses, tgt_clauses):
            noun, plural = next(SRC_NOUNS[w] for w in s if w in SRC_NOUNS)  # subject head noun
            verb, agreement = TGT_VERBS[t[-1]]
            assert agreement == (GENDER[noun], plural)
            assert SRC["verb"][verb] in s
            far += len(t) - 2 >= 5  # target words between subject noun (t[1]) and its verb
            moved += s[-1] not in SRC["verb"]  # object or adverb follows the verb in the source
    assert far >= 100 and moved >= 100


def test_adjectives_precede_noun_in_source_and_follow_it_in_target():
    src_adjs, count = set(SRC["adj"]), 0
    for src, tgt in generate_pairs(100, seed=8):
        s, t = src.split(), tgt.split()
        assert all(s[i + 1] in src_adjs or s[i + 1] in SRC_NOUNS for i, w in enumerate(s) if w in src_adjs)
        assert all(t[i - 1] in TGT_ADJS or t[i - 1] in TGT_NOUNS for i, w in enumerate(t) if w in TGT_ADJS)
        count += sum(w in TGT_ADJS for w in t)
    assert count > 100


def test_write_corpus_writes_aligned_splits(tmp_path):
    out = write_corpus(tmp_path / "corpus", {"train": 30, "valid": 7}, seed=2, min_len=3, max_len=12)
    lines = {name: (out / name).read_text(encoding="utf-8").splitlines()
             for name in ("train.src", "train.tgt", "valid.src", "valid.tgt")}
    assert len(lines["train.src"]) == len(lines["train.tgt"]) == 30
    assert len(lines["valid.src"]) == len(lines["valid.tgt"]) == 7
    assert lines["train.src"][:7] != lines["valid.src"]
    assert [translate(s) for s in lines["valid.src"]] == lines["valid.tgt"]


def test_tiny_corpus_is_the_generators_output(tmp_path):
    write_corpus(tmp_path, {"train": 100, "valid": 20, "test": 20}, seed=1, min_len=3, max_len=12)
    for split in ("train", "valid", "test"):
        for lang in ("src", "tgt"):
            name = f"{split}.{lang}"
            assert (TINY / name).read_text(encoding="utf-8") == (tmp_path / name).read_text(encoding="utf-8")
