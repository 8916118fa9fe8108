"""What CUDA refuses under `torch.use_deterministic_algorithms(True)`, refused on every device: a dispatch mode
that, while deterministic algorithms are on, raises for each op of that function's documentation that "will throw a
RuntimeError" on a CUDA tensor (float `cumsum`, `nll_loss`, `histc`, `bincount` with weights, `median` with
indices, `put_`, `scatter_reduce` with prod, the backward of adaptive pooling, reflection padding, interpolation
...). The CPU runs all of them deterministically and refuses nothing, so without this a `--deterministic` path
that dies at its first op on a GPU passes every CPU test.

    with guards.cuda_deterministic_ops():     # any block: refuses only while deterministic algorithms are on
        twophase.fit(config, ...)

A subprocess (the GPU check's CPU dry run) runs under it with `python tests/guards.py -m MODULE ARGS...`: the
module as `python -m` runs it, under this mode and tests/conftest.py's RNN guards.
"""
from __future__ import annotations

import contextlib
import runpy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Always refused on CUDA (forward ops), or refused when differentiated (their backward ops run then)
_ALWAYS = {
    aten.histc, aten.put, aten.put_, aten.max_unpool2d, aten.max_unpool3d,  # MaxUnpool1d runs max_unpool2d
    aten.nll_loss_forward, aten.nll_loss2d_forward,
    aten.avg_pool3d_backward, aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward,
    aten.adaptive_max_pool2d_backward, aten.fractional_max_pool2d_backward, aten.fractional_max_pool3d_backward,
    aten.upsample_linear1d_backward, aten.upsample_bilinear2d_backward, aten.upsample_bicubic2d_backward,
    aten.upsample_trilinear3d_backward,
    aten.reflection_pad1d_backward, aten.reflection_pad2d_backward, aten.reflection_pad3d_backward,
    aten._ctc_loss_backward, aten.grid_sampler_2d_backward, aten.grid_sampler_3d_backward,
}
_EMBEDDING_BAG_MAX = 2  # embedding_bag's `mode` argument for mode="max"


def _argument(func, args, kwargs, name: str, default=None):
    """An op's argument by its schema name, positional or keyword."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


def refused(func, args, kwargs) -> bool:
    """Whether CUDA's deterministic algorithms refuse this call (torch.use_deterministic_algorithms' list)."""
    op = func.overloadpacket
    if op in _ALWAYS:
        return True
    if op in (aten.cumsum, aten.cumsum_):
        dtype = _argument(func, args, kwargs, "dtype") or args[0].dtype
        return dtype.is_floating_point or dtype.is_complex
    if op is aten.bincount:
        return _argument(func, args, kwargs, "weights") is not None
    if op is aten.median:
        return func._overloadname.startswith("dim")  # median(dim) returns indices; median() does not
    if op in (aten.scatter_reduce, aten.scatter_reduce_):
        return _argument(func, args, kwargs, "reduce") == "prod"
    if op in (aten._embedding_bag_backward, aten._embedding_bag_dense_backward):
        return _argument(func, args, kwargs, "mode") == _EMBEDDING_BAG_MAX
    return False


class CudaDeterministicOps(TorchDispatchMode):
    """Raises, while torch.are_deterministic_algorithms_enabled(), where CUDA would: "<op> does not have a
    deterministic implementation"."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.are_deterministic_algorithms_enabled() and refused(func, args, kwargs):
            raise RuntimeError(f"{func} does not have a deterministic implementation on CUDA, but "
                               f"torch.use_deterministic_algorithms(True) is on (tests/guards.py)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_deterministic_ops():
    with CudaDeterministicOps():
        yield


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the block, restored after (as `--deterministic` sets it)."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: python tests/guards.py -m MODULE [ARGS...]")
    import conftest  # noqa: F401  (tests/conftest.py's global RNN hooks, registered on import)
    sys.argv = [argv[1], *argv[2:]]
    with cuda_deterministic_ops():
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
