"""Multi-rank checkpoints through ``torch.distributed.checkpoint`` (DCP), on every tier.

* :class:`Writer` / :class:`Reader`: DCP's ``StorageWriter`` / ``StorageReader`` over any
  fmstore Store (a directory, ``s3://``, ``memory://``, a configured tier);
* :class:`Stager`: DCP's ``AsyncStager`` with staging buffers reused across saves;
* :func:`async_save`: ``dcp.async_save`` with both, releasing the buffers when the save ends.

Usage::

    import torch.distributed.checkpoint as dcp
    from fmstore.checkpoint.dcp import Reader, Writer

    dcp.save(state, storage_writer=Writer("s3://bucket/run/step-100"))
    dcp.load(state, storage_reader=Reader("s3://bucket/run/step-100"))
"""

from __future__ import annotations

from .api import async_save, inspect_checkpoint, is_dcp_checkpoint, to_torch_save, verify_checkpoint
from .manifest import DCP_FORMAT_NAME, DCP_FORMAT_VERSION, DcpManifest
from .reader import Reader, ReadOptions, read_manifest
from .staging import Stager
from .writer import WriteOptions, Writer

__all__ = [
    "DCP_FORMAT_NAME",
    "DCP_FORMAT_VERSION",
    "DcpManifest",
    "ReadOptions",
    "Reader",
    "Stager",
    "WriteOptions",
    "Writer",
    "async_save",
    "inspect_checkpoint",
    "is_dcp_checkpoint",
    "read_manifest",
    "to_torch_save",
    "verify_checkpoint",
]
