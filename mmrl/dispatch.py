"""How a worker method's batch is laid out over the ranks of its group, declared once on the method.

A worker role marks each method that takes a batch with :func:`rows_per_rank` or
:func:`rows_per_data_parallel_share`; ``RayWorkerGroup.dispatch`` reads the mark, so no call site
repeats a ``dp_size``. Methods without a mark take no batch and run on every rank with the same
arguments (``RayWorkerGroup.call``).

- ``rows_per_rank``: the rows are split over all ranks (each rank's rollout engine generates its own
  prompts).
- ``rows_per_data_parallel_share``: the rows are split over the data-parallel shares; the ranks of one
  sequence-parallel group get the same share (a ``(dp, sp)`` mesh of consecutive ranks). The worker
  group is told its roles' sequence-parallel sizes when it is made; a worker holding several roles
  (the critic next to the actor) names the role whose size splits a method's rows:
  ``@rows_per_data_parallel_share(role="critic")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["ROWS_PER_DATA_PARALLEL_SHARE", "ROWS_PER_RANK", "layout_of", "rows_per_data_parallel_share",
           "rows_per_rank", "sequence_parallel_role_of"]  # fmt: skip

ROWS_PER_RANK = "rows_per_rank"
ROWS_PER_DATA_PARALLEL_SHARE = "rows_per_data_parallel_share"
_ATTRIBUTE = "mmrl_dispatch_layout"
_ROLE_ATTRIBUTE = "mmrl_dispatch_role"

Method = TypeVar("Method", bound=Callable)


def rows_per_rank(method: Method) -> Method:
    setattr(method, _ATTRIBUTE, ROWS_PER_RANK)
    return method


def rows_per_data_parallel_share(method: Method | None = None, /, *, role: str | None = None):
    """Mark ``method`` (bare, or called with ``role``: the role whose sequence-parallel size splits
    the rows; None = the worker group's own size)."""

    def mark(marked: Method) -> Method:
        setattr(marked, _ATTRIBUTE, ROWS_PER_DATA_PARALLEL_SHARE)
        setattr(marked, _ROLE_ATTRIBUTE, role)
        return marked

    return mark if method is None else mark(method)


def layout_of(method: Callable) -> str | None:
    """The declared layout of ``method``; None when the method takes no batch."""
    return getattr(method, _ATTRIBUTE, None)


def sequence_parallel_role_of(method: Callable) -> str | None:
    """The role named by ``method``'s mark; None for the worker group's own size."""
    return getattr(method, _ROLE_ATTRIBUTE, None)
