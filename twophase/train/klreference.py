"""The KL reference model: the frozen reference of --objective policy --kl-beta (not the ground-truth references
of --include-reference, which are `evaluation.with_references`): what it is, its per-token log-probabilities of a
generation's candidates (no graph, a chunk of rows at a time, once per generation), and what a checkpoint
records of it.

The reference is the model at the first RL step (the end of MLE), or --ref-checkpoint's. It is of one of three
kinds, decided at the first RL step and saved in the checkpoint, so that a resumed run scores against the
reference it began with whatever the model or the flags would decide now:

    copy      every parameter trains: a copy of the model, or a model with --ref-checkpoint's parameters
    base      LoRA adapters (--lora-r) that still add nothing (peft's initialisation, lora_B = 0: RL starts from
              the --hf-model itself): the trained model with its adapters disabled. Nothing copied, nothing saved.
    adapters  some parameters frozen (LoRA: the base) and the trainable ones (the adapters) already trained (by
              the MLE phase, or loaded by --init-from), or --ref-checkpoint's: the frozen base is shared, and a
              copy of the adapters alone is put in place of the model's own while the reference scores; the
              model's are put back after it, bit for bit.

So with LoRA the reference costs no copy of the model: nothing (base) or the adapters' bytes (adapters). Under
--fsdp a copy is sharded like the model (`fsdp.copy_model`) and gathered for its scoring pass only; the
checkpoint holds its whole tensors.

Letters: N rows, T positions.
"""
from __future__ import annotations

import contextlib

import torch

from .. import protocol
from ..samples import Samples
from ..system import fsdp
from ..system.fsdp import saved_state
from ..errors import UsageError

KINDS = ("copy", "base", "adapters")


