"""`twophase.compiled(model)`: phase one's decode step through `torch.compile`, everything else the model's own.

`Compiled(model)` is itself a `SequenceModel`. Its `step` (and `advance` / `log_probs`, where the model splits
its step for beam search's blocked path) runs a `torch.compile`d copy of the model's own method whenever no graph
is being recorded: phase one's search (inference mode), validation, decoding. Wherever a graph is recorded (phase
two's step-by-step fallback, the one-phase baseline's search, MLE) the model's eager method runs. `encode`,
`init_state` and every teacher-forced method (`score`, `token_scores`, `position_log_probs`,
`weighted_score_backward`, `weighted_tree_backward`) are the model's, untouched, so phase two's gradient and its
exactness do not depend on the compiler. Search scores come from compiled arithmetic and phase two's
log-probabilities from eager arithmetic: they agree to rounding (allclose), as they do across chunk shapes.

Dynamic shapes: the step is compiled with `dynamic=True`, so a new number of rows (beam search's compact steps,
batches of another size) or source length mostly reuses the compiled code: a size of 1 is specialised, and a
size that happens to equal a fixed one (rows = hidden size) compiles once more (a short default G2P run, its
validations and test split: 11 graphs in all; docs/compile.md). `compiles` counts the graphs the backend
compiled and `compile_seconds` the backend's time compiling them (what a run pays, once, at its start).

Guarded: where compiling fails (no C++ compiler, an inductor error, a construct dynamo does not support), the call
runs eagerly; when the eager call succeeds the compiler was at fault, so the wrapper logs one warning line naming
the error (logger "twophase") and runs eagerly from then on. An error the eager model raises too is the model's,
raised as it would be without the wrapper. An out-of-memory error (`twophase.oom`) is the device's, not the
compiler's: it is raised to the caller, whose own handling (phase two's halving, the trainer's skipped batch)
applies, and compiling goes on.

The wrapper registers the model as its submodule `inner` (train/eval and devices follow); its `state_dict`,
`named_parameters` and `named_buffers` are the model's, names included (checkpoints and LoRA's trainable-name
filter do not see the wrapper), and attributes it does not define are read from the model (`.model` of a Hugging
Face wrapper, `.out` of the LSTM). `enabled = False` runs eagerly (benchmarks alternate in one process).
Letters: N rows, V vocabulary.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import oom

log = logging.getLogger("twophase")

STEP_METHODS = ("step", "advance", "log_probs")  # what search calls once per decoding step: never the model's


class Compiled(nn.Module):
    """`model` with its per-step methods compiled for graph-free calls; see the module docstring.

    backend: a `torch.compile` backend (a name such as "inductor", "aot_eager", "eager", or a callable);
    dynamic: passed to `torch.compile` (True: symbolic shapes, see the module docstring)."""

    def __init__(self, model, backend: str | Callable = "inductor", dynamic: bool | None = True):
        super().__init__()
        self.inner, self.backend, self.dynamic = model, backend, dynamic
        self.enabled = True
        self.pad_id, self.bos_id, self.eos_id = model.pad_id, model.bos_id, model.eos_id
        self.compiles, self.compile_seconds = 0, 0.0
        self.failure: str | None = None  # why compiling was given up, once it was
        self._fns: dict[str, Callable] = {}  # method name -> its compiled version, made on first use
        self._offer_split()

    def _offer_split(self) -> None:
        """`advance` / `log_probs`, offered only where the model has them (search tests for them)."""
        if all(callable(getattr(self.inner, name, None)) for name in ("advance", "log_probs")):
            self.advance = lambda enc, owner, prev, state: self._call("advance", enc, owner, prev, state)
            self.log_probs = lambda state: self._call("log_probs", state)

    # ---- checkpoints, parameter names, copies and attributes are the model's
    def state_dict(self, *args, **kwargs):
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.inner.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.inner.named_buffers(*args, **kwargs)

    def __getstate__(self):
        # A copy (deepcopy: a reference model, a test model) compiles its own methods, not the original's.
        state = dict(self.__dict__)
        state["_fns"] = {}
        state.pop("advance", None)
        state.pop("log_probs", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._offer_split()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (self.inner itself)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("inner")
            if inner is None or name.startswith("_") or name in STEP_METHODS:
                raise
            return getattr(inner, name)  # vocab_size, score, ..., a Hugging Face wrapper's .model and .adapter

    # ---- the protocol
    def encode(self, source: Any) -> Any:
        return self.inner.encode(source)

    def init_state(self, enc: Any, owner: Tensor) -> Any:
        return self.inner.init_state(enc, owner)

    def step(self, enc: Any, owner: Tensor, prev: Tensor, state: Any) -> tuple[Any, Tensor]:
        return self._call("step", enc, owner, prev, state)

    # ---- compiled where no graph is recorded, guarded
    def _call(self, name: str, *args):
        eager = getattr(self.inner, name)
        if not self.enabled or self.failure is not None or torch.is_grad_enabled():
            return eager(*args)
        try:
            return self._compiled(name)(*args)
        except Exception as err:  # noqa: BLE001  (the eager call below tells the compiler's errors from the model's)
            if oom.is_out_of_memory(err):
                raise  # the device's shortage, not the compiler's fault: the caller's out-of-memory handling
            failed = reason(err)  # a line, not the exception: its traceback holds the failed call's tensors
        out = eager(*args)  # the model's own error, where it has one, is raised here as without the wrapper
        self.failure = failed
        log.warning("twophase.compiled: torch.compile failed (%s); the decode step runs eagerly", self.failure)
        return out

    def _compiled(self, name: str) -> Callable:
        if name not in self._fns:
            self._fns[name] = torch.compile(getattr(self.inner, name), backend=self._count, dynamic=self.dynamic)
        return self._fns[name]

    def _count(self, gm: torch.fx.GraphModule, example_inputs: list):
        """The configured backend, counted and timed: called once per graph dynamo hands over."""
        backend = self.backend
        if isinstance(backend, str):
            backend = torch._dynamo.lookup_backend(backend)
        start = time.perf_counter()
        try:
            return backend(gm, example_inputs)
        finally:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start


def reason(err: BaseException) -> str:
    """One line naming a compile failure: the backend's own error where dynamo wraps it."""
    inner = getattr(err, "inner_exception", None) or err
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    text = f"{type(inner).__name__}: {lines[0]}" if lines else type(inner).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def compiled(model, backend: str | Callable = "inductor", dynamic: bool | None = True) -> Compiled:
    """`model` (a `SequenceModel`) with phase one's decode step compiled by `torch.compile`: see `Compiled`."""
    return Compiled(model, backend=backend, dynamic=dynamic)


__all__ = ["Compiled", "compiled", "reason"]


def compile_report(model: nn.Module) -> str | None:
    """What compiling cost the run, for its closing lines: the graphs `model`'s `Compiled` step compiled and the
    seconds it spent on them (or why it gave up and ran eagerly); None where nothing is compiled."""
    found = next((m for m in model.modules() if isinstance(m, Compiled)), None)
    if found is None or not found.enabled:
        return None
    text = (f"compiled: {found.compiles} graph{'s' * (found.compiles != 1)} of the decode step in "
            f"{found.compile_seconds:.2f} s (backend {found.backend if isinstance(found.backend, str) else 'custom'})")
    return text + (f"; then eager: {found.failure}" if found.failure else "")
