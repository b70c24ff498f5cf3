import pickle
from pathlib import Path

import pytest

from nmt.data.sources import DataError, read_lines
from nmt.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizer, text_hash, train_sentencepiece

TINY = Path(__file__).parent / "data" / "tiny"
OPTIONS = {"vocab_size": 100, "hard_vocab_limit": False}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return read_lines(TINY / "train.src") + read_lines(TINY / "train.tgt")


@pytest.fixture(scope="module")
def tok(tmp_path_factory, texts) -> Tokenizer:
    return train_sentencepiece(texts, tmp_path_factory.mktemp("spm"), OPTIONS)


def test_special_ids_fixed(tok):
    assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
    assert tok.pieces([PAD, UNK, BOS, EOS]) == ["<pad>", "<unk>", "<s>", "</s>"]
    assert 0 < tok.vocab_size <= 100 and len(tok) == tok.vocab_size


def test_round_trip(tok, texts):
    for text in texts[:50]:
        ids = tok.encode(text)
        assert ids and min(ids) > EOS  # specials are never produced by encode
        assert tok.decode(ids) == text
    assert tok.encode_batch(texts[:20]) == [tok.encode(t) for t in texts[:20]]
    assert tok.decode_batch(tok.encode_batch(texts[:20])) == texts[:20]


def test_decode_strips_specials(tok, texts):
    ids = tok.encode(texts[0])
    assert tok.decode([BOS, *ids, EOS, *tok.encode(texts[1]), PAD, PAD]) == texts[0]
    assert tok.decode([*ids, PAD, PAD]) == texts[0]


def test_encode_flat(tok, texts):
    tokens, offsets = tok.encode_flat(texts[:30], chunk=7)
    assert offsets[0] == 0 and offsets[-1] == len(tokens) and len(offsets) == 31
    for j, text in enumerate(texts[:30]):
        assert tokens[offsets[j] : offsets[j + 1]].tolist() == tok.encode(text)


def test_pickle_carries_model(tok, texts):
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode(texts[3]) == tok.encode(texts[3]) and copy.vocab_size == tok.vocab_size


def test_text_hash_sensitive_to_content_and_order():
    assert text_hash(["a b", "c"]) == text_hash(["a b", "c"])
    assert text_hash(["a b", "c"]) != text_hash(["c", "a b"])
    assert text_hash(["a", "b"]) != text_hash(["a\nb"])
    assert text_hash(["a"], ["b"]) != text_hash(["b"], ["a"])


def test_training_error_explains(tmp_path, texts):
    with pytest.raises(DataError, match="hard_vocab_limit=false"):
        train_sentencepiece(texts[:5], tmp_path, {"vocab_size": 5000, "hard_vocab_limit": True})
