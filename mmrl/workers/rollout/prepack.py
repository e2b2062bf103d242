"""Prepacked linear layers for decoding on a CPU (the transformers rollout's copy of the policy).

A decode step multiplies a few dozen rows (one new token per response) by every weight matrix. At that
shape the default fp32 CPU path (MKL ``sgemm``) re-lays out the weight on every call; oneDNN can lay
it out once (``mkldnn._reorder_linear_weight``) and multiply the packed weight afterwards
(``mkldnn._linear_pointwise``), which is what PyTorch's compiler emits for frozen CPU linears. On the
bench's 2-core CPU this takes a quarter off the 13M model's rollout (its 256 x 2048 MLP matrices); for
small matrices oneDNN's fixed cost per call is larger than the gain, so only matrices of at least
``MIN_PACKED_ELEMENTS`` weights are packed.

The layers keep their parameters (same objects, same state-dict names), so weight sync writes into
them as before; each layer repacks itself when its weight was written to (its version counter) or
replaced (its storage). With autograd on and a trainable weight they fall back to ``F.linear`` (the
packed op has no backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_PACKED_ELEMENTS = 1 << 18  # 256 x 1024: below this MKL's call is cheaper on the bench CPU


def prepacking_available() -> bool:
    """Whether this PyTorch build has the oneDNN ops that prepacking needs."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` (sharing another's parameters) that multiplies by a oneDNN-packed copy of
    its weight, packed for ``rows`` input rows (the blocking oneDNN picks; any row count works)."""

    def __init__(self, linear: nn.Linear, rows: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rows = rows
        self._packed: torch.Tensor | None = None
        self._packed_from: tuple[int, int] | None = None  # the weight's (storage address, version)

    def _packed_weight(self) -> torch.Tensor:
        source = (self.weight.data_ptr(), self.weight._version)  # in-place writes bump the version
        if self._packed is None or source != self._packed_from:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.rows)
            self._packed_from = source
        return self._packed

    def drop_packed(self) -> None:
        """Free the packed copy (the weight is being freed too); the next forward packs again."""
        self._packed, self._packed_from = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")


def prepack_linears(model: nn.Module, rows: int, min_elements: int = MIN_PACKED_ELEMENTS) -> int:
    """Replace, in place, every plain fp32 ``nn.Linear`` of a CPU ``model`` with at least
    ``min_elements`` weights by a :class:`PrepackedLinear` over the same parameters; returns how many.
    Does nothing (returns 0) off the CPU or where this build of PyTorch lacks the oneDNN ops."""
    if not prepacking_available():
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.device.type == "cpu"
                and child.weight.dtype == torch.float32
                and child.weight.numel() >= min_elements
            ):
                setattr(parent, name, PrepackedLinear(child, rows))
                replaced += 1
    return replaced
