#!/usr/bin/env python
"""Build a run's dataset indices ahead of it (Megatron-LM's tools/prepare_cache.py).

    python tools/prepare_data_cache.py <the run's pretrain_gpt.py flags>

Takes the training command's flags unchanged and builds every index file the run will
read (the GPT document/sample/shuffle indices of each split and prefix, and the blending
indices) into --data-cache-path, or each prefix's cache/ directory, in this one CPU
process: no GPU, no process group. The training job's ranks then find the files and only
memory-map them. Prints how long each index took; exit 1 with one line on a data error,
2 on a bad flag.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megamoe.cli.arguments import parse_args  # noqa: E402
from megamoe.cli.main import USER_ERRORS  # noqa: E402
from megamoe.cli.mapping import config_from_args, run_config_from_args  # noqa: E402
from megamoe.config import DataConfig  # noqa: E402
from megamoe.data import build_gpt_datasets, tokenizer_for  # noqa: E402
from megamoe.training.pretrain import split_num_samples  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        data = config_from_args(DataConfig, args)
        tokenizer = tokenizer_for(data)
        run = run_config_from_args(args, tokenizer.vocab_size)
        num_samples = split_num_samples(run)
        start = time.perf_counter()
        datasets = build_gpt_datasets(run.data, tokenizer, num_samples,
                                      seq_length=run.model.seq_length, seed=run.train.seed)
    except USER_ERRORS as e:
        sys.stderr.write(f"prepare_data_cache.py: error: {e}\n")
        return 1
    sizes = [len(d) if d is not None else 0 for d in datasets]
    print(f"prepare_data_cache.py: train/valid/test indices for {list(num_samples)} samples "
          f"({sizes} available) ready in {time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
