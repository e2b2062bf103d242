"""Make the CUDA-only torchvision 0.28 wheel importable against CPU torch.

Installed into the CPU virtual environment by ``scripts/setup_env.sh`` as a module plus a
``.pth`` line, so it reaches every interpreter of the environment (Ray workers and subprocesses
included). It is never part of the ``mmrl`` package.

Why: PyPI has no CPU torchvision. ``torchvision==0.28.0`` (the one release that pins torch 2.13)
ships compiled ops built for CUDA; on CPU torch its library fails to load, and its Python code then
registers fake kernels for ``torchvision::nms``/``qnms``, ops that were never defined, so
``import torchvision`` dies with "operator torchvision::nms does not exist". Declaring the two
schemas (no kernels) first makes the import succeed: transforms work, compiled ops do not.
"""

import importlib.abc
import sys

_LIBRARY = None  # keeps the torch.library registration alive for the life of the process


def _declare_schemas() -> None:
    global _LIBRARY
    import torch

    if torch.version.cuda is not None or _LIBRARY is not None:
        return  # a CUDA torch loads torchvision's real library; nothing to fix
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY = library


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs the fix once, just before the first ``import torchvision``; finds nothing itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _declare_schemas()
        return None


if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTorchvision())
