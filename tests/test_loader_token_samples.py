"""Token datasets feed a model as they come: samples are ``int64`` (what ``nn.Embedding``
and ``cross_entropy`` take) while the tokens stay stored as compact ``uint16``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from fmstore.errors import ConfigError
from fmstore.loaders import StreamingDataset
from fmstore.loaders.writer import write_dataset

VOCAB = 50_000


@pytest.fixture
def tokens(tmp_path):
    arr = (np.arange(4096 + 1) * 7 % VOCAB).astype(np.uint16)
    arr.tofile(tmp_path / "train.bin")
    dst = str(tmp_path / "ds")
    write_dataset(tmp_path / "train.bin", dst, dtype="uint16")
    return arr, dst


def test_token_batches_go_straight_into_embedding_and_cross_entropy(tokens, tmp_path):
    arr, dst = tokens
    with open(f"{dst}/index.json") as f:
        assert json.load(f)["dtype"] == "uint16"  # stored compact
    ds = StreamingDataset(dst, str(tmp_path / "cache"), shuffle=False, seq_len=64)
    batch = next(iter(DataLoader(ds, batch_size=4)))
    assert batch.dtype == torch.int64 and batch.shape == (4, 65)
    np.testing.assert_array_equal(batch[0].numpy(), arr[:65])
    emb = torch.nn.Embedding(VOCAB, 8)
    logits = emb(batch[:, :-1]) @ emb.weight.T
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    assert torch.isfinite(loss)


def test_the_storage_dtype_on_request(tokens, tmp_path):
    arr, dst = tokens
    ds = StreamingDataset(
        dst, str(tmp_path / "cache"), shuffle=False, seq_len=64, sample_dtype=None
    )
    sample = next(iter(ds))
    assert sample.dtype == np.uint16
    np.testing.assert_array_equal(sample, arr[:65])
    with pytest.raises(ConfigError, match="sample_dtype must be one of"):
        StreamingDataset(dst, str(tmp_path / "c2"), seq_len=64, sample_dtype="float32")