class Reference:
    """kind (KINDS); `copy`: the frozen model of kind copy; `values`: name -> tensor, the trainable parameters'
    values of kind adapters."""

    def __init__(self, kind: str, copy_model=None, values: dict | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown reference kind {kind!r}; the checkpoint is from another version")
        self.kind, self.copy, self.values = kind, copy_model, values

    # ------------------------------------------------------------------ making one
    @classmethod
    def of(cls, model, ref_checkpoint: str | None, device, build=None) -> "Reference":
        """The reference of `model` at the first RL step (see the module docstring); `build()` makes a fresh
        model of the task (needed to copy a sharded model: FSDP2 refuses deepcopy)."""
        if all(p.requires_grad for p in model.parameters()):
            ref = fsdp.copy_model(model, build)
            if ref_checkpoint is not None:
                try:
                    fsdp.load_model(ref, _model_state(ref_checkpoint))
                except RuntimeError as err:
                    raise UsageError(f"--ref-checkpoint {ref_checkpoint}: {str(err).splitlines()[0]}") from None
            return cls("copy", _frozen(ref))
        if ref_checkpoint is not None:
            return cls("adapters", values=_adapters_of(model, ref_checkpoint))
        adapter = getattr(model, "adapter", None)
        if adapter is not None:
            from ..models.hf import lora  # an adapter exists only where transformers and peft were imported
            if lora.adds_nothing(adapter):
                return cls("base")
        return cls("adapters", values={k: v.detach().clone() for k, v in saved_state(model).items()})

    # ------------------------------------------------------------------ scoring
    @contextlib.contextmanager
    def scorer(self, model):
        """The module that computes the reference's log-probabilities: the copy, or `model` itself with its
        adapters disabled (base) or swapped for the reference's (adapters) for the duration."""
        if self.kind == "copy":
            with fsdp.gathered(self.copy):  # --fsdp: whole for this pass only
                yield self.copy
        elif self.kind == "base":
            from ..models.hf import lora
            with lora.base_only(model.adapter):
                yield model
        else:
            with _swapped(model, self.values):
                yield model

    @torch.no_grad()
    def log_probs(self, model, source, cand: Samples, chunk: int, autocast) -> torch.Tensor:
        """(N, T) float64: the reference's per-token log-probabilities of cand, `chunk` rows at a time."""
        with self.scorer(model) as ref, protocol.eval_mode(ref), autocast():
            enc = ref.encode(source)
            parts = [protocol.token_scores(ref, enc, cand.tokens[i:i + chunk], cand.owner[i:i + chunk])
                     for i in range(0, len(cand), chunk)]
        return torch.cat(parts).to(torch.float64) if parts else cand.tokens.new_zeros(0, 0, dtype=torch.float64)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """A collective under --fsdp (a sharded copy's whole tensors are gathered)."""
        if self.kind == "copy":
            return {"kind": "copy", "state": {k: fsdp.whole(v) for k, v in self.copy.state_dict().items()}}
        return {"kind": self.kind, "state": self.values}

    @classmethod
    def from_state(cls, state: dict | None, model, build=None) -> "Reference | None":
        """The reference a checkpoint recorded (None: not made yet). A state dict without "kind": a checkpoint
        of the version before the kinds, whose reference was always a copy."""
        if state is None:
            return None
        kind, values = (state["kind"], state["state"]) if "kind" in state else ("copy", state)
        if kind == "copy":
            ref = fsdp.copy_model(model, build)
            fsdp.load_model(ref, values)  # whole tensors, into the shards under --fsdp
            return cls("copy", _frozen(ref))
        if kind == "base" and getattr(model, "adapter", None) is None:
            raise UsageError("the checkpoint's reference is the base of a LoRA model (--lora-r), and this model "
                               "has no adapters")
        return cls(kind, values=dict(values) if values is not None else None)


def _frozen(model):
    return model.eval().requires_grad_(False)


def _model_state(path: str) -> dict:
    """The parameters a --ref-checkpoint file holds: a twophase checkpoint's "model", or a bare state dict."""
    try:
        # On the CPU (its parameters are copied into a model on the device), memory-mapped: an optimizer's
        # state in the file is never read
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - whatever torch.load raises, the file is not a checkpoint
        raise UsageError(f"--ref-checkpoint {path}: not a checkpoint torch.load can read "
                           f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    if not isinstance(state, dict):
        raise UsageError(f"--ref-checkpoint {path}: holds a {type(state).__name__}, not a state dict")
    return state["model"] if isinstance(state.get("model"), dict) else state


def _adapters_of(model, path: str) -> dict:
    """--ref-checkpoint for a model with frozen parameters (LoRA): its values of the trainable ones (the
    adapters: a checkpoint of a --lora-r run of the same model and adapters, which holds them alone). Entries of
    frozen parameters are allowed where they equal the model's: the reference shares this model's base."""
    state, own = _model_state(path), model.state_dict()
    trainable = saved_state(model)
    why = "with --lora-r the reference is this model's base with the file's adapters (a --lora-r run's checkpoint)"
    missing = [k for k in trainable if k not in state]
    if missing:
        raise UsageError(f"--ref-checkpoint {path}: no {missing[0]}; {why}")
    for k, v in state.items():
        if k not in own:
            raise UsageError(f"--ref-checkpoint {path}: {k} is no parameter of this model; {why}")
        if tuple(v.shape) != tuple(own[k].shape):
            raise UsageError(f"--ref-checkpoint {path}: {k} has shape {tuple(v.shape)}, the model's "
                               f"{tuple(own[k].shape)}; {why}")
        if k not in trainable and not torch.equal(v.to(own[k].device, own[k].dtype), own[k]):
            raise UsageError(f"--ref-checkpoint {path}: its {k} differs from this model's frozen one; {why}")
    return {k: state[k].to(device=trainable[k].device, dtype=trainable[k].dtype).clone() for k in trainable}


@contextlib.contextmanager
def _swapped(model, values: dict):
    """model's parameters named in `values` hold those values inside the block, their own again after it (the
    same bits: copied out and back, under no graph)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        own = {k: params[k].detach().clone() for k in values}
        for k, v in values.items():
            params[k].copy_(v)
    try:
        yield model
    finally:
        with torch.no_grad():
            for k, v in own.items():
                params[k].copy_(v)

