"""Importing the peer writers the format tests use.

``mosaicml-streaming``'s package ``__init__`` imports its vision datasets, and so
``torchvision``, which this project's venv does not install: no torchvision wheel here is
built for its CPU torch (``make setup`` installs mosaicml-streaming without its
dependencies).  The MDS writer and reader live in ``streaming.base`` and never touch
torchvision, so they are imported from there, with the package's ``__init__`` not run.
No library is replaced by a stand-in: pytorch-lightning and transformers are the real ones.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def import_streaming_base():  # type: ignore[no-untyped-def]
    """``streaming.base`` (MDSWriter, StreamingDataset, ...), or None when
    mosaicml-streaming is not installed."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            return None
        # The package without its __init__ (which imports streaming.vision): its
        # subpackages import as usual below it.
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__file__ = spec.origin
        pkg.__spec__ = spec
        sys.modules["streaming"] = pkg
    import streaming.base

    return streaming.base


def import_mds_writer():  # type: ignore[no-untyped-def]
    """``streaming.base.MDSWriter``, or None when mosaicml-streaming is not installed."""
    base = import_streaming_base()
    return None if base is None else base.MDSWriter
