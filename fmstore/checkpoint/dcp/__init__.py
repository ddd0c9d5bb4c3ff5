"""Multi-rank checkpoints through ``torch.distributed.checkpoint`` (DCP), on every tier.

* :class:`Writer` / :class:`Reader`: DCP's ``StorageWriter`` / ``StorageReader`` over any
  fmstore Store (a directory, ``s3://``, ``memory://``, a configured tier);
* :class:`Stager`: DCP's ``AsyncStager`` with staging buffers reused across saves;
* :func:`save` / :func:`async_save` / :func:`load`: DCP's with both, on a gloo group of
  their own; on a node-local tier of several nodes the committed manifest is copied to
  every node, and ``load`` is a collective restore (``docs/distributed.md``).

Usage::

    import torch.distributed.checkpoint as dcp
    from fmstore.checkpoint.dcp import Reader, Writer

    dcp.save(state, storage_writer=Writer("s3://bucket/run/step-100"))
    dcp.load(state, storage_reader=Reader("s3://bucket/run/step-100"))
"""

from __future__ import annotations

from .api import inspect_checkpoint, is_dcp_checkpoint, to_torch_save, verify_checkpoint
from .collective import async_save, checkpoint_group, load, save
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
    "checkpoint_group",
    "inspect_checkpoint",
    "is_dcp_checkpoint",
    "load",
    "read_manifest",
    "save",
    "to_torch_save",
    "verify_checkpoint",
]
