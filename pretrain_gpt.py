#!/usr/bin/env python
"""Pretrain a (Mixture-of-Experts) GPT with Megatron-LM flags.

    torchrun --nproc_per_node N pretrain_gpt.py --num-layers ... --num-experts 8 ...

Runs with plain `python` for one process. See README.md and scripts/.
"""

import sys

from megamoe.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
