"""What the GPU check's sections share: the device, deterministic algorithms, memory windows, relative errors,
the seed's LSTM and tiny Hugging Face models built here (no download, no test folder).

Letters: B sources, K beam size / samples per source, N = B*K rows, S source length, T max length, H hidden,
V vocabulary.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

# cuBLAS reuses its workspace in a fixed order only with this set before CUDA starts (PyTorch's reproducibility
# notes); the entry point sets it before any CUDA call, a section's worker inherits it.
CUBLAS_DETERMINISTIC = ":4096:8"


def prepare_environment() -> None:
    """Before CUDA initialises: the cuBLAS workspace setting deterministic algorithms need."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda where available, else cpu; anything else as torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@contextlib.contextmanager
def syncs_counted(device: torch.device):
    """(the dispatch count of host syncs, CUDA's own count or None off CUDA) of the block (`benchmarks.hostsyncs`);
    CUDA's is filled when the block ends."""
    from ..hostsyncs import count_cuda_syncs, count_host_syncs
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(count_host_syncs())
        cuda = stack.enter_context(count_cuda_syncs()) if device.type == "cuda" else None
        yield host, cuda


NO_CUDA_SYNCS = "needs a CUDA device (torch.cuda.set_sync_debug_mode counts CUDA's synchronising calls)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def deterministic(on: bool = True):
    """torch.use_deterministic_algorithms(on) for the block (an op without a deterministic kernel raises), cuDNN's
    benchmark off and its deterministic flag on; everything restored after."""
    was = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
           torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = on, False if on else was[2]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = was[1], was[2]


@contextlib.contextmanager
def full_float32():
    """TF32 off for the block, for matmuls and for cuDNN (whose convolutions, the Karel encoders', use TF32 by
    PyTorch's default): float32 figures that are float32's. Restored after."""
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was


class MemoryWindow:
    """Peak memory of a block: on CUDA `max_memory_allocated` and `max_memory_reserved` (what an OOM is about)
    after emptying the cache and resetting the peaks, both in MiB, and the allocation above the start; on the CPU
    the process's peak RSS above its size at the start (labelled as such)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        from twophase.system.memory import reset_rss_peak, rss_bytes
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            reset_rss_peak()
            self.start = rss_bytes()
        return self

    def __exit__(self, *exc):
        from twophase.system.memory import rss_peak_bytes
        mib = 2 ** 20
        if self.device.type == "cuda":
            synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.figures = {"max_memory_allocated_mib": peak / mib,
                            "max_memory_reserved_mib": torch.cuda.max_memory_reserved(self.device) / mib,
                            "allocated_above_start_mib": (peak - self.start) / mib}
        else:
            self.figures = {"rss_peak_above_start_mib": max(0, rss_peak_bytes() - self.start) / mib}
        return False


def timed(fn, device: torch.device) -> tuple[object, float]:
    """(fn(), wall seconds), the device synchronised before and after so the seconds are the work's."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def relative_error(got: list, want: list) -> float:
    """|got - want| / |want| over all tensors (L2, in float64); None entries (no gradient) on both sides skip."""
    pairs = [(g, w) for g, w in zip(got, want) if not (g is None and w is None)]
    if any(g is None or w is None for g, w in pairs):
        return float("inf")  # a gradient on one side only
    diff = sum(float((g.double() - w.double()).norm() ** 2) for g, w in pairs) ** 0.5
    norm = sum(float(w.double().norm() ** 2) for _, w in pairs) ** 0.5
    return diff / max(norm, 1e-300)


def one_line(err: BaseException) -> str:
    """An exception as the report records it: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


CUDNN_EVAL_BACKWARD = "cudnn RNN backward can only be called in training mode"


def cudnn_retry(fn, *args):
    """(fn(*args), None); where cuDNN refuses an RNN's backward in evaluation mode (phase two's mode), (fn(*args)
    run again with cuDNN off, that refusal as one line), so the figures exist either way and the report says
    which. Any other error propagates."""
    try:
        return fn(*args), None
    except RuntimeError as err:
        if CUDNN_EVAL_BACKWARD not in str(err):
            raise
        refusal = one_line(err)
    with torch.backends.cudnn.flags(enabled=False):
        return fn(*args), refusal


def grads(model) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def bitwise_equal(a: list, b: list) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def seed_lstm(sizes: dict, device: torch.device, seed: int = 0):
    """The bench's LSTM (`benchmarks.cell.build`: additive attention, EOS banned so every candidate runs to T,
    evaluation mode) and its (src (B, S), lengths (B,)) source."""
    from ..cell import build
    cell = dict(sizes, device=str(device), dtype="float32", method="two-phase", seed=seed)
    model, optimizer, src, lengths = build(cell)
    return model, optimizer, (src, lengths)


# ---------------------------------------------------------------- tiny Hugging Face models, random weights
PAD, EOS, BOS = 0, 1, 2  # the tiny models' special ids; words from 3 on


def tiny_hf(kind: str, device: torch.device, vocab: int = 32, width: int = 32, layers: int = 2, seed: int = 0):
    """A twophase wrapper around a random-weight 't5' (HFSeq2Seq) or 'gpt2' (HFCausalLM) in float32 and
    evaluation mode (no dropout), its weights scaled up so distributions are peaked (tiny random models are
    nearly uniform, where every candidate ties)."""
    import transformers as T
    from twophase.models.hf import HFCausalLM, HFSeq2Seq

    torch.manual_seed(seed)
    if kind == "t5":
        config = T.T5Config(vocab_size=vocab, d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=layers,
                            num_heads=2, dropout_rate=0.0, decoder_start_token_id=PAD, pad_token_id=PAD,
                            eos_token_id=EOS)
        model, wrap = T.T5ForConditionalGeneration(config), HFSeq2Seq
    elif kind == "gpt2":
        config = T.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=2, n_positions=128,
                              bos_token_id=EOS, eos_token_id=EOS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, wrap = T.GPT2LMHeadModel(config), HFCausalLM
    else:
        raise ValueError(f"unknown tiny model {kind!r}: expected t5 or gpt2")
    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return wrap(model.to(device))


def tiny_hf_source(kind: str, device: torch.device, batch: int, length: int, vocab: int, seed: int = 0) -> dict:
    """B random prompts of at most P tokens, some shorter: right-padded for T5, left-padded for GPT-2 (whose
    padding is its eos)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, length // 2), length + 1, (batch,), generator=g)  # (B,)
    lengths[0] = length
    at = torch.arange(length)[None, :]  # (1, P)
    mask = (at >= length - lengths[:, None]) if kind == "gpt2" else (at < lengths[:, None])  # (B, P)
    ids = torch.randint(BOS + 1, vocab, (batch, length), generator=g).masked_fill(~mask, EOS if kind == "gpt2" else PAD)
    return {"input_ids": ids.to(device), "attention_mask": mask.long().to(device)}
