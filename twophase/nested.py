"""Nested containers of tensors ("trees"): what a model's encoder output and decoder state may be.

A tree is a tensor, a tuple or list (named tuples included), a dict, or a dataclass instance, nested in any way;
any other leaf (an int, a string, None) is carried along untouched. The library never looks inside a model's
trees except through these functions: it selects rows of every tensor (beam reordering), cuts floating tensors
out of the graph (phase two's encoder boundary), and lists them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import Tensor


def map_tensors(fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """The same structure with fn applied to every tensor."""
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, map_tensors(fn, v)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple is built from positional fields
        return type(tree)(*(map_tensors(fn, v) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tensors(fn, v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {f.name: map_tensors(fn, getattr(tree, f.name)) for f in dataclasses.fields(tree) if f.init}
        return dataclasses.replace(tree, **changes)
    return tree


def tensors(tree: Any) -> list[Tensor]:
    """Every tensor of the tree, in a fixed order (the order map_tensors visits them)."""
    found: list[Tensor] = []
    map_tensors(found.append, tree)
    return found


def select_rows(tree: Any, rows: Tensor) -> Any:
    """Rows `rows` (n,) of every tensor's leading dimension: a beam's reorder, or the open rows of a search."""
    return map_tensors(lambda x: x.index_select(0, rows), tree)


def leading_size(tree: Any) -> int:
    """The leading dimension shared by the tree's tensors (for an encoder output: the number of sources B)."""
    found = tensors(tree)
    if not found or found[0].dim() == 0:
        raise ValueError("expected a tensor, or a container of tensors with a leading batch dimension")
    return found[0].shape[0]


def device_of(tree: Any) -> torch.device:
    found = tensors(tree)
    return found[0].device if found else torch.device("cpu")


def cut_floating(tree: Any) -> Any:
    """Floating tensors detached as new leaves that require grad when the originals did; the rest as they are.

    Phase two decodes every chunk from these leaves, so each chunk's backward stops at them (accumulating their
    .grad) and the encoder's graph is walked once, after the last chunk."""
    def cut(x: Tensor) -> Tensor:
        return x.detach().requires_grad_(x.requires_grad) if x.is_floating_point() else x
    return map_tensors(cut, tree)


def floating(tree: Any) -> list[Tensor]:
    """The floating tensors of the tree, in `tensors` order: cut_floating's leaves line up with the originals'."""
    return [x for x in tensors(tree) if x.is_floating_point()]
