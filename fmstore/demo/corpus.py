"""A small, deterministic text corpus and its byte-level tokens (no download needed)."""

from __future__ import annotations

import random

import numpy as np

_SUBJECTS = [
    "the model",
    "a checkpoint",
    "the optimizer",
    "each rank",
    "the loader",
    "a shard",
    "the daemon",
    "the cluster",
    "every tier",
    "the manifest",
    "a node",
    "the gradient",
]
_VERBS = [
    "writes",
    "reads",
    "streams",
    "exports",
    "verifies",
    "restores",
    "shards",
    "caches",
    "compresses",
    "releases",
    "commits",
    "averages",
]
_OBJECTS = [
    "the weights",
    "a manifest",
    "its chunks",
    "the tokens",
    "every blob",
    "the state",
    "a copy to S3",
    "the next batch",
    "the moments",
    "its checksum",
    "the learning rate",
]
_TAILS = [
    "before the step ends",
    "in the background",
    "on the fast tier",
    "without pickle",
    "after the commit",
    "when the node fails",
    "at every epoch",
    "in parallel",
    "",
]

#: Byte-level tokens: vocabulary of 256 (stored as uint16 like nanoGPT's token files).
VOCAB = 256


def make_text(n_sentences: int, seed: int = 0) -> str:
    """Sentences from a tiny grammar: structured enough that a small model's loss falls."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        tail = rng.choice(_TAILS)
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)] + (
            [tail] if tail else []
        )
        out.append(" ".join(words).capitalize() + ".")
    return "\n".join(out) + "\n"


def tokenize(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.uint16)
