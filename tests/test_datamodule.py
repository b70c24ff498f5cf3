import logging
import os
from pathlib import Path

import pytest
import pytorch_lightning as L
import torch
from hydra.utils import instantiate
from pytorch_lightning.callbacks import ModelCheckpoint

from nmt.checkpoints.files import saved_vocabularies
from nmt.data.datamodule import TranslationDataModule
from nmt.data.sources import DataError, FileSource, read_lines
from nmt.data.stats import histogram, report
from nmt.data.tokenizer import BOS, EOS, PAD
from tests.conftest import SEARCH_PATH, compose_run

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny"
TOKENIZER = {"vocab_size": 100, "hard_vocab_limit": False}


def tiny(cache_dir: Path, **kwargs) -> TranslationDataModule:
    """The data module on tests/data/tiny; ``vocab_from`` is read as train.py reads it."""
    options = {"max_tokens": 512, "cache_dir": str(cache_dir), "vocab_loader": saved_vocabularies} | kwargs
    return TranslationDataModule(FileSource(str(TINY), "src", "tgt"), TOKENIZER, "src", "tgt", **options)


def compose_data(name: str, tmp_path: Path, *overrides: str):
    """The stats config for data ``name``, Hydra's runtime set (a data config may read the model choice)."""
    return compose_run("stats", tmp_path / "run", [SEARCH_PATH, f"data={name}", f"paths.root_dir={ROOT}",
                                                   f"paths.cache_dir={tmp_path}", f"paths.data_dir={tmp_path}", *overrides])


@pytest.fixture(scope="module")
def dm(tmp_path_factory) -> TranslationDataModule:
    cfg = compose_data("tiny", tmp_path_factory.mktemp("cache"))
    module = instantiate(cfg.data)
    module.setup()
    return module


def test_batches_from_config(dm):
    assert dm.joint_vocab and dm.src_vocab is dm.tgt_vocab and dm.src_vocab.vocab_size <= 400
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"src", "src_mask", "tgt_in", "tgt_out", "ids", "num_src_tokens",
                          "num_tgt_tokens"}
    (b, s), (_, t) = batch["src"].shape, batch["tgt_in"].shape
    assert batch["src"].dtype == batch["tgt_in"].dtype == batch["tgt_out"].dtype == torch.long
    assert batch["src_mask"].dtype == torch.bool and batch["src_mask"].shape == (b, s)
    assert batch["tgt_out"].shape == (b, t) and batch["ids"].shape == (b,)
    assert b * max(s, t) <= 512
    assert (batch["tgt_in"][:, 0] == BOS).all()
    assert batch["num_src_tokens"] == int(batch["src_mask"].sum())
    assert batch["num_tgt_tokens"] == int((batch["tgt_out"] != PAD).sum())
    src, tgt = dm.raw("train")
    for row, i in enumerate(batch["ids"].tolist()):
        assert dm.src_vocab.decode(batch["src"][row]) == src[i]
        assert dm.tgt_vocab.decode(batch["tgt_out"][row]) == tgt[i]
        assert dm.tgt_vocab.decode(batch["tgt_in"][row]) == tgt[i]
        n = int(batch["src_mask"][row].sum())
        assert batch["src"][row, n - 1] == EOS


def test_eval_loaders_cover_each_example_once(dm):
    for split, loader in (("valid", dm.val_dataloader()), ("test", dm.test_dataloader())):
        ids = [i for batch in loader for i in batch["ids"].tolist()]
        assert sorted(ids) == list(range(20))
        assert dm.raw(split) == (read_lines(TINY / f"{split}.src"), read_lines(TINY / f"{split}.tgt"))


def test_long_pairs(tmp_path):
    module = tiny(tmp_path, max_src_len=25, max_tgt_len=30)
    module.setup()
    stats = module.stats
    assert 0 < stats["train"]["too_long_dropped"] < 100
    assert len(module.raw("train")[0]) == stats["train"]["pairs"] == 100 - stats["train"]["too_long_dropped"]
    assert stats["valid"]["pairs"] == 20 and stats["valid"]["src_truncated"] > 0
    assert module.raw("valid")[1] == read_lines(TINY / "valid.tgt")  # references stay whole
    for batch in module.val_dataloader():
        assert batch["src"].shape[1] <= 26 and batch["tgt_out"].shape[1] <= 31
    src, _ = module.raw("train")
    for batch in module.train_dataloader():
        for row, i in enumerate(batch["ids"].tolist()):
            assert module.src_vocab.decode(batch["src"][row]) == src[i]
    kept = tiny(tmp_path, max_src_len=25, max_tgt_len=30, too_long="truncate")
    kept.setup()
    assert kept.stats["train"]["pairs"] == 100 and kept.stats["train"]["src_truncated"] > 0
    assert max(b["src"].shape[1] for b in kept.train_dataloader()) <= 26


