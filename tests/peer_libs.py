"""Importing the peer writers the format tests use.

``mosaicml-streaming`` imports ``torchvision`` when it is imported (for its vision
datasets), and the PyPI torchvision wheel does not load on the CPU build of torch used
here ("operator torchvision::nms does not exist").  The MDS writer never touches
torchvision, so when the real one cannot load, a stand-in torchvision (every name an empty
class) is registered first; :func:`prepare_trainer_libs` does the same for transformers and
pytorch-lightning.
"""

from __future__ import annotations

import sys
import types

#: Set on every stand-in torchvision module, so a later caller can tell it from the real one.
STAND_IN = "__fmstore_stand_in__"


def _torchvision_stand_in() -> None:
    """The stand-in below, unless the real torchvision loads."""
    if not _real_torchvision_loads():
        _permissive_torchvision()


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


_permissive_installed = False


def _permissive_torchvision() -> None:
    """Register an importer for ``torchvision`` and all its submodules whose every name is
    an empty class (classes of classes on attribute access).  ``pytorch_lightning`` imports
    ``torchmetrics``, which imports dozens of torchvision names at import time (its image
    metrics) because the torchvision distribution is installed; the Trainer never uses them.
    Only used when the real torchvision cannot load; installed once."""
    global _permissive_installed
    if _permissive_installed:
        return
    _permissive_installed = True
    import importlib.abc
    import importlib.machinery

    def _init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        pass

    class _Name(type):
        def __getattr__(cls, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Name(name, (), {"__init__": _init})

    class _Importer(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):  # type: ignore[no-untyped-def]
            mod = types.ModuleType(spec.name)
            setattr(mod, STAND_IN, True)

            def getattr_(name: str) -> type:
                if name.startswith("__"):
                    raise AttributeError(name)
                if name in ("VisionDataset", "CIFAR10"):  # bases of streaming's vision classes
                    return type(name, (), {"__init__": _init})
                return _Name(name, (), {"__init__": _init})

            mod.__getattr__ = getattr_  # type: ignore[method-assign]
            mod.__path__ = []
            return mod

        def exec_module(self, module):  # type: ignore[no-untyped-def]
            pass

    sys.meta_path.insert(0, _Importer())


_trainer_libs_ready = False


def prepare_trainer_libs() -> None:
    """Make ``pytorch_lightning`` and ``transformers`` importable side by side when the
    installed torchvision does not load on this torch (see the module docstring).

    When the real torchvision loads, nothing is done.  Otherwise, whatever ran before (a
    stand-in for mosaicml-streaming may already be registered): transformers is imported
    with torchvision blocked and told it is unavailable, so it never imports it (its image
    code paths are then off); then the permissive stand-in above replaces any other, for
    torchmetrics, which pytorch_lightning imports and which trusts the installed
    distribution's metadata rather than an import.  Neither library uses torchvision for
    the CPU training the tests run."""
    global _trainer_libs_ready
    if _trainer_libs_ready:
        return
    _trainer_libs_ready = True
    if _real_torchvision_loads():
        return
    for name in list(sys.modules):
        if name == "torchvision" or name.startswith("torchvision."):
            del sys.modules[name]
    sys.modules["torchvision"] = None  # type: ignore[assignment]  # find_spec -> None
    try:
        import transformers.utils.import_utils as iu

        iu._torchvision_available = False  # also when imported while a stand-in was there
    except ModuleNotFoundError:
        pass
    finally:
        del sys.modules["torchvision"]
    _permissive_torchvision()


def _real_torchvision_loads() -> bool:
    tv = sys.modules.get("torchvision", False)
    if tv is not False:  # imported already: the real one, a stand-in, or marked absent
        return tv is not None and not getattr(tv, STAND_IN, False)
    try:
        import torchvision  # noqa: F401

        return True
    except Exception:
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]
        return False
