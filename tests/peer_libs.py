"""Importing the peer writers the format tests use.

``mosaicml-streaming`` imports ``torchvision`` when it is imported (for its vision
datasets), and the PyPI torchvision wheel does not load on the CPU build of torch used
here ("operator torchvision::nms does not exist").  The MDS writer never touches
torchvision, so when the real one cannot load, a stand-in module with the three names
``streaming`` imports is registered first.
"""

from __future__ import annotations

import sys
import types


def _torchvision_stand_in() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]
        tv = types.ModuleType("torchvision")
        datasets = types.ModuleType("torchvision.datasets")
        transforms = types.ModuleType("torchvision.transforms")
        functional = types.ModuleType("torchvision.transforms.functional")
        datasets.VisionDataset = type("VisionDataset", (), {})  # type: ignore[attr-defined]
        datasets.CIFAR10 = type("CIFAR10", (), {})  # type: ignore[attr-defined]
        functional.to_tensor = lambda x: x  # type: ignore[attr-defined]
        tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional  # type: ignore[attr-defined]
        sys.modules.update({
            "torchvision": tv,
            "torchvision.datasets": datasets,
            "torchvision.transforms": transforms,
            "torchvision.transforms.functional": functional,
        })  # fmt: skip


def import_mds_writer():  # type: ignore[no-untyped-def]
    """``streaming.MDSWriter``, or None when mosaicml-streaming is not installed."""
    try:
        import streaming  # noqa: F401
    except ModuleNotFoundError:
        return None
    except Exception:
        _torchvision_stand_in()
        for name in list(sys.modules):
            if name == "streaming" or name.startswith("streaming."):
                del sys.modules[name]
    from streaming import MDSWriter

    return MDSWriter