def test_train_pairs_subsample(tmp_path):
    full_src, full_tgt = read_lines(TINY / "train.src"), read_lines(TINY / "train.tgt")
    module = tiny(tmp_path, train_pairs=30, seed=3)
    module.setup()
    src, tgt = module.raw("train")
    assert len(src) == 30 and module.stats["train"]["subsampled_to"] == 30
    where = [full_src.index(s) for s in src]
    assert where == sorted(where) and [full_tgt[i] for i in where] == tgt  # pairs kept together, in corpus order
    assert module.raw("valid") == (read_lines(TINY / "valid.src"), read_lines(TINY / "valid.tgt"))
    again = tiny(tmp_path / "again", train_pairs=30, seed=3)
    again.setup()
    assert again.raw("train") == (src, tgt)
    with pytest.raises(ValueError, match="train_pairs must be a positive number"):
        tiny(tmp_path, train_pairs=0)


def test_second_setup_uses_cache(tmp_path, caplog):
    first = tiny(tmp_path)
    first.setup()
    assert first.src_vocab.trained
    caplog.set_level(logging.INFO)
    second = tiny(tmp_path)
    second.setup()
    assert not second.src_vocab.trained
    assert "tokenized data: loaded" in caplog.text
    assert second.src_vocab.model_file == first.src_vocab.model_file


def test_separate_vocabularies(tmp_path):
    module = TranslationDataModule(FileSource(str(TINY), "src", "tgt"), TOKENIZER | {"joint": False},
                                   "src", "tgt", cache_dir=str(tmp_path))
    module.setup()
    assert not module.joint_vocab and module.src_vocab is not module.tgt_vocab
    batch = next(iter(module.val_dataloader()))
    i = int(batch["ids"][0])
    assert module.tgt_vocab.decode(batch["tgt_out"][0]) == module.raw("valid")[1][i]


