"""Join Megatron `.bin/.idx` datasets (e.g. preprocess_data.py partitions) into one,
with Megatron-LM's tools/merge_datasets.py options and order.

    python tools/merge_datasets.py --input data/parts --output-prefix data/merged

Every `PREFIX.bin` + `PREFIX.idx` pair in the --input directory is appended in sorted
prefix order (as Megatron's); the output takes the first dataset's dtype. A missing half
of a pair, a corrupt index or a dtype mismatch prints one line naming the file and exits
1 (Megatron asserts); the output is published only when complete. --multimodal (Megatron's
per-sequence modes) is refused: megamoe's index has no modes.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megamoe.data import DataError, IndexedDataset, IndexedDatasetBuilder  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="merge_datasets.py", description=__doc__.split("\n\n")[0])
    p.add_argument_group("input data").add_argument(
        "--input", required=True, help="directory holding the .bin/.idx pairs to merge")
    p.add_argument_group("output data").add_argument(
        "--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    p.add_argument_group("miscellaneous").add_argument("--multimodal", action="store_true")
    args = p.parse_args(argv)
    if args.multimodal:
        p.exit(2, "merge_datasets.py: error: not supported yet: --multimodal (megamoe's "
                  "indexed datasets have no per-sequence modes)\n")
    return args


def dataset_prefixes(directory: str) -> list[str]:
    """Sorted prefixes of the complete .bin/.idx pairs in `directory`."""
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: not a directory (--input)")
    prefixes = set()
    for name in os.listdir(directory):
        prefix, ext = os.path.splitext(name)
        if not os.path.isfile(os.path.join(directory, name)) or ext not in (".bin", ".idx"):
            continue
        pair = os.path.join(directory, prefix) + (".bin" if ext == ".idx" else ".idx")
        if not os.path.isfile(pair):
            raise DataError(f"{pair}: file not found (the other half of "
                            f"{os.path.join(directory, name)})")
        prefixes.add(prefix)
    if not prefixes:
        raise DataError(f"{directory}: no .bin/.idx datasets to merge")
    return [os.path.join(directory, p) for p in sorted(prefixes)]


def merge(directory: str, output_prefix: str) -> int:
    """Merge; returns the number of documents written."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"{out_dir}: not a directory (--output-prefix)")
    prefixes = dataset_prefixes(directory)
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetBuilder(output_prefix + ".bin", dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(output_prefix + ".idx")
        return len(builder.document_indices) - 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        n_docs = merge(args.input, args.output_prefix)
    except DataError as e:
        sys.stderr.write(f"merge_datasets.py: error: {e}\n")
        return 1
    sys.stderr.write(f"merged {n_docs} documents -> {args.output_prefix}.bin/.idx\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
