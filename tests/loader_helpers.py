"""Small datasets for the loader tests, written by fmstore's own writer."""

from __future__ import annotations

import json
from pathlib import Path

from fmstore.loaders import StreamingDataLoader, StreamingDataset, write_dataset


def write_jsonl(path: Path, n: int, pad: int = 40) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"i": i, "pad": "x" * pad}) + "\n")
    return path


def make_dataset(tmp: Path, n: int = 600, shard_size: int = 4000, **kw) -> str:
    src = write_jsonl(tmp / "src.jsonl", n)
    dst = str(tmp / "ds")
    write_dataset(src, dst, shard_size=shard_size, **kw)
    return dst


def ids(
    remote: str, cache: str, *, workers: int = 0, batch: int = 8, state=None, stop_after=None, **kw
):
    """Sample ids one rank sees through a StreamingDataLoader; optionally stop after
    ``stop_after`` batches and return the loader's state as well."""
    ds = StreamingDataset(remote, cache, batch_size=batch, transform=lambda s: s["i"], **kw)
    if state is not None:
        ds.load_state_dict(state)
    dl = StreamingDataLoader(ds, batch_size=batch, num_workers=workers)
    out: list[int] = []
    for k, b in enumerate(dl):
        out.extend(int(x) for x in b)
        if stop_after is not None and k + 1 == stop_after:
            return out, dl.state_dict()
    return out if stop_after is None else (out, dl.state_dict())
