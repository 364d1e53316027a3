"""Megatron-LM's flags that divide the decoder layers among the pipeline stages (their
meaning and rules: config/pipeline_split.py and config/pipeline_layout.py)."""

from __future__ import annotations

import argparse


def add_pipeline_split_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipeline split (Megatron-LM's)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the first pipeline stage (the middle stages "
                        "share the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the last pipeline stage")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="virtual pipeline stages (model chunks) per pipeline rank: each "
                        "rank's layers, even or uneven, split equally among them")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer when dividing the layers among "
                        "the stages (the first stage builds one transformer layer fewer)")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the loss (output layer) as one layer when dividing the layers "
                        "among the stages (the last stage builds one transformer layer fewer)")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help='the layers of every (virtual) stage, e.g. "Et*3|(tt|)*29,m|L": E '
                        "embedding, t transformer layer, m MTP layer, L loss; '|' separates "
                        "stages (PP x VPP of them), '(..)*n' and 'x*n' repeat, ',' is "
                        "cosmetic. The embedding must be on the first stage, the loss and "
                        "MTP layers on the last")
