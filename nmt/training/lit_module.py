"""TranslationModule: the one LightningModule that trains every model.

Label-smoothed cross-entropy on teacher-forced logits, through the model's kernels
(``F.cross_entropy``, or with the CPU kernels ``nmt.kernels.loss``); validation and test decode with the
configured search (greedy for validation by default, beam for test) and score corpus BLEU/chrF
with sacreBLEU on detokenized text, once per epoch, over hypotheses gathered from all ranks.

Reliability: a step with a non-finite loss is skipped (the update is dropped) with a warning, and
``max_nonfinite_steps`` such steps in a row stop training; a model with non-finite weights is never
scored. Checkpoints carry the module's counters and the Python, NumPy and torch RNG states (CPU,
and CUDA's once initialised; under DDP those of every rank), and nothing draws from the global
torch RNG between training batches but the model (dropout, position shifts): the data loaders draw
their iterators' seeds from generators of their own (``nmt.data.datamodule``), validation runs
the model in eval mode and Lightning's sanity check restores the states it found. So the state a
checkpoint saves after a batch is the state the next batch starts from, and a resumed run draws
the same dropout masks as an uninterrupted one. Resumed on another number of processes, every
rank starts from rank 0's torch RNG state and the per-rank token counters are rescaled
(``docs/reliability.md``, "Resuming on another number of processes").
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np
import pytorch_lightning as L
from pytorch_lightning.callbacks import WeightAveraging
import torch
import torch.distributed as dist
from torch import Tensor, nn

from nmt.languages import writing
from nmt.evaluation import directions
from nmt.checkpoints.files import FORMAT, nonfinite
from nmt.checkpoints.finetune import load_optimizer_state
from nmt.data.tokenizer import BOS, PAD
from nmt.specials import NEVER
from nmt.decoding import fixed_beam
from nmt.evaluation.length_report import length_report, write_report
from nmt.evaluation.metrics import corpus_scores
from nmt.training import trainable
from nmt.training.compiling import checked_loss
from nmt.training.guided_alignment import GuidedAlignment, guided_alignment_loss
from nmt.runs.files import TEST_TEXT

log = logging.getLogger(__name__)


NOT_TARGETS = (PAD, BOS)  # no target is padding or BOS: label smoothing puts no mass there


class TranslationModule(L.LightningModule):
    """Args:
    model: a ``nmt.models.base.Seq2Seq``.
    optimizer: partial optimizer (``params`` filled here).
    scheduler: partial ``LambdaLR`` (stepped every optimizer step) or ``ReduceLROnPlateau``
        (stepped after each validation on ``monitor``) builder, or None.
    val_decoding, test_decoding: partial ``greedy_search``/``beam_search``.
    label_smoothing: epsilon of the smoothed cross-entropy (Szegedy et al. 2016), spread over the
        entries a target can be (``NOT_TARGETS`` left out).
    num_samples: validation translations written to the log each epoch.
    report_dir: where the test run writes its hypotheses and BLEU-by-length report.
    report_name: the system's name in that report (the model preset; default: decoder class).
    length_buckets: upper edges of the source-length buckets of that report; "auto": those of the
        unit the source is counted in (``nmt.evaluation.length_report.EDGES``).
    sacrebleu_tokenize: sacreBLEU tokenizer of the target language: "auto" (``nmt.languages.writing``: zh for
        Chinese, char for Thai, 13a for languages written with spaces), or one by name (13a, zh,
        ja-mecab, char...; None = 13a).
    max_nonfinite_steps: consecutive steps with a NaN/inf loss (each skipped) that stop training.
    val_len_cap: (a, b): validation stops a hypothesis at a * reference length + b tokens, where
        that is below decoding's own cap, so a model that has not learned to end yet validates in
        about a trained one's time; None: decoding's cap only. The test never sees the reference.
    guided_alignment: {weight, layer, head} of the guided-alignment loss on training batches that
        carry word alignments (``data.alignments``; ``nmt.training.guided_alignment``), logged as
        ``train/align_loss`` (``train/loss`` stays the translation loss); weight 0: off.
    freeze: parts of the model not trained (``embeddings``, ``encoder``, ``decoder``): no gradients,
        not given to the optimizer (``nmt.training.trainable``).
    lora: {rank, alpha, dropout, targets} of low-rank adapters on the attention projections
        (Hu et al. 2021; ``nmt.models.lora``), added to ``model`` here; with them only the adapters
        train. Rank 0 or null: none.
    """

    # Saved in checkpoints and restored when a fit resumes, with best_bleu (not when testing a checkpoint).
    COUNTERS = ("skipped_steps", "nonfinite_in_a_row", "train_tokens", "train_tgt_tokens", "train_seconds")

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        monitor: str = "val/bleu",
        val_decoding: Callable[..., Any] | None = None,
        test_decoding: Callable[..., Any] | None = None,
        label_smoothing: float = 0.1,
        num_samples: int = 3,
        report_dir: str | None = None,
        report_name: str | None = None,
        length_buckets: Sequence[int] | str = "auto",
        sacrebleu_tokenize: str | None = "auto",
        max_nonfinite_steps: int = 10,
        val_len_cap: Sequence[float] | None = (1.5, 5),
        guided_alignment: dict[str, Any] | None = None,
        freeze: Sequence[str] | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        guided_alignment = {k: v for k, v in (guided_alignment or {}).items()}  # plain values, not Hydra's DictConfig
        freeze = None if freeze is None else list(freeze) if isinstance(freeze, Sequence) and not isinstance(freeze, str) \
            else freeze  # a plain list, not Hydra's ListConfig (checked by trainable.prepare)
        lora = {k: list(v) if k == "targets" and isinstance(v, Sequence) and not isinstance(v, str) else v
                for k, v in lora.items()} if isinstance(lora, Mapping) else lora
        self.trainable = trainable.prepare(model, freeze, lora)  # adapters added, parts frozen
        self.guided = GuidedAlignment.from_config(guided_alignment)
        if self.guided.weight:
            self.guided.check_model(model)
        if isinstance(length_buckets, str):
            if length_buckets != "auto":
                raise ValueError(f"module.length_buckets={length_buckets}: give auto or a list of increasing edges")
        else:
            length_buckets = [int(edge) for edge in length_buckets]  # a plain list, not Hydra's ListConfig
        if val_len_cap is not None:
            if len(val_len_cap) != 2:
                raise ValueError(f"module.val_len_cap must be [a, b] (a * reference length + b) or null, got {list(val_len_cap)}")
            val_len_cap = [float(x) for x in val_len_cap]
        # Plain values only: checkpoints load with weights_only=True (the partials are rebuilt from the run config).
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler", "val_decoding", "test_decoding"], logger=False)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.val_decoding = val_decoding
        self.test_decoding = test_decoding or val_decoding
        self._outputs: dict[str, list[tuple[int, str]]] = {"val": [], "test": []}
        self._tick: float | None = None
        self.train_tokens = 0  # source + target tokens trained on (this rank), for throughput
        self.train_tgt_tokens = 0  # of which target tokens
        self.train_seconds = 0.0  # time in training steps, validation excluded
        self.best_bleu = -math.inf
        self.skipped_steps = 0  # steps whose loss was not finite, in total
        self.nonfinite_in_a_row = 0
        self._drop_update = False
        self._check_compiled = True  # the compiled pass against eager on the first training batch (compiling.checked_loss)
        self._update_tokens = 0  # target tokens of the micro-batches of the optimizer step under way, this process
        self.last_results: dict[str, Any] = {}
        # Set by train(): saved in every checkpoint so translation needs nothing else.
        self.run_config: dict[str, Any] | None = None
        self.tokenizer_protos: dict[str, bytes] | None = None
        self.loaded_step: int | None = None  # global step of the checkpoint loaded last (resume, test)
        self.monitor_step: int | None = None  # the step of the last validation score
        self.validations: list[dict[str, Any]] = []  # this process's validations: step, sentences, seconds, BLEU
        # Set by train() for a fine-tuning run (init_from): where its weights came from (saved in its
        # checkpoints, restored on resume), and with init_optimizer=keep the file's optimizer state.
        self.init_origin: dict[str, Any] | None = None
        self.init_optimizer_state: dict[str, Any] | None = None

    # --- training -------------------------------------------------------------------------
    def loss(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Label-smoothed loss per target token (plus the weighted guided-alignment loss of a batch
        with alignments), and the plain NLL (for perplexity)."""
        loss, nll, align = self.losses(batch)
        return (loss if align is None else loss + self.guided.weight * align), nll

    def losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor | None]:
        """Label-smoothed loss per target token, the plain NLL, and the guided-alignment loss where
        it is on and the batch carries alignments (``align``), else None. The output layer runs on
        the real target positions only: padding never reaches the vocabulary."""
        align = None
        if self.guided.weight and "align" in batch:
            hidden, weights = self.model.features_with_attention(batch["src"], batch["src_mask"], batch["tgt_in"],
                                                                 self.guided.layer)
            align = guided_alignment_loss(self.guided.attention(weights), batch["align"])
        else:
            hidden = self.model.features(batch["src"], batch["src_mask"], batch["tgt_in"])  # (B, T, H)
        real = batch["tgt_out"] != PAD
        hidden, target = hidden[real], batch["tgt_out"][real]
        # Rows of the output layer past the vocabulary (padded to a multiple of 8) are never targets.
        size = self.model.tgt_vocab_size
        weight = self.model.decoder.out.weight[:size]
        bias = getattr(self.model.decoder.out, "bias", None)
        bias = None if bias is None else bias[:size]
        fixed = getattr(self.model.decoder, "fixed_logits", None)  # (V,) True where the logit is NEVER
        if fixed is not None:  # NEVER added to those logits: their softmax is 0, so their rows get no gradient
            bias = (weight.new_zeros(size) if bias is None else bias).masked_fill(fixed[:size], NEVER)
        eps = self.hparams.label_smoothing  # spread over the entries a target can be: not PAD, not BOS
        ops = self.model.kernels.ops(hidden)
        return (*ops.output_cross_entropy(hidden, weight, target, eps, NOT_TARGETS, bias=bias), align)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if self._check_compiled and getattr(self.model, "compiled", False):  # the first batch, compiled: checked
            loss, nll, align = checked_loss(self.model, lambda: self.losses(batch))
        else:
            loss, nll, align = self.losses(batch)
        self._check_compiled = False
        if align is not None:
            self.log("train/align_loss", align)
        total = loss if align is None else loss + self.guided.weight * align
        if self.normalised_per_update():
            # the batch's sum over its target tokens; on_before_optimizer_step divides the update's
            # gradients by the target tokens of all its micro-batches on all processes
            self._update_tokens += int(batch["num_tgt_tokens"])
            total = total * batch["num_tgt_tokens"]
        if not self._is_finite(total):
            self._skip_step(total)
            return total  # backward still runs (every DDP rank takes part); the update is dropped
        self.nonfinite_in_a_row = 0
        self.log("train/loss", loss, prog_bar=True)  # the objective: label-smoothed, so above train/nll
        self.log("train/nll", nll, prog_bar=True)  # what val/nll measures
        self.log("train/ppl", torch.exp(nll))
        now = time.perf_counter()
        tokens = batch["num_src_tokens"] + batch["num_tgt_tokens"]
        if self._tick is not None:  # time since the previous step: one full step, data included
            self.log("train/tokens_per_sec", tokens / (now - self._tick))
            self.train_tokens += tokens
            if self.train_tgt_tokens is not None:
                self.train_tgt_tokens += batch["num_tgt_tokens"]
            self.train_seconds += now - self._tick
        self._tick = now
        return total

    def _is_finite(self, loss: Tensor) -> bool:
        """Costs one host sync per step (on a GPU the backward is queued once the forward is done;
        the progress bar reads train/loss every step anyway). Under DDP the ranks agree, so all
        of them skip the same steps."""
        return self.trainer.strategy.reduce_boolean_decision(bool(torch.isfinite(loss.detach())), all=True)

    def _skip_step(self, loss: Tensor) -> None:
        self._drop_update = True
        self.skipped_steps += 1
        self.nonfinite_in_a_row += 1
        log.warning("step %d: loss is %s; skipping this update (%d in a row, %d in total)",
                    self.global_step, loss.item(), self.nonfinite_in_a_row, self.skipped_steps)
        limit = self.hparams.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            bad = nonfinite(self.model.named_parameters())
            weights = f"non-finite weights in {', '.join(bad[:5])}" if bad else "the weights are finite"
            raise RuntimeError(
                f"training stopped: {self.nonfinite_in_a_row} consecutive steps had a non-finite loss "
                f"(steps {self.global_step - limit + 1}-{self.global_step}, module.max_nonfinite_steps={limit}; "
                f"{weights}). Resume from the last checkpoint with a lower optimizer.lr or "
                f"trainer.gradient_clip_val, or check the data of these batches."
            )

    def normalised_per_update(self) -> bool:
        """Whether an optimizer step sums several micro-batches (gradient accumulation) or processes
        (DDP): then the loss is normalised by the target tokens of the whole update, as fairseq
        does, not averaged per micro-batch (which weighs a token of a batch of short sentences
        more than one of long sentences). One batch on one process: the batch's mean, the same."""
        trainer = self._trainer
        return trainer is not None and (trainer.accumulate_grad_batches > 1 or trainer.world_size > 1)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients of a skipped step (optimizers leave parameters without one
        untouched); else, for a loss normalised per update, divide the gradients by the update's
        target tokens (Lightning divided each micro-batch's loss by their number, and DDP averaged
        over the processes: both undone here). Before clipping, after fp16's unscaling."""
        tokens, self._update_tokens = self._update_tokens, 0
        if self._drop_update:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self._drop_update = False
            return
        if self.normalised_per_update():
            total = self.trainer.strategy.reduce(torch.tensor(float(tokens), device=self.device), reduce_op="sum")
            factor = self.trainer.accumulate_grad_batches * self.trainer.world_size / total.clamp(min=1.0)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor.to(p.grad.dtype))

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Without loss scaling (fp32, bf16) clip here: Lightning refuses to clip for a fused
        optimizer under any mixed precision, though only fp16's scaled gradients need that."""
        if gradient_clip_val and self._loss_scaler() is None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_epoch_start(self) -> None:
        self._tick = None

    def on_validation_epoch_start(self) -> None:
        self._tick = None
        self._eval_started = time.perf_counter()

    def on_test_epoch_start(self) -> None:
        self._eval_started = time.perf_counter()

    def _log_evaluation(self, stage: str, scores: dict[str, Any]) -> None:
        """One line per validation or test: what it scored and how long decoding and scoring took
        (validations are also kept in ``validations``, for the run summary)."""
        seconds, sentences = time.perf_counter() - self._eval_started, len(self.last_results[stage]["hyps"])
        step = self.global_step if stage == "val" else self.tested_checkpoint()["step"]  # train=false: the file's
        log.info("%s at step %d: BLEU %.2f, %d sentences in %.1f s, hypothesis/reference length %.2f",
                 "validation" if stage == "val" else "test", step, scores["bleu"],
                 sentences, seconds, scores["length_ratio"])
        if stage == "val":
            self.validations.append({"step": self.global_step, "sentences": sentences, "seconds": round(seconds, 2),
                                     "bleu": round(float(scores["bleu"]), 2)})

    def _loss_scaler(self) -> Any:
        trainer = getattr(self, "_trainer", None)
        return getattr(trainer.precision_plugin, "scaler", None) if trainer is not None else None

    def configure_optimizers(self) -> Any:
        kwargs = {}
        if self._loss_scaler() is not None and getattr(self.optimizer, "keywords", {}).get("fused"):
            # fp16 loss scaling: gradients must be unscaled before clipping, outside the optimizer
            log.info("16-mixed precision: the optimizer runs unfused so gradients can be unscaled and clipped")
            kwargs["fused"] = False
        # frozen parameters (module.freeze, module.lora) are not the optimizer's: no moments for them
        optimizer = self.optimizer(params=trainable.trained_parameters(self), **kwargs)
        if self.init_optimizer_state is not None:  # init_optimizer=keep: the moments, not the rates, of the file
            load_optimizer_state(optimizer, self.init_optimizer_state, f"init_from={self.init_origin['path']}")
            self.init_optimizer_state = None
        if self.scheduler is None:
            return optimizer
        built = self.scheduler(optimizer)
        scheduler = {"scheduler": built, "interval": "step"}
        if isinstance(built, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.update(interval="epoch", monitor=self.hparams.monitor)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    # --- evaluation -----------------------------------------------------------------------
    def _decode(self, batch: dict[str, Any], stage: str) -> None:
        search = self.val_decoding if stage == "val" else self.test_decoding
        datamodule = self.trainer.datamodule
        forced = {}
        if getattr(datamodule, "target_prefixed", False) and "tgt_out" in batch:
            forced["prefix"] = batch["tgt_out"][:, :1]  # each target language's code, forced as translate.py forces it
        cap = self.hparams.val_len_cap
        if stage == "val" and cap and "tgt_out" in batch:  # stop hypotheses at a * reference length + b (+ EOS)
            ref_len = (batch["tgt_out"] != PAD).sum(1) - 1
            hyps = search(self.model, batch["src"], batch["src_mask"], max_len=(cap[0] * ref_len + cap[1]).long() + 1,
                          **forced)
        else:
            hyps = search(self.model, batch["src"], batch["src_mask"], **forced)
        if forced:  # the forced code is cut, as translate.py cuts it
            texts = datamodule.tgt_vocab.decode_batch([tokens[1:] for tokens in hyps.tokens])
        else:
            texts = datamodule.tgt_vocab.decode_batch(hyps.tokens)
            if hasattr(datamodule, "untagged_targets"):  # an output starting with its language's tag is scored without it
                texts = datamodule.untagged_targets(texts)
        self._outputs[stage].extend(zip(batch["ids"].tolist(), texts))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss, nll = self.loss(batch)
        tokens = batch["num_tgt_tokens"]
        self.log("val/loss", loss, batch_size=tokens, sync_dist=True)
        self.log("val/nll", nll, batch_size=tokens, sync_dist=True)
        self._decode(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._decode(batch, "test")

    def _gather(self, stage: str) -> tuple[list[int], list[str]]:
        """Ids and hypotheses of the sentences every rank decoded, in data set order, each once."""
        outputs = self._outputs[stage]
        self._outputs[stage] = []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, outputs)
            outputs = [pair for part in gathered for pair in part]
        pairs = sorted(dict(outputs).items())
        return [i for i, _ in pairs], [text for _, text in pairs]

    def _score(self, stage: str, split: str) -> dict[str, Any]:
        """BLEU/chrF of the decoded sentences against their references: the whole split, or the
        sentences of the batches decoded under ``limit_*_batches``, ``fast_dev_run`` or
        ``overfit_batches`` (logged as such)."""
        ids, hyps = self._gather(stage)
        sources, refs = self.trainer.datamodule.raw(split)
        if len(ids) != len(refs):
            limit = self.trainer.limit_val_batches if stage == "val" else self.trainer.limit_test_batches
            limited = self.trainer.overfit_batches > 0 or self.trainer.fast_dev_run or not (
                isinstance(limit, float) and limit == 1.0)
            if not limited or not ids or ids[-1] >= len(refs):  # no limit lets sentences through unscored
                raise RuntimeError(f"{stage}: decoded {len(ids)} sentences but the {split} split has {len(refs)}")
            log.info("%s: scoring the %d of %d %s sentences decoded (the batches Lightning's limits let through)",
                     stage, len(ids), len(refs), split)
            sources, refs = [sources[i] for i in ids], [refs[i] for i in ids]
        scores = corpus_scores(hyps, refs, tokenize=self._tokenize())
        self.last_results[stage] = {"hyps": hyps, "refs": refs, "sources": sources, "ids": ids, **scores}
        return scores

    def _tokenize(self) -> str | None:
        """sacreBLEU's tokenizer of the data's target language (``sacrebleu_tokenize``; auto: ``nmt.languages.writing``)."""
        return writing.resolve_tokenize(self.hparams.sacrebleu_tokenize, getattr(self.trainer.datamodule, "tgt_lang", ""))

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self._outputs["val"] = []
            return
        bad = nonfinite(self.model.named_parameters())
        if bad:
            self._outputs["val"] = []
            raise RuntimeError(
                f"non-finite weights after step {self.global_step} ({', '.join(bad[:5])}): this model is "
                f"neither scored nor saved; resume from the last checkpoint with a lower optimizer.lr"
            )
        scores = self._score("val", getattr(self.trainer.datamodule, "val_split", "valid"))
        self.monitor_step = self.global_step
        if self.trainer.state.fn == "fit":  # not the full set's validation after training (train.py)
            self.best_bleu = max(self.best_bleu, scores["bleu"])
        # Every rank scored the same gathered hypotheses: the mean over ranks is that score.
        self.log("val/bleu", scores["bleu"], prog_bar=True, sync_dist=True)
        self.log("val/chrf", scores["chrf"], sync_dist=True)
        self.log("val/bleu_best", self.best_bleu, sync_dist=True)
        ppl = self.trainer.callback_metrics.get("val/nll")
        if ppl is not None:
            self.log("val/ppl", torch.exp(ppl))
        results = self.last_results["val"]
        for i in range(min(self.hparams.num_samples, len(results["hyps"]))):
            log.info("sample %d\n  src: %s\n  ref: %s\n  hyp: %s", i, results["sources"][i], results["refs"][i], results["hyps"][i])
        self._log_evaluation("val", scores)

    def on_validation_end(self) -> None:
        fixed_beam.release(self.model)  # the searches' CUDA graphs: the weights change before the next validation

    def on_test_end(self) -> None:
        fixed_beam.release(self.model)

    def on_test_epoch_end(self) -> None:
        scores = self._score("test", "test")
        self._log_evaluation("test", scores)
        self.log("test/bleu", scores["bleu"], sync_dist=True)
        self.log("test/chrf", scores["chrf"], sync_dist=True)
        if self.hparams.report_dir and self.trainer.is_global_zero:
            self.write_test_report(Path(self.hparams.report_dir))

    def write_test_report(self, out_dir: Path) -> None:
        """Test hypotheses and the BLEU-by-source-length report (CSV, JSON, markdown, PNG)."""
        results = self.last_results["test"]
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("hyps", "sources", "refs"):  # the refs: what the study scores with COMET (nmt-study --comet)
            (out_dir / TEST_TEXT.format(name)).write_text("".join(h + "\n" for h in results[name]), encoding="utf-8")
        datamodule = self.trainer.datamodule
        sources = directions.untagged(results["sources"])  # a multilingual split's tags are not words
        options, by_direction = directions.report_options(datamodule, self.hparams.length_buckets,
                                                          self.hparams.sacrebleu_tokenize)
        report = length_report(sources, results["hyps"], results["refs"], **options)
        report["checkpoint"] = self.tested_checkpoint()
        name = self.hparams.report_name or type(self.model.decoder).__name__
        paths = write_report(report, out_dir, name=name)
        results.update(report=report, report_paths=paths)
        log.info("BLEU by source length -> %s", paths["md"])
        if "test" in getattr(datamodule, "origins", {}):  # several directions: a row each (nmt.evaluation.directions)
            split = directions.plan(datamodule)
            split.origins = split.origins[np.asarray(results["ids"], dtype=np.int64)]
            directions.write_direction_reports(split, results["sources"], {name: results["hyps"]}, results["refs"],
                                               out_dir, **by_direction)

    def tested_checkpoint(self) -> dict[str, Any]:
        """The checkpoint file the test decoded with, and its step (in-memory weights: no file)."""
        path = self.trainer.ckpt_path
        return {"path": str(path) if path else None, "step": self.loaded_step if path else self.global_step}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Everything added here is a tensor or a plain container (weights-only loading).

        Refuses (ValueError) to save non-finite weights, so a diverged model never replaces a good
        checkpoint. Lightning calls this hook on every rank and DDP keeps the ranks' weights equal,
        so under DDP all ranks stop together; a check in the file writer (rank 0 only) would stop
        rank 0 alone and leave the others to fail or wait at their next collective."""
        bad = nonfinite(self.named_parameters())
        if bad:
            raise ValueError(
                f"refusing to save a checkpoint after step {self.global_step}: non-finite weights in "
                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; the checkpoints already written are kept. "
                f"Resume from the last one with a lower optimizer.lr"
            )
        checkpoint["nmt_format"] = FORMAT
        checkpoint["kind"] = "training"
        checkpoint["best_bleu"] = self.best_bleu
        bleu = self.trainer.callback_metrics.get(self.hparams.monitor) if self._trainer is not None else None
        # The last validation's score, and its step: the score of these weights only if the steps agree.
        checkpoint["monitor"] = {"name": self.hparams.monitor, "value": None if bleu is None else float(bleu),
                                 "step": self.monitor_step}
        checkpoint["counters"] = {name: getattr(self, name) for name in self.COUNTERS}
        checkpoint["world_size"] = self._trainer.world_size if self._trainer is not None else 1
        numpy_state = np.random.get_state(legacy=False)
        numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
        torch_states = torch_rng_states()
        checkpoint["rng"] = {"python": random.getstate(), "numpy": numpy_state, **torch_states}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank saves (Lightning calls this hook on all of them); rank 0 writes the file.
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, torch_states)
            checkpoint["rng"]["ranks"] = ranks
        if self.run_config is not None:
            checkpoint["run_config"] = self.run_config
        if self.tokenizer_protos is not None:
            checkpoint["tokenizers"] = self.tokenizer_protos
        if self.init_origin is not None:
            checkpoint["init_from"] = self.init_origin

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A resumed fit (or a module loaded outside a Trainer) takes the checkpoint's counters, best
        score and RNG state; testing or validating a checkpoint takes its weights and step only, so
        the run's counters and random streams stay the run's."""
        trainer = getattr(self, "_trainer", None)
        self.loaded_step = checkpoint.get("global_step")
        if trainer is not None and trainer.state.fn != "fit":
            return
        if (trainer is not None and "current_model_state" in checkpoint
                and not any(isinstance(cb, WeightAveraging) for cb in trainer.callbacks)):
            # A checkpoint of a run with an EMA, resumed without one: go on training the raw weights.
            checkpoint["state_dict"] = checkpoint["current_model_state"]
            log.info("the checkpoint holds an EMA of the weights; resuming without callbacks.ema trains the raw weights")
        self.best_bleu = checkpoint.get("best_bleu", -math.inf)
        self.init_origin = checkpoint.get("init_from")  # a resumed fine-tuning run goes on recording its origin
        for name, value in checkpoint.get("counters", {}).items():
            if name in self.COUNTERS:  # a file sets these counters and nothing else of the module
                setattr(self, name, value)
        if "counters" in checkpoint and "train_tgt_tokens" not in checkpoint["counters"]:
            self.train_tgt_tokens = None  # a checkpoint from before this counter: unknown
        rng = checkpoint.get("rng")
        world = trainer.world_size if trainer is not None else 1
        saved_world = checkpoint.get("world_size", len((rng or {}).get("ranks") or [None]))
        if trainer is not None and saved_world != world:
            self._resume_on_other_ranks(saved_world, world, checkpoint.get("global_step"))
        if rng:
            random.setstate(rng["python"])
            numpy_state = rng["numpy"]
            if isinstance(numpy_state, dict):  # format 2: the key as an int64 tensor
                numpy_state = {**numpy_state, "state": {**numpy_state["state"],
                                                         "key": numpy_state["state"]["key"].numpy().astype(np.uint32)}}
            np.random.set_state(numpy_state)
            ranks = rng.get("ranks")
            if ranks and len(ranks) == world:
                rng = ranks[trainer.global_rank]  # else every rank starts from rank 0's (the top-level state)
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] is not None and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def _resume_on_other_ranks(self, saved_world: int, world: int, step: int | None) -> None:
        """A checkpoint of `saved_world` processes resumed on `world`: the per-rank token counters
        are rescaled so that counter x processes, the run's total, carries over; says what
        continues exactly and what does not (the data loader re-splits the epoch's rest)."""
        for name in ("train_tokens", "train_tgt_tokens"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, round(value * saved_world / world))
        if self.trainer.is_global_zero:
            log.info("resuming a checkpoint of %d process(es) on %d: weights, optimizer, learning-rate schedule and "
                     "step %s continue exactly; the rest of the epoch's batches is split anew over %d process(es); "
                     "every process's torch RNG starts from rank 0's saved state; the per-process token counters "
                     "are rescaled by %d/%d", saved_world, world, step, world, saved_world, world)


def torch_rng_states() -> dict[str, Any]:
    """This process's global torch RNG states: CPU, and every CUDA device's once CUDA is initialised."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}
