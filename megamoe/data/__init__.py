"""Data: Megatron `.bin/.idx` datasets, GPT samples, blending, tokenizers, mock data.

Names resolve lazily so tools that only tokenize and write `.bin/.idx` files
(tools/preprocess_data.py and its worker processes) never pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "BlendedDataset": "megamoe.data.blended_dataset",
    "DataError": "megamoe.data.errors",
    "GPTDataset": "megamoe.data.gpt_dataset",
    "IndexedDataset": "megamoe.data.indexed_dataset",
    "IndexedDatasetBuilder": "megamoe.data.indexed_dataset",
    "MockIndexedDataset": "megamoe.data.mock_dataset",
    "PretrainingSampler": "megamoe.data.samplers",
    "RandomPretrainingSampler": "megamoe.data.samplers",
    "build_gpt_datasets": "megamoe.data.builder",
    "build_tokenizer": "megamoe.data.tokenizers",
    "make_iterator": "megamoe.data.loaders",
    "tokenizer_for": "megamoe.data.loaders",
    "optimal_dtype": "megamoe.data.indexed_dataset",
}
__all__ = [
    "BlendedDataset",
    "DataError",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MockIndexedDataset",
    "PretrainingSampler",
    "RandomPretrainingSampler",
    "build_gpt_datasets",
    "build_tokenizer",
    "make_iterator",
    "optimal_dtype",
    "tokenizer_for",
]

if TYPE_CHECKING:
    from megamoe.data.blended_dataset import BlendedDataset
    from megamoe.data.builder import build_gpt_datasets
    from megamoe.data.errors import DataError
    from megamoe.data.gpt_dataset import GPTDataset
    from megamoe.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
    from megamoe.data.loaders import make_iterator, tokenizer_for
    from megamoe.data.mock_dataset import MockIndexedDataset
    from megamoe.data.samplers import PretrainingSampler, RandomPretrainingSampler
    from megamoe.data.tokenizers import build_tokenizer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megamoe.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
