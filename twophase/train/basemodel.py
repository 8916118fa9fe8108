"""What a checkpoint records of the frozen base its parameters need, and the check that a model built now has it.

A --lora-r run's checkpoint holds the adapters alone: the base is whatever the --hf-model folder holds when the
run is resumed, started from (--init-from) or decoded. So the checkpoint records the base (`record`): the folder
it was read from and a fingerprint, a SHA-256 of

    the configuration   the folder's config.json as written (its entries that describe the model: not the
                        folder's name, the transformers version or the dtype it was saved in; the file, not
                        transformers' reading of it, so that another transformers version sees the same)
    the frozen weights  every frozen parameter's name, shape and a strided sample of its values (at most
                        SAMPLE per tensor, exact values, read from the device in one copy): any retraining or
                        merge of adapters changes every element of the matrices it touches

which is computed in well under a second for any model size and equals on any device (no reduction). `check`
refuses a model whose base differs, in one line naming both folders. A model without frozen parameters records
nothing (its checkpoint holds every parameter); a checkpoint written before the record existed is not checked.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

SAMPLE = 64  # values read per frozen tensor
VOLATILE = ("transformers_version", "torch_dtype", "dtype", "architectures", "name_or_path")


def folder_config(folder: str | None) -> dict | None:
    """The entries of <folder>/config.json (None: no folder, no readable file)."""
    if not folder:
        return None
    try:
        with open(Path(folder) / "config.json", encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def fingerprint(model: torch.nn.Module, config: dict | None = None) -> dict | None:
    """{"config": hex, "weights": hex} of the frozen part of `model` (None: every parameter trains); `config`:
    the folder's configuration (`folder_config`), or None."""
    frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
    if not frozen:
        return None
    weights = hashlib.sha256()
    samples = []
    with torch.no_grad():
        for name, p in frozen:
            weights.update(f"{name}:{tuple(p.shape)};".encode())
            flat = p.detach().reshape(-1)  # (n,)
            n = flat.numel()
            k = min(n, SAMPLE)
            # evenly spaced, in integers (a float32 linspace rounds past the end beyond 2^24 elements)
            index = torch.arange(k, device=flat.device) * max(n - 1, 0) // max(k - 1, 1)  # (k,)
            samples.append(flat.index_select(0, index).to(torch.float64))
        values = torch.cat(samples).cpu()  # one read from the device, at start-up
    weights.update(values.numpy().tobytes())
    return {"config": _config_hash(config), "weights": weights.hexdigest()}


def _config_hash(config: dict | None) -> str | None:
    if config is None:
        return None
    entries = {k: v for k, v in config.items() if not k.startswith("_") and k not in VOLATILE}
    return hashlib.sha256(json.dumps(entries, sort_keys=True, default=str).encode()).hexdigest()


def record(model: torch.nn.Module, path: str | None) -> dict | None:
    """What a checkpoint keeps of the base read from the folder `path`: {"path", "config", "weights"}, or None
    (nothing frozen)."""
    found = fingerprint(model, folder_config(path))
    return None if found is None else {"path": path, **found}


def check(saved: dict | None, now: dict | None, where: str, path: str | None) -> None:
    """ValueError (one line) where the checkpoint at `where` recorded a base (`saved`) other than the model's now
    (`now`, read from `path`)."""
    if not saved or not now:
        return
    differs = [part for part in ("weights", "config") if saved.get(part) and now.get(part) != saved.get(part)]
    if not differs:
        return
    what = " and ".join(differs) + (" differ" if differs != ["config"] else " differs")
    recorded = "" if path == saved.get("path") else f"; trained on {saved.get('path')}"
    raise ValueError(f"{where}: its parameters were trained on another base model than --hf-model {path} holds "
                     f"now (its {what}{recorded}): give the folder they were trained on (a merged export is no "
                     "base: its weights hold the adapters already)")

