"""Inference with a trained model, as a library: ``Translator`` loads a checkpoint or release file
(safely: ``nmt.checkpoints``), chooses device, precision and kernels once, and translates, scores,
returns n-best lists and attention, in token-budget batches within the model's length limits.

    from nmt.inference import Translator
    translator = Translator.load("run/checkpoints/last.ckpt", precision="int8")
    [t.text for t in translator.translate(["ein Satz .", "noch einer ."])]

``translate``, ``serve`` and ``evaluate`` are front ends over it; ``nmt.inference.ctranslate2`` is
the same interface over an exported CTranslate2 folder. Results are ``nmt.inference.translations`` objects.

Batches: the non-empty lines are encoded (subword ids + EOS; a line over the model's source limit
is cut there, with a warning naming its line), sorted by length and cut into batches of at most
``max_tokens`` source tokens (padding included). On a CPU, ``workers`` batches decode at once, one
thread each (default: as many as torch has threads): a decoding step is many small operations
that one thread runs nearly as fast as two, so batches side by side use the cores better.
``precision``: ``auto`` (``load``'s default: bf16 where the device computes it in hardware, else
fp32, ``nmt.machine``); ``32``; ``bf16`` (autocast: bf16 matmuls, fp32 scores and softmax); ``int8``
(CPU: a copy of the model whose linear layers multiply in int8, ``nmt.kernels.int8``).
"""

from __future__ import annotations

import copy
import functools
import logging
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from nmt.decoding import fixed_beam, search as search_functions
from nmt.checkpoints.loading import load_checkpoint, load_ensemble
from nmt.data.batching import TokenBatchSampler
from nmt.inference.alignments import pharaoh
from nmt.decoding.constrained import check_constraints, constrained_beam_search
from nmt.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizer
from nmt.decoding.search import Hypotheses, hf_penalty, length_penalty
from nmt.kernels import on_cpu
from nmt.languages.tags import tag, tag_words, vocabulary_languages
from nmt.kernels.malloc import bound_onednn_cache, keep_freed_memory
from nmt.decoding.limits import model_max_src_len, model_max_tgt_len
from nmt.machine import decoding_device, resolve_decoding_precision
from nmt.inference.requests import Naming, Request, RequestError, RequestMeaning
from nmt.decoding.settings import SearchSettings, bounded
from nmt.inference.translations import Attention, Hypothesis, Translation, in_line_order
from nmt.inference.unknown_input import MOSTLY, unknown_share

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "32", "bf16", "int8")
# the searches that take per-sentence caps (``max_len``): every output within the model's target limit
CAPPED = (search_functions.greedy_search, search_functions.beam_search, search_functions.sample_search)


def check_precision(precision: Any) -> str:
    if str(precision) not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    return str(precision)


def encode_sources(lines: list[str], vocab: Tokenizer, max_len: int, numbers: list[int] | None = None) -> list[list[int]]:
    """Subword ids + EOS per line; lines longer than ``max_len`` tokens are cut, and the warning
    names them by ``numbers`` (their 1-based input line numbers; default 1..n)."""
    encoded, truncated = [], []
    for i, ids in enumerate(vocab.encode_batch(lines)):
        if len(ids) > max_len - 1:
            truncated.append(numbers[i] if numbers else i + 1)
            ids = ids[: max_len - 1]
        encoded.append(ids + [EOS])
    if truncated:
        log.warning("truncated %d line(s) longer than %d tokens: %s", len(truncated), max_len - 1, truncated[:20])
    return encoded


