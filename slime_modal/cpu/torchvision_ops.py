"""``import torchvision`` beside a CPU torch, where the PyPI torchvision is a CUDA build.

Its compiled operators fail to load (they link CUDA libraries), so ``torchvision::nms`` and
``torchvision::qnms`` are never defined, and torchvision's meta registrations, which run at
``import torchvision``, fail with ``operator torchvision::nms does not exist``. SGLang imports
torchvision at start. Declaring the two schemas first lets the import finish; the operators
stay without kernels, which SGLang's text path never calls."""

from __future__ import annotations

import contextlib

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_lib = None


def install() -> None:
    global _lib
    if _lib is not None:
        return
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - defined: torchvision's own build loaded
        return
    except (AttributeError, RuntimeError):
        pass
    _lib = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS.values():
        # RuntimeError: defined already (a build whose library loaded after all)
        with contextlib.suppress(RuntimeError):
            _lib.define(schema)
