"""`--mock-data`: deterministic synthetic documents a model can actually learn.

Each document is an arithmetic progression modulo the content vocabulary
(`x_t = (a + b * t) mod V`, random start a and step b per document) followed by eod, so
the next token is a function of the previous two and the loss of a working model falls
well below log(V). Documents are generated on demand from (seed, document id); only their
lengths are stored. The mock looks like an IndexedDataset (one sequence per document), so
GPTDataset's splitting, epochs and shuffling apply unchanged.
"""

from __future__ import annotations

import numpy as np

from megamoe.data.errors import DataError

MOCK_NUM_DOCUMENTS = 8192
_MAX_STEP = 8


class MockIndexedDataset:
    """In-memory stand-in for IndexedDataset with `num_documents` progression documents.

    Token ids are in [0, vocab_size) and never equal eod except as each document's last
    token. Document lengths (eod included) are uniform in [2, 2 * seq_length].
    """

    path_prefix = None

    def __init__(self, vocab_size: int, eod: int, seq_length: int, seed: int,
                 num_documents: int = MOCK_NUM_DOCUMENTS) -> None:
        if vocab_size < 3 or not 0 <= eod < vocab_size:
            raise DataError(f"--mock-data needs a vocabulary of >= 3 tokens including eod, "
                            f"got vocab_size={vocab_size}, eod={eod}")
        self.vocab_size, self.eod, self.seed = vocab_size, eod, seed
        self.content_vocab = vocab_size - 1  # every id but eod
        rng = np.random.RandomState(seed)
        self.sequence_lengths = rng.randint(2, 2 * seq_length + 1, size=num_documents,
                                            dtype=np.int64).astype(np.int32)
        self.document_indices = np.arange(num_documents + 1, dtype=np.int64)
        self.description = {"mock": True, "vocab_size": vocab_size, "eod": eod,
                            "seq_length": seq_length, "seed": seed,
                            "num_documents": num_documents}

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def document(self, idx: int) -> np.ndarray:
        """All tokens of document `idx`: a progression mod V, then eod."""
        rng = np.random.RandomState([self.seed, idx])
        start = rng.randint(self.content_vocab)
        step = rng.randint(1, _MAX_STEP + 1)
        n = int(self.sequence_lengths[idx]) - 1
        values = (start + step * np.arange(n, dtype=np.int64)) % self.content_vocab
        values = values + (values >= self.eod)  # skip over the eod id
        return np.append(values, self.eod)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        doc = self.document(idx)
        end = len(doc) if length is None else offset + length
        if offset < 0 or end > len(doc) or end < offset:
            raise IndexError(f"tokens [{offset}, {end}) outside mock document {idx}")
        return doc[offset:end]
