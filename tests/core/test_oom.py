"""Out of memory: cuBLAS's and cuDNN's allocation failures count as it, phase two halves a failed chunk and the
trainer skips a failed batch only after the failed attempt's tensors are released (weakref dead when the cache
is emptied), and the compile wrapper neither keeps a failed call's tensors nor blames the compiler for memory.
The errors are injected on the CPU (monkeypatched), as a GPU would raise them."""
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from twophase import Compiled, beam_search, objectives, oom, rescore_backward
from twophase.phase2 import rescoring
from twophase.train import run as run_module, runparts, trainer as trainer_module
from twophase.train.steps.parts import Parts

from conftest import take_grads, tiny_model, toy_batch

CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


@pytest.mark.parametrize("err,want", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError(CUBLAS), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("CUDA out of memory"), False),
])
def test_what_counts_as_out_of_memory(err, want):
    assert oom.is_out_of_memory(err) is want


class _Watch:
    """A weakref to the tensor the failed attempt held, and whether it was dead whenever the cache was emptied."""

    def __init__(self, monkeypatch):
        self.ref, self.dead_at_release = None, []
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def hold(self, tensor):
        self.ref = weakref.ref(tensor)

    def empty_cache(self):
        self.dead_at_release.append(self.ref is not None and self.ref() is None)


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError("CUDA out of memory"), RuntimeError(CUBLAS)])
def test_phase_two_halves_a_failed_chunk_after_releasing_it(monkeypatch, one_thread, error):
    model, source = tiny_model(), toy_batch()
    s = beam_search(model, source, 4, 5)
    c = objectives.reinforce(torch.linspace(0, 1, len(s), dtype=torch.float64), s.owner, 3, "mean")
    rescore_backward(model, source, s, c, chunk_size=len(s), oom_retry=True)
    want = take_grads(model)
    watch, sizes, real = _Watch(monkeypatch), [], rescoring._chunk

    def failing_chunk(model_, boundary, samples, coefficients, plan, rows, *rest):
        sizes.append(rows.stop - rows.start)
        if rows.stop - rows.start > 3:
            graph = torch.ones(1000, requires_grad=True) * 2  # what the failed chunk's frame holds
            watch.hold(graph)
            raise type(error)(*error.args)  # a fresh one: the parameter's instance would keep the traceback
        return real(model_, boundary, samples, coefficients, plan, rows, *rest)

    monkeypatch.setattr(rescoring, "_chunk", failing_chunk)
    rescore_backward(model, source, s, c, chunk_size=len(s), oom_retry=True, prefix_sharing=False)
    assert sizes[:3] == [len(s), len(s) // 2, len(s) // 4] and max(sizes[3:]) <= 3, sizes
    assert watch.dead_at_release and all(watch.dead_at_release), watch.dead_at_release
    for got, w in zip(take_grads(model), want):
        torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-12)


def test_phase_two_raises_other_errors_and_oom_without_retry(monkeypatch, one_thread):
    model, source = tiny_model(), toy_batch()
    s = beam_search(model, source, 4, 5)
    c = torch.ones(len(s), dtype=torch.float64)

    def broken(*args):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(rescoring, "_chunk", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        rescore_backward(model, source, s, c, chunk_size=4, oom_retry=True)
    monkeypatch.setattr(rescoring, "_chunk", lambda *a: (_ for _ in ()).throw(RuntimeError(CUBLAS)))
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        rescore_backward(model, source, s, c, chunk_size=4, oom_retry=False)


def test_the_trainer_skips_a_batch_after_releasing_it(monkeypatch):
    """A run's step (runparts.take_step) on a cuBLAS allocation failure: the batch is skipped (counted), the cache emptied only
    once the failed step's tensors are gone."""
    watch = _Watch(monkeypatch)

    class Steps:  # what take_step reads of its trainer, the step itself failing
        cfg = type("Cfg", (), {"profile_memory": False, "rescore_chunk": 8, "rl_lr": 0.1})()
        start_step, step_figures = trainer_module.Trainer.start_step, trainer_module.Trainer.step_figures

        def __init__(self):
            self.optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
            self.device = torch.device("cuda")
            self.parts = SimpleNamespace(optimizer=self.optimizer, profiler=None, last_chunk=8)
            self.parts.start = lambda *args: Parts.start(self.parts, *args)

        def rl_step(self):
            held = torch.ones(1000)
            watch.hold(held)
            raise RuntimeError(CUBLAS)

    state = run_module.RunState(mle_end=0)  # a run's state, none of its files (no saver: nothing is saved)
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda *a, **k: "summary")
    row = runparts.take_step(Steps(), state, None, "rl", lr=0.1)
    assert row["out_of_memory"] == 1 and state.stats["rl"]["out_of_memory"] == 1
    assert watch.dead_at_release == [True]


def test_a_failed_compiled_call_is_released_before_the_eager_one(monkeypatch):
    model, source = tiny_model(), toy_batch()
    wrapper = Compiled(model, backend="eager")
    refs, alive_at_eager = [], []

    def failing(*args):
        held = torch.ones(1000)
        refs.append(weakref.ref(held))
        raise RuntimeError("an inductor error")

    eager_step = model.step

    def watched_step(*args):
        gc.collect()  # not needed for plain frames; a cycle would show here
        alive_at_eager.append(refs[-1]() is not None)
        return eager_step(*args)

    monkeypatch.setattr(wrapper, "_compiled", lambda name: failing)
    monkeypatch.setattr(model, "step", watched_step)
    with torch.inference_mode():
        enc = model.encode(source)
        owner = torch.arange(3)
        wrapper.step(enc, owner, torch.full((3,), model.bos_id), model.init_state(enc, owner))
    assert alive_at_eager == [False] and wrapper.failure == "RuntimeError: an inductor error"


def test_out_of_memory_in_a_compiled_call_is_the_callers_not_the_compilers(monkeypatch):
    model, source = tiny_model(), toy_batch()
    wrapper = Compiled(model, backend="eager")
    monkeypatch.setattr(wrapper, "_compiled", lambda name: lambda *a: (_ for _ in ()).throw(RuntimeError(CUBLAS)))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        enc = model.encode(source)
        owner = torch.arange(3)
        wrapper.step(enc, owner, torch.full((3,), model.bos_id), model.init_state(enc, owner))
    assert wrapper.failure is None
