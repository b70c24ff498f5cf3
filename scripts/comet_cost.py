"""What COMET (wmt22-comet-da) costs on this CPU: sentences encoded per second by the estimator at
its real sizes (XLM-R large: 24 layers, 1024 wide, 250,002 pieces; ``nmt.evaluation.comet``), with
random weights, since the time does not depend on their values and needs no download.

    OMP_NUM_THREADS=1 python scripts/comet_cost.py --sentences 48 --pieces 32 --out comet_cost.json

A test set of N sentences costs 3N encodings for the first system (sources, hypotheses,
references) and N for each further one (``Comet`` encodes each distinct sentence once); the
regressor on top is negligible. Writes ``sentences_per_second`` (per second of the process's CPU
time over its threads, so other work on the machine does not count; ``wall_sentences_per_second``
beside it) and the derived minutes per 1,000-sentence test set to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nmt.evaluation.comet import CometEstimator, Head
from nmt.machine import cpu_name

XLMR_LARGE = {"vocab_size": 250002, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
              "intermediate_size": 4096, "max_position_embeddings": 514, "type_vocab_size": 1, "layer_norm_eps": 1e-5}
WMT22_HEAD = Head(layer="mix", layer_transformation="sparsemax", layer_norm=False, pool="avg",
                  hidden_sizes=(3072, 1024), activations="Tanh", final_activation=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=48, help="sentences encoded (after one warm-up batch)")
    parser.add_argument("--pieces", type=int, default=32, help="XLM-R pieces per sentence, <s> and </s> included")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    encoder = XLMRobertaModel(XLMRobertaConfig(**XLMR_LARGE, pad_token_id=1, bos_token_id=0, eos_token_id=2),
                              add_pooling_layer=False)
    model = CometEstimator(encoder, WMT22_HEAD).eval()
    ids = torch.randint(4, XLMR_LARGE["vocab_size"], (args.batch_size, args.pieces))
    ids[:, 0], ids[:, -1] = 0, 2
    with torch.inference_mode():
        model.embed(ids)  # warm-up
        start, cpu_start, done = time.perf_counter(), time.process_time(), 0
        while done < args.sentences:
            model.embed(ids)
            done += args.batch_size
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    rate = done / cpu_seconds * torch.get_num_threads()  # per second of the threads' own time: a busy machine's
    result = {"sentences_per_second": rate, "wall_sentences_per_second": done / seconds, "sentences": done, "pieces": args.pieces, "batch_size": args.batch_size,
              "threads": torch.get_num_threads(), "cpu": cpu_name(),
              "parameters": sum(p.numel() for p in model.parameters()),
              "minutes_per_1000_first_system": 3000 / rate / 60, "minutes_per_1000_further_system": 1000 / rate / 60}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
