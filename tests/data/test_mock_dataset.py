"""--mock-data: deterministic, learnable, any size, same sampling as real data."""

from __future__ import annotations

import numpy as np

from megamoe.config import DataConfig
from megamoe.data import MockIndexedDataset, build_gpt_datasets, build_tokenizer


def test_documents_are_progressions_ending_in_eod():
    m = MockIndexedDataset(vocab_size=11, eod=4, seq_length=8, seed=0, num_documents=50)
    for d in range(50):
        doc = m.document(d)
        assert len(doc) == m.sequence_lengths[d] and doc[-1] == 4
        body = doc[:-1]
        assert np.all((body >= 0) & (body < 11) & (body != 4))
        raw = body - (body > 4)  # undo the skip over eod
        if len(raw) >= 3:  # next token is determined by the previous two
            diffs = np.diff(raw) % 10
            assert np.all(diffs == diffs[0])
    assert np.array_equal(m.get(3, 1, 2), m.document(3)[1:3])
    again = MockIndexedDataset(vocab_size=11, eod=4, seq_length=8, seed=0, num_documents=50)
    assert all(np.array_equal(m.document(d), again.document(d)) for d in range(50))


def test_mock_datasets_any_size_and_deterministic():
    tok = build_tokenizer("NullTokenizer", vocab_size=97)
    cfg = DataConfig(mock_data=True, eod_mask_loss=True)
    train, valid, test = build_gpt_datasets(cfg, tok, (50_000, 64, 0), seq_length=16, seed=5)
    assert len(train) >= 50_000 and len(valid) >= 64 and test is None
    again = build_gpt_datasets(cfg, tok, (50_000, 64, 0), seq_length=16, seed=5)[0]
    for i in (0, 1, 49_999):
        a, b = train[i], again[i]
        assert all(a[k].tolist() == b[k].tolist() for k in a)
        assert int(a["tokens"].max()) <= 97  # eod = 97 is the largest id
        assert a["loss_mask"][a["tokens"] == 97].sum() == 0