def pad(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((len(seqs), max(map(len, seqs))), PAD, dtype=torch.long)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = torch.tensor(seq)
    out = out.to(device)
    return out, out != PAD


@contextmanager
def threads_restored() -> Iterator[None]:
    """torch's intra-op thread count of the calling thread, set again after the block: a
    ``torch.set_num_threads`` in any thread (a pool's workers) also sets, process-wide, the count
    that threads started later begin with."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_batches(batches: list[Any], work: Callable[[Any], Any], device: torch.device, precision: str,
                workers: int | None) -> Iterator[Any]:
    """``work(batch)`` for every batch, results in batch order, under no-grad and (``bf16``)
    autocast; on a CPU ``workers`` batches at once, each on one thread."""

    def run(batch: Any) -> Any:
        # Grad mode and autocast are per thread: set them in the thread that decodes.
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            return work(batch)

    workers = min(workers or torch.get_num_threads(), len(batches)) if device.type == "cpu" else 1
    if workers <= 1:
        yield from map(run, batches)
        return
    with threads_restored():  # each worker sets its own count to 1
        pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,))
        try:
            yield from pool.map(run, batches)
        finally:
            pool.shutdown(cancel_futures=True)  # after an error, the batches not started are dropped


def without_lead(hyps: Hypotheses, n: int) -> Hypotheses:
    """``hyps`` with the first ``n`` tokens of every hypothesis (a forced target-language code) cut."""
    if not n:
        return hyps
    return Hypotheses([t[n:] for t in hyps.tokens], hyps.scores, None if hyps.attn is None else [a[n:] for a in hyps.attn],
                      None if hyps.nbest is None else [[(t[n:], score) for t, score in entries] for entries in hyps.nbest])


class Translator(RequestMeaning):
    """A model with its vocabularies, limits and decoding, ready to translate and score; what a
    request means: ``prepare`` (``nmt.inference.requests``)."""

    backend = "torch"
    can_guide = True  # prefixes and constraints
    can_align = True  # decoding.alignments (every model; an empty alignment without attention)

    def __init__(self, model: torch.nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer,
                 run_config: dict[str, Any] | None = None, decoding: Mapping[str, Any] | SearchSettings | None = None,
                 precision: str = "32", max_tokens: int = 2048, workers: int | None = None,
                 max_src_len: int | None = None, step: int | None = None, report: dict[str, Any] | None = None,
                 max_tgt_len: int | None = None) -> None:
        self.run_config = run_config or {}
        self.warned_unknown_input = False  # nmt.inference.unknown_input: once per translator
        device = next(model.parameters()).device.type
        self.precision = resolve_decoding_precision(check_precision(precision), device)
        self.source_model = model.eval()  # as loaded: what ``info`` describes
        self.model = copy.deepcopy(model).quantize_int8() if self.precision == "int8" else self.source_model
        self.device = next(self.model.parameters()).device
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab
        settings = decoding if isinstance(decoding, SearchSettings) else SearchSettings.from_config(decoding)
        tested = self.run_config.get("test_decoding")
        tested = tested if isinstance(tested, dict) else {}
        self.settings = settings.for_model(tested.get("alpha"), tested.get("scoring"), tested.get("early_stopping"))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: a positive whole number of source tokens a batch")
        self.max_tokens, self.workers = int(max_tokens), workers
        self.max_src_len = int(max_src_len) if max_src_len else model_max_src_len(self.run_config)
        self.max_tgt_len = int(max_tgt_len) if max_tgt_len else target_limit(self.model, self.run_config)
        self.step, self.report = step, report  # the report: the run folder's or the release file's
        self.target_languages = vocabulary_languages(src_vocab.sp)  # a multilingual model's <2xx> tags
        languages = self.run_config.get("languages")  # an imported M2M100's: the target code starts the output
        self.decoder_languages = isinstance(languages, dict) and languages.get("target") == "decoder_prefix"
        self._attention: bool | None = None

    @classmethod
    def load(cls, path: str | Path | Sequence[str | Path], device: str = "auto", precision: str = "auto",
             kernels: str = "auto", allow_pickle: bool = False, **options: Any) -> Translator:
        """A checkpoint or release file, or a list of them decoding as one ensemble
        (``nmt.models.ensemble``), on ``device`` with ``kernels`` (``nmt.kernels``); the process-wide
        memory settings of those kernels are applied here, once. An ensemble's length limits are its
        members' smallest."""
        precision = check_precision(precision)
        target = torch.device(decoding_device(str(device), precision))
        bound_onednn_cache()
        if on_cpu(kernels, target.type):
            keep_freed_memory()
        if isinstance(path, (str, Path)):
            loaded = load_checkpoint(path, device=target, allow_pickle=allow_pickle)
        else:
            loaded = load_ensemble(list(path), device=target, allow_pickle=allow_pickle)
        loaded.model.set_kernels(kernels)
        if loaded.members:
            options.setdefault("max_src_len", min(model_max_src_len(m.run_config) for m in loaded.members))
            options.setdefault("max_tgt_len", min(target_limit(m.model, m.run_config) for m in loaded.members))
        return cls(loaded.model, loaded.src_vocab, loaded.tgt_vocab, loaded.run_config, precision=precision,
                   step=loaded.step, report=loaded.report, **options)

    def release(self) -> None:
        """Drop the model's captured searches and the memory they hold (``nmt.decoding.fixed_beam``;
        they are bounded by ``decoding.graph_cache_mb`` meanwhile, as in nmt-serve)."""
        fixed_beam.release(self.model)

    # --- translating --------------------------------------------------------------------------
    def batches(self, lines: list[str], beam_size: int | None = None, nbest: int | None = None,
                attention: Iterable[int] | bool = (), first_line: int = 1,
                search: Callable[..., Hypotheses] | None = None, alignments: bool | None = None,
                prefixes: list[str] | None = None, constraints: list[list[str]] | None = None,
                tgt_lang: str | None = None, src_lang: str | None = None) -> Iterator[list[tuple[int, Translation]]]:
        """Translate the non-empty ``lines`` batch by batch: each batch's (0-based index into
        ``lines``, ``Translation``) pairs, as soon as it is decoded. ``attention``: the indices
        whose attention is returned (True: all); ``first_line``: the input line number of
        ``lines[0]`` (for warnings and errors); ``alignments``: word-align every hypothesis (None:
        as ``decoding.alignments`` says); ``tgt_lang``, ``prefixes`` (per line, the text its
        translation starts with, "" for none), ``constraints`` (per line, the phrases its
        translation must hold: lexically constrained beam search, ``nmt.decoding.constrained``):
        the request, checked by ``prepare`` (``nmt.inference.requests``)."""
        align = self.settings.alignments if alignments is None else alignments
        beam_size, nbest = (None if v is None else bounded(v, key) for v, key in ((beam_size, "beam_size"), (nbest, "nbest")))
        search = search or search_functions.search_of(self.settings, beam_size, nbest)
        alpha = float(search.keywords.get("alpha", 0.0)) if isinstance(search, functools.partial) and \
            search.func is search_functions.beam_search else None
        prepared = self.prepare(Request(lines, tgt_lang, prefixes, constraints, src_lang),
                                Naming(numbers=range(first_line, first_line + len(lines))))
        lead = prepared.lead  # the target-language code every output starts with (an imported M2M100)
        hf = isinstance(search, functools.partial) and search.keywords.get("scoring") == "huggingface"
        todo = [i for i, line in enumerate(prepared.sources) if line.strip()]
        wanted = set(todo) if attention is True else set(attention or ())
        encoded = encode_sources([prepared.sources[i] for i in todo], self.src_vocab, self.max_src_len,
                                 numbers=[first_line + i for i in todo])
        if not self.warned_unknown_input:
            self._check_known(encoded, first_line, len(lines))
        required, plain_search = None, search
        if prepared.constraints is not None:
            required = [prepared.constraints[i] for i in todo]
            search = functools.partial(constrained_beam_search, beam_size=int(beam_size or self.settings.beam_size),
                                       alpha=self.settings.alpha, nbest=int(nbest or self.settings.nbest),
                                       max_len_a=self.settings.max_len_a, max_len_b=self.settings.max_len_b,
                                       continuation=self._continuation(), scoring=self.settings.scoring or "gnmt",
                                       early_stopping=self.settings.early_stopping)
            alpha, hf = self.settings.alpha, self.settings.scoring == "huggingface"
        forced = None if prepared.prefixes is None else [prepared.prefixes[i] for i in todo]
        if lead:
            forced = [lead + (forced[k] if forced else []) for k in range(len(todo))]
        order = TokenBatchSampler([len(e) for e in encoded], max_tokens=self.max_tokens, batch_size=None,
                                  shuffle=False, seed=0)

        def work(batch: list[int]) -> list[tuple[int, Translation]]:
            src, src_mask = pad([encoded[j] for j in batch], self.device)
            extra = {}
            if getattr(search, "func", None) in CAPPED:  # outputs within the decoder's positions, EOS included
                extra["max_len"] = torch.full((len(batch),), self.max_tgt_len, device=self.device)
            if forced is not None and any(forced[j] for j in batch):
                extra["prefix"] = pad([forced[j] or [PAD] for j in batch], self.device)[0]
            batch_search = search
            if required is not None:
                if any(required[j] for j in batch):
                    extra["constraints"] = [required[j] for j in batch]
                else:  # no line of this batch has constraints: the plain search, as without the option
                    batch_search = plain_search
            hyps = without_lead(batch_search(self.model, src, src_mask, need_attn=any(todo[j] in wanted for j in batch),
                                             **extra), len(lead))
            done = [(todo[j], self._translation(hyps, r, encoded[j], todo[j] in wanted, alpha, len(lead), hf))
                    for r, j in enumerate(batch)]
            if align:
                self._align(done, hyps, [encoded[j] for j in batch])
            return done

        yield from run_batches(list(order), work, self.device, self.precision, self.workers)

    def _check_known(self, encoded: list[list[int]], first_line: int, count: int) -> None:
        """One warning per translator where most of an input's pieces are unknown to the source
        vocabulary (``nmt.inference.unknown_input``)."""
        unknown, total = unknown_share(self.src_vocab, encoded)
        if total and unknown / total > MOSTLY:
            self.warned_unknown_input = True
            language = (self.run_config.get("data") or {}).get("src_lang")
            last = first_line + count - 1
            where = f"input line {first_line}" if last == first_line else f"input lines {first_line}-{last}"
            log.warning("%.0f%% of the subword pieces of %s (%d of %d) are unknown to this model's source vocabulary "
                        "(<unk>, or words spelled out letter by letter): the input is probably not in the language "
                        "the model was trained on%s, and its translations will be nonsense (warned once)",
                        100 * unknown / total, where, unknown, total, f" (data.src_lang={language})" if language else "")

    def translate(self, lines: list[str], beam_size: int | None = None, nbest: int | None = None,
                  attention: Iterable[int] | bool = (), search: Callable[..., Hypotheses] | None = None,
                  alignments: bool | None = None, prefixes: list[str] | None = None,
                  constraints: list[list[str]] | None = None, tgt_lang: str | None = None,
                  src_lang: str | None = None) -> list[Translation]:
        """One ``Translation`` per line, in order (no hypotheses for an empty line)."""
        return in_line_order(self.batches(lines, beam_size, nbest, attention, search=search, alignments=alignments,
                                          prefixes=prefixes, constraints=constraints, tgt_lang=tgt_lang,
                                          src_lang=src_lang),
                             len(lines), Translation)

    def _translation(self, hyps: Hypotheses, r: int, source: list[int], with_attention: bool,
                     alpha: float | None, lead: int = 0, hf: bool = False) -> Translation:
        """Row ``r`` of a batch's hypotheses; ``alpha``: beam search's length penalty (its scores
        are log-probs divided by it: GNMT's, or ``length ** alpha`` with ``hf``), None for greedy
        search and sampling (scores are log-probs); ``lead``: forced tokens cut from the front."""
        ranked = hyps.nbest[r] if hyps.nbest is not None else [(hyps.tokens[r], float(hyps.scores[r]))]
        hypotheses = []
        for tokens, score in ranked:
            length = torch.tensor(len(tokens) + 1 + lead)
            penalty = (hf_penalty if hf else length_penalty)(length, alpha) if alpha else 1.0
            logprob = score * float(penalty)
            hypotheses.append(Hypothesis(self.tgt_vocab.decode(tokens), float(score), float(logprob)))
        attention = None
        if with_attention and hyps.attn is not None:
            weights = hyps.attn[r][:, : len(source)].float()
            attention = Attention(self.src_vocab.pieces(source), self.tgt_vocab.pieces(hyps.tokens[r] + [EOS]),
                                  weights.tolist())
        return Translation(hypotheses, attention)

    def _language_codes(self) -> dict[int, str]:
        """The target ids of the model's language codes (``▁<2xx>``) and their pieces."""
        sp = self.tgt_vocab.sp
        pieces = (f"\u2581{tag(lang)}" for lang in self.target_languages)
        return {code: piece for piece in pieces if sp.id_to_piece(code := sp.piece_to_id(piece)) == piece}

    def lead_ids(self, lang: str) -> list[int]:
        """The target ids an output in ``lang`` starts with: its language code (``▁<2xx>``)."""
        piece = f"\u2581{tag(lang)}"
        code = self.tgt_vocab.sp.piece_to_id(piece)
        if self.tgt_vocab.sp.id_to_piece(code) != piece:
            raise RequestError(f"tgt_lang={lang}: the target vocabulary has no {piece} piece")
        return [code]

    def _align(self, done: list[tuple[int, Translation]], hyps: Hypotheses, sources: list[list[int]]) -> None:
        """Set each hypothesis' Pharaoh word alignment (``nmt.inference.alignments``), from the attention of
        a teacher-forced pass over it: every n-best entry gets its own."""
        ranked = [hyps.nbest[r] if hyps.nbest is not None else [(hyps.tokens[r], 0.0)] for r in range(len(sources))]
        pairs = [(r, tokens) for r, entries in enumerate(ranked) for tokens, _ in entries]
        texts = iter(self.alignments([sources[r] for r, _ in pairs], [tokens for _, tokens in pairs]))
        for _, translation in done:  # its hypotheses are ``ranked``'s, in order
            for hypothesis in translation.hypotheses:
                hypothesis.alignment = next(texts)

    def alignments(self, sources: list[list[int]], targets: list[list[int]], chunk: int = 32,
                   units: tuple[str, str] = ("words", "words")) -> list[str]:
        """Pharaoh word alignments of (source ids + EOS, target ids without BOS/EOS) pairs: each
        target subword to the source subword its attention weighs most, in the model's alignment
        layer (``Seq2Seq.alignment_attention``), lifted to words (or characters: ``units`` of the
        source and target, ``nmt.inference.alignments.pharaoh``). Empty strings for a model
        without attention or an empty side."""
        out: list[str] = []
        for start in range(0, len(sources), chunk):  # every layer's weights of a chunk at a time: bounded memory
            part_s, part_t = sources[start : start + chunk], targets[start : start + chunk]
            src, src_mask = pad(part_s, self.device)
            tgt_in, _ = pad([[BOS, *t] for t in part_t], self.device)
            with torch.inference_mode():
                weights = self.model.alignment_attention(src, src_mask, tgt_in)
            if weights is None:
                return ["" for _ in sources]
            weights = weights.float().cpu()
            for i, (s, t) in enumerate(zip(part_s, part_t)):
                pieces = self.src_vocab.pieces(s[:-1])
                out.append(pharaoh(pieces, self.tgt_vocab.pieces(t), weights[i, : len(t), : len(s) - 1].tolist(),
                                   skip=tag_words(pieces) if self.target_languages else 0, units=units))
        return out

    @property
    def has_attention(self) -> bool:
        """Whether the model gives attention weights (the LSTM without attention does not)."""
        if self._attention is None:
            lang = self.target_languages[0] if self.target_languages else None
            both = {"src_lang": lang} if self.decoder_languages else {}  # a model reading both languages
            self._attention = self.translate(["a"], attention=True, tgt_lang=lang, **both)[0].attention is not None
        return self._attention

    def guide_ids(self, key: str, guides: list[Any], sources: list[str], where: str, numbers: list[int],
                  item: str, lead: list[int] | None = None) -> list[Any]:
        """``prefix_ids`` or ``constraint_ids`` (``key``) of a request's guides (``nmt.inference.requests``);
        ``lead``: the target-language code every output starts with (``Prepared.lead``)."""
        ids = self.prefix_ids if key == "prefixes" else self.constraint_ids
        return ids(guides, sources, where=where, numbers=numbers, item=item, lead=lead)

    def prefix_ids(self, prefixes: list[str], sources: list[str], where: str = "prefix",
                   numbers: list[int] | None = None, item: str = "line", lead: list[int] | None = None) -> list[list[int]]:
        """The target ids each translation of ``sources`` must start with (``prefixes``: one text
        per source; "" for none), or a one-line ``RequestError`` naming the ``item`` (``numbers``:
        their numbers, default 1..n): a piece the target vocabulary lacks, or a prefix that leaves
        no room for EOS under the source's length cap (after the forced ``lead``)."""
        numbers = numbers or list(range(1, len(sources) + 1))
        source_ids = encode_sources(sources, self.src_vocab, self.max_src_len, numbers)
        out = []
        for text, src, number in zip(prefixes, source_ids, numbers):
            ids = self.tgt_vocab.encode(text) if text.strip() else []
            if UNK in ids:
                raise RequestError(f"{where}, {item} {number}: {text!r} holds characters the target vocabulary "
                                   "lacks (they would be <unk>)")
            cap = min(search_functions.length_cap(len(src), self.settings.max_len_a, self.settings.max_len_b),
                      self.max_tgt_len)
            forced = len(lead or [])
            if len(ids) + forced >= cap:
                after = f", {forced} of them the forced target-language code" if forced else ""
                raise RequestError(f"{where}, {item} {number}: {len(ids)} target tokens, but the {item}'s translation "
                                   f"is capped at {cap} (decoding.max_len_a * source tokens + decoding.max_len_b, EOS "
                                   f"included{after})")
            out.append(ids)
        return out

    def _continuation(self) -> torch.Tensor:
        """(target vocabulary,) bools: the pieces that continue a word: no leading "▁", not special,
        starting with a letter or digit (punctuation such as "." or "," may follow a constraint)."""
        pieces = self.tgt_vocab.pieces(range(self.tgt_vocab.vocab_size))
        return torch.tensor([i > EOS and not p.startswith("\u2581") and p[:1].isalnum() for i, p in enumerate(pieces)],
                            device=self.device)

    def constraint_ids(self, constraints: list[list[str]], sources: list[str], where: str = "constraints",
                       numbers: list[int] | None = None, item: str = "line",
                       lead: list[int] | None = None) -> list[list[tuple[int, ...]]]:
        """The target ids of each source's constraints (phrases its translation must hold), or a
        one-line ``RequestError`` naming the ``item``: an empty phrase, characters the target
        vocabulary lacks, a language code of a model that writes one as its first token (only there,
        forced), or phrases that do not fit under the source's length cap after the forced ``lead``."""
        numbers = numbers or list(range(1, len(sources) + 1))
        source_ids = encode_sources(sources, self.src_vocab, self.max_src_len, numbers)
        codes = self._language_codes() if self.decoder_languages else {}
        out = []
        for phrases, src, number in zip(constraints, source_ids, numbers):
            ids = []
            for phrase in phrases:
                if not phrase.strip():
                    raise RequestError(f"{where}, {item} {number}: an empty constraint (phrases are separated by tabs)")
                encoded = tuple(self.tgt_vocab.encode(phrase))
                if UNK in encoded:
                    raise RequestError(f"{where}, {item} {number}: {phrase!r} holds characters the target "
                                       "vocabulary lacks (they would be <unk>)")
                if code := next((codes[t] for t in encoded if t in codes), None):
                    raise RequestError(f"{where}, {item} {number}: {phrase!r} holds the language code {code}, which "
                                       "this model writes only as its first token (forced, and never a constraint)")
                ids.append(encoded)
            cap = search_functions.length_cap(len(src), self.settings.max_len_a, self.settings.max_len_b)
            try:
                check_constraints(ids, cap, len(lead or []))
            except ValueError as e:
                raise RequestError(f"{where}, {item} {number}: {e}") from None
            out.append(ids)
        return out

    # --- scoring ------------------------------------------------------------------------------
    def score_batches(self, sources: list[str], targets: list[str], first_line: int = 1,
                      lead: list[int] | None = None) -> Iterator[list[tuple[int, list[float]]]]:
        """Per-token log-probabilities (EOS last) of each target given its source, teacher-forced,
        for the pairs with a non-empty source; batch by batch, (0-based index, values) pairs.
        ``lead``: target ids every target starts with (``Prepared.lead``), read but not scored."""
        todo = [i for i, s in enumerate(sources) if s.strip()]
        numbers = [first_line + i for i in todo]
        src_ids = encode_sources([sources[i] for i in todo], self.src_vocab, self.max_src_len, numbers)
        skip = len(lead or [])
        tgt_ids = encode_sources([targets[i] for i in todo], self.tgt_vocab, self.max_tgt_len - skip, numbers)
        tgt_ids = [[*(lead or []), *ids] for ids in tgt_ids]
        lengths = [[len(s), len(t)] for s, t in zip(src_ids, tgt_ids)]
        order = list(TokenBatchSampler(lengths, max_tokens=self.max_tokens, batch_size=None, shuffle=False,
                                       seed=0)) if todo else []

        def work(batch: list[int]) -> list[tuple[int, list[float]]]:
            src, src_mask = pad([src_ids[j] for j in batch], self.device)
            tgt, _ = pad([tgt_ids[j] for j in batch], self.device)
            values = search_functions.score_pairs(self.model, src, src_mask, tgt).float().cpu()
            return [(todo[j], values[r, skip : len(tgt_ids[j])].tolist()) for r, j in enumerate(batch)]

        yield from run_batches(order, work, self.device, self.precision, self.workers)

    def score(self, sources: list[str], targets: list[str], lead: list[int] | None = None) -> list[list[float] | None]:
        return in_line_order(self.score_batches(sources, targets, lead=lead), len(sources), lambda: None)

    # --- describing ---------------------------------------------------------------------------
    def count_tokens(self, texts: list[str]) -> int:
        """Source tokens of ``texts`` with EOS (what a batch's budget counts)."""
        return sum(len(ids) + 1 for ids in self.src_vocab.encode_batch(texts)) if texts else 0

    def info(self) -> dict[str, Any]:
        """The model and the serving settings, as read from the file (data someone else wrote:
        ``nmt.serve`` passes on only values of the expected types)."""
        rc = self.run_config
        data = rc.get("data", {})
        members = list(getattr(self.source_model, "members", [self.source_model]))  # an ensemble's, or the model
        return {
            "backend": self.backend,
            "preset": {part: " + ".join(type(getattr(m, part)).__name__ for m in members) for part in ("encoder", "decoder")},
            "members": len(members),
            "hidden_size": rc.get("model", {}).get("hidden_size"),
            "parameters": sum(p.numel() for p in self.source_model.parameters()),
            "src_lang": data.get("src_lang"), "tgt_lang": data.get("tgt_lang"), "target_languages": self.target_languages,
            "reads_src_lang": self.decoder_languages,  # an imported M2M100/NLLB-200/mBART-50: requests name both
            "src_vocab_size": self.src_vocab.vocab_size, "tgt_vocab_size": self.tgt_vocab.vocab_size,
            "max_src_len": self.max_src_len, "attention": self.has_attention,
            "decoding": self.settings.as_config(), "precision": self.precision,
            "run": rc.get("task_name"), "step": self.step, "tags": rc.get("tags"),
        }


def target_limit(model: torch.nn.Module, run_config: dict[str, Any]) -> int:
    """The most target tokens (EOS included) ``model`` writes: its run config's limit, capped by a
    Transformer decoder's position table (an ensemble: its members' smallest)."""
    if hasattr(model, "members"):
        return min(target_limit(m, run_config) for m in model.members)
    table = getattr(getattr(model.decoder, "embed_tokens", None), "max_len", None)
    return model_max_tgt_len(run_config, table)


def translate_lines(model: torch.nn.Module, src_vocab: Tokenizer, tgt_vocab: Tokenizer, lines: list[str],
                    search: Callable[..., Hypotheses], max_tokens: int = 2048, max_src_len: int = 256,
                    attention_lines: Iterable[int] = (), precision: str = "32",
                    workers: int | None = None) -> tuple[list[str], dict[int, Attention]]:
    """One translation per line (empty for an empty line) with a model in memory and a search
    function, and the attention of the 0-based ``attention_lines``: a ``Translator`` for one call."""
    translator = Translator(model, src_vocab, tgt_vocab, precision=precision, max_tokens=max_tokens, workers=workers,
                            max_src_len=max_src_len)
    wanted = set(attention_lines)
    translations = translator.translate(lines, attention=wanted, search=search)
    attentions = {i: t.attention for i, t in enumerate(translations) if i in wanted and t.attention is not None}
    return [t.text for t in translations], attentions
