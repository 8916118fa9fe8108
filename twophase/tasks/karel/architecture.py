"""--karel-model: which network `--task karel` builds, and from which flags.

- `pooled` (`twophase.models.karel.KarelModel`, the first model and the default of a checkpoint that predates the
  flag): the pairs' embeddings are max-pooled into one specification vector, one LSTM decodes.
- `paper` (`twophase.models.karel_paper.KarelPaperModel`, Bunel et al.'s IOs2Seq): an LSTM per pair, max-pooled
  at every step; sized by --karel-channels, --karel-blocks, --karel-pair-dim, --karel-layers.

Both read --hidden-size, --embed-dim and --dropout. The choice and the sizes are training flags, so every
checkpoint's config records them and decoding rebuilds the same network.
"""
from __future__ import annotations

import dataclasses

from ...models.karel import KarelModel
from ...models.karel_paper import KarelPaperModel

POOLED_CHANNELS = (32, 32)  # the pooled model's CNN, fixed since its first version
PAPER_FLAGS = {"karel_channels": "channels", "karel_blocks": "blocks", "karel_pair_dim": "pair_dim",
               "karel_layers": "layers"}  # Config field -> KarelPaperModel argument


def check(cfg) -> str | None:
    """A one-line complaint naming the flag, or None: the paper model's sizes given to the pooled model (they
    would do nothing), or an odd --karel-channels."""
    model = getattr(cfg, "karel_model", "pooled")
    if model == "pooled":
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else {}
        for name in PAPER_FLAGS:
            if name in defaults and getattr(cfg, name) != defaults[name]:
                return f"{_flag(name)} sizes --karel-model paper, not --karel-model pooled"
        return None
    if cfg.karel_channels % 2:
        return f"--karel-channels must be even (each world's first convolution gives half), got {cfg.karel_channels}"
    return None


def build(cfg, vocab_size: int, rows: int, cols: int):
    """The `SequenceModel` --karel-model names, sized by the flags."""
    if getattr(cfg, "karel_model", "pooled") == "paper":
        sizes = {arg: getattr(cfg, name) for name, arg in PAPER_FLAGS.items()}
        return KarelPaperModel(vocab_size, rows, cols, cfg.embed_dim, cfg.hidden_size, dropout=cfg.dropout, **sizes)
    return KarelModel(vocab_size, rows, cols, cfg.embed_dim, cfg.hidden_size, POOLED_CHANNELS, cfg.dropout)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