def test_empty_pairs_dropped(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for split in ("train", "valid", "test"):
        for lang in ("src", "tgt"):
            lines = read_lines(TINY / f"{split}.{lang}")
            lines[1] = "" if lang == "tgt" else lines[1]
            (folder / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
    module = TranslationDataModule(FileSource(str(folder), "src", "tgt"), TOKENIZER, "src", "tgt",
                                   cache_dir=str(tmp_path))
    module.setup()
    assert module.stats["train"]["empty_dropped"] == 1 and module.stats["train"]["pairs"] == 99
    assert len(module.raw("test")[0]) == 19


def test_predict_loader(dm):
    texts = dm.raw("test")[0][:7]
    seen = {}
    for batch in dm.predict_loader(texts, batch_size=3):
        assert "tgt_in" not in batch and "tgt_out" not in batch and batch["src"].shape[0] <= 3
        for row, i in enumerate(batch["ids"].tolist()):
            seen[i] = dm.src_vocab.decode(batch["src"][row])
    assert seen == dict(enumerate(texts))


def test_train_loader_resume_without_trainer(dm):
    loader = dm.train_dataloader()
    first = [b["ids"].tolist() for b in loader]
    it = iter(loader)
    head = [next(it)["ids"].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state == {"epoch": 1, "batches_yielded": 3, "global_batches": 3, "num_replicas": 1}
    other = dm.train_dataloader()
    other.load_state_dict(state)
    tail = [b["ids"].tolist() for b in other]
    assert tail == [b["ids"].tolist() for b in it] and head + tail != first  # epoch 1 order
    assert sorted(i for b in head + tail for i in b) == list(range(100))


def test_stats_report(dm):
    text = report(dm)
    for split in ("[train] 100 pairs", "[valid] 20 pairs", "[test] 20 pairs", "source subwords"):
        assert split in text
    assert dm.text_lengths("valid").tolist() == [len(s.split()) for s in read_lines(TINY / "valid.src")]
    bars = histogram(torch.tensor([1, 10, 11, 35, 250]).numpy())
    assert [line.split()[:2] for line in bars] == [["1-10", "2"], ["11-20", "1"], ["21-30", "0"],
                                                   ["31-40", "1"], ["41-50", "0"], ["51-60", "0"],
                                                   ["61-70", "0"], ["71-80", "0"], ["81-90", "0"],
                                                   ["91-100", "0"], [">100", "1"]]


class Recorder(L.LightningModule):
    """Records the example ids of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch["ids"].tolist()))
        return (self.w * batch["src"].float()).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False,
                     limit_val_batches=0, default_root_dir=tmp_path, **kwargs)


@pytest.mark.filterwarnings("ignore::UserWarning")  # no validation_step; ckpt callbacks not passed
def test_lightning_epochs_and_mid_epoch_resume(tmp_path):
    module = tiny(tmp_path / "cache")
    model = Recorder()
    _trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(model, datamodule=module)
    epochs = [[ids for e, ids in model.seen if e == epoch] for epoch in (0, 1)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(100))
    assert epochs[0] != epochs[1]

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    interrupted = Recorder()
    _trainer(tmp_path, max_steps=3, callbacks=[ckpt]).fit(interrupted, datamodule=tiny(tmp_path / "cache"))
    resumed = Recorder()
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=False).fit(
        resumed, datamodule=tiny(tmp_path / "cache"), ckpt_path=ckpt.best_model_path or ckpt.last_model_path)
    head = [ids for _, ids in interrupted.seen]
    tail = [ids for _, ids in resumed.seen]
    assert len(head) == 3 and head + tail == epochs[0]  # nothing repeated, nothing skipped


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "nmt" / "conf" / "data").glob("*.yaml")))
def test_data_configs_instantiate(name, tmp_path):
    extra = ["data.source.path=/corpora/x", "data.src_lang=de", "data.tgt_lang=en"] if name == "files" else []
    cfg = compose_data(name, tmp_path, *extra)
    assert cfg.data._target_ == "nmt.data.datamodule.TranslationDataModule"
    module = instantiate(cfg.data)
    assert isinstance(module, TranslationDataModule) and module.cache_dir == tmp_path
    assert hasattr(module.source, "load")
    if hasattr(module.source, "src_lang"):
        assert (module.source.src_lang, module.source.tgt_lang) == (module.src_lang, module.tgt_lang)


def test_train_max_words_drops_long_training_pairs_only(tmp_path):
    full_src, full_tgt = read_lines(TINY / "train.src"), read_lines(TINY / "train.tgt")
    limit = sorted(len(s.split()) for s in full_src)[len(full_src) // 2]  # about half the pairs are longer
    module = tiny(tmp_path, train_max_words=limit, train_pairs=20, seed=1)
    module.setup()
    within = [i for i, (s, t) in enumerate(zip(full_src, full_tgt))
              if len(s.split()) <= limit and len(t.split()) <= limit]
    assert module.stats["train"]["over_max_words_dropped"] == len(full_src) - len(within)
    src, tgt = module.raw("train")
    assert len(src) == 20 and all(full_src.index(s) in within for s in src)  # the subset is drawn from the short pairs
    assert max(module.text_lengths("valid")) > limit  # valid and test keep every length
    assert module.raw("test") == (read_lines(TINY / "test.src"), read_lines(TINY / "test.tgt"))
    with pytest.raises(DataError, match="no training pair has at most data.train_max_words=1 words"):
        tiny(tmp_path / "none", train_max_words=1).setup()
    with pytest.raises(ValueError, match="train_max_words must be a positive number"):
        tiny(tmp_path, train_max_words=0)


def test_vocab_from_a_model_file_or_a_checkpoint(tmp_path):
    first = tiny(tmp_path / "a")
    first.setup()
    other = tiny(tmp_path / "b", train_pairs=20, seed=3)  # other training text: another tokenizer
    other.setup()
    pieces = lambda tok: [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]  # noqa: E731
    assert pieces(other.src_vocab) != pieces(first.src_vocab)

    given = tiny(tmp_path / "c", train_pairs=20, seed=3, vocab_from=first.src_vocab.model_file)
    given.setup()
    assert given.src_vocab is given.tgt_vocab and given.joint_vocab
    assert pieces(given.src_vocab) == pieces(first.src_vocab)
    assert len(given.raw("train")[0]) == 20
    assert given.datasets["train"].src[0].tolist() != other.datasets["train"].src[0].tolist()

    ckpt = tmp_path / "run.ckpt"  # what train.py stores: the serialized models of both sides
    torch.save({"state_dict": {}, "run_config": {}, "tokenizers": {"src": first.src_vocab.sp.serialized_model_proto(),
                               "tgt": other.tgt_vocab.sp.serialized_model_proto()}}, ckpt)
    with pytest.raises(ValueError, match=r"data.vocab_from=.*run.ckpt has separate source and target "
                                         r"vocabularies: set data.tokenizer.joint=false"):
        tiny(tmp_path / "c", vocab_from=str(ckpt)).setup()
    from_ckpt = TranslationDataModule(FileSource(str(TINY), "src", "tgt"), TOKENIZER | {"joint": False}, "src", "tgt",
                                      cache_dir=str(tmp_path / "c"), vocab_from=str(ckpt), vocab_loader=saved_vocabularies)
    from_ckpt.setup()
    assert pieces(from_ckpt.src_vocab) == pieces(first.src_vocab)
    assert pieces(from_ckpt.tgt_vocab) == pieces(other.tgt_vocab) and not from_ckpt.joint_vocab

    with pytest.raises(ValueError, match=r"data.vocab_from=.*run.ckpt: this data module has no vocab_loader"):
        tiny(tmp_path / "c", vocab_from=str(ckpt), vocab_loader=None).setup()  # nmt.data reads no checkpoint itself
    with pytest.raises(FileNotFoundError, match=r"data.vocab_from=.*missing.ckpt: no such file"):
        tiny(tmp_path, vocab_from=str(tmp_path / "missing.ckpt")).setup()
    (tmp_path / "notes.model").write_text("not a model")
    with pytest.raises(ValueError, match=r"data.vocab_from=.*notes.model: not a SentencePiece model"):
        tiny(tmp_path, vocab_from=str(tmp_path / "notes.model")).setup()
    torch.save({"state_dict": {}}, tmp_path / "foreign.pt")  # any name: torch.save files are recognised by content
    with pytest.raises(ValueError, match=r"data.vocab_from=.*foreign.pt: no saved run config/tokenizers"):
        tiny(tmp_path, vocab_from=str(tmp_path / "foreign.pt")).setup()


def test_validation_reads_a_seeded_sample_in_corpus_order_until_switched_to_every_pair(tmp_path):
    """data.val_sample: validation decodes a fixed sample of the valid pairs, the same for the same
    seed (another seed draws another), in corpus order, sources and references kept together;
    validate_in_full() switches to the 20 pairs."""
    dm = tiny(tmp_path / "cache", val_sample=5)
    dm.setup()
    assert dm.val_split == "valid_sample" and len(dm.datasets["valid_sample"]) == 5
    src, ref = dm.raw("valid_sample")
    all_src, all_ref = dm.raw("valid")
    positions = [all_src.index(s) for s in src]
    assert positions == sorted(positions) and [all_ref[i] for i in positions] == ref
    assert sorted(i for batch in dm.val_dataloader() for i in batch["ids"].tolist()) == list(range(5))
    again = tiny(tmp_path / "cache", val_sample=5)
    again.setup()
    assert again.raw("valid_sample") == (src, ref)
    other = tiny(tmp_path / "cache", val_sample=5, seed=7)
    other.setup()
    assert other.raw("valid_sample")[0] != src
    assert dm.validate_in_full() and dm.val_split == "valid" and not dm.validate_in_full()
    assert sorted(i for batch in dm.val_dataloader() for i in batch["ids"].tolist()) == list(range(20))


@pytest.mark.parametrize("val_sample", [None, 20, 500])
def test_a_sample_as_large_as_the_split_is_every_pair(tmp_path, val_sample):
    dm = tiny(tmp_path / "cache", val_sample=val_sample)
    dm.setup()
    assert dm.val_split == "valid" and "valid_sample" not in dm.datasets


@pytest.mark.parametrize("val_sample", [0, -3, 2.5, True, "100"])
def test_a_bad_validation_sample_is_refused_naming_the_key(tmp_path, val_sample):
    with pytest.raises(ValueError, match=r"data\.val_sample=.*: a positive number of validation pairs, or null for all"):
        tiny(tmp_path / "cache", val_sample=val_sample)


def test_workers_and_shapes_settings(tmp_path):
    assert tiny(tmp_path, num_workers="auto")._workers() == 0  # auto without a GPU trainer: the cores train
    for bad, message in ((-1, r"^data.num_workers=-1: a number of processes \(0: none\) or auto$"),
                         ("many", r"^data.num_workers='many': a number of processes \(0: none\) or auto$")):
        with pytest.raises(ValueError, match=message):
            tiny(tmp_path, num_workers=bad)
    with pytest.raises(ValueError, match=r"^data.shapes=square: choose auto, exact, buckets$"):
        tiny(tmp_path, shapes="square")
    buckets = tiny(tmp_path, shapes="buckets")
    buckets.setup()
    batch = next(iter(buckets.train_dataloader()))
    assert batch["src"].shape[1] == batch["tgt_in"].shape[1]  # one length for both sides
    assert next(iter(buckets.val_dataloader()))["ids"].min() >= 0  # evaluation keeps exact batches, no filler
    buckets.set_max_tokens(256)
    assert all(b["src"].numel() <= 256 or b["src"].size(0) == 1 for b in buckets.train_dataloader())
