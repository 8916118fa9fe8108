"""A Hugging Face `save_pretrained` folder on disk, as every reader of one checks it: the --hf-model task's model,
--teacher's model and --reward's reward model. What the folder must hold is checked here, without transformers,
so each reader can name its own flag in a one-line error before anything is loaded; `offline_float32` and
`quiet_progress_bars` load it the same way for all: from disk only, in float32, without progress bars in a training log.
"""
from __future__ import annotations

import contextlib
import os
import pickle

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")  # save_pretrained writes the first, always


def problem(folder: str, tokenizer: bool = True) -> str | None:
    """What keeps `folder` from being a model's save_pretrained folder (with its tokenizer, where `tokenizer`), in
    a few words for a one-line error after the flag that named it; None where nothing does."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return "not a directory (a model's save_pretrained folder is expected)"
    if not os.path.isdir(folder):
        return "no such directory"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return "no config.json (a model's save_pretrained folder is expected)"
    if tokenizer and not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        return (f"no tokenizer ({' or '.join(TOKENIZER_FILES)}); save the tokenizer into the same folder with "
                "tokenizer.save_pretrained")
    return None


def load_failure(exc: BaseException) -> str:
    """Why `from_pretrained` failed, in a few words for a one-line error: a weights file carrying pickled Python
    objects (torch.load's weights-only refusal) in the project's words, never torch's advice to load it with
    weights_only=False, which would run that code; anything else as `Type: first line`."""
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) or "weights only" in text.lower() or "weights_only" in text:
        return ("refused: its weights file carries pickled Python objects (only tensors and plain data are loaded, "
                "never executed); save the model with safetensors, save_pretrained's default")
    lines = text.strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def offline_float32() -> dict:
    """`from_pretrained`'s arguments for a local folder's model in float32 whatever dtype it was saved in."""
    import torch
    import transformers

    dtype = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # renamed in 5.0
    return {"local_files_only": True, dtype: torch.float32}


@contextlib.contextmanager
def quiet_progress_bars():
    """No "Loading weights" progress bars on stderr: a training log shows one line per event."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()
