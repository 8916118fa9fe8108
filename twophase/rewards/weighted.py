"""Several rewards summed with weights: `--reward a,b,c --reward-weights 1,0.5,0.5`, TRL's `reward_funcs` with
`reward_weights`.

r_i = sum_j w_j r_ij over the rewards j that score candidate i; a reward's None (NaN here: no reward for that
candidate) adds nothing, and a candidate no reward scores gets NaN, which the objectives leave out of its
source's baseline and set (as TRL's GRPO: nansum over the rewards, an all-None row unscorable). Each call keeps
every reward's values (`last`), which the trainer logs as `reward/<name>/mean` and `reward/<name>/std`.

Letters: N candidates, J rewards.
"""
from __future__ import annotations

import math
from typing import Any, Callable


def display_names(specs: list[str], rewards: list[Callable]) -> list[str]:
    """Each reward's name in the logs: the function's name for `module:callable` (as TRL names its reward
    functions), a reward model's folder name (as TRL's), else the registered name; a repeated name gets a suffix
    _2, _3, ..."""
    from .hfmodel import is_folder_spec

    names, seen = [], {}
    for spec, fn in zip(specs, rewards):
        name = getattr(fn, "__name__", spec) if ":" in spec or is_folder_spec(spec) else spec
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return names


class WeightedSum:
    """A reward (hypotheses, references, **context) -> (N,) list: the weighted sum of `rewards` (each already
    validated, see `twophase.rewards.get`)."""

    def __init__(self, rewards: list[Callable[..., list[float]]], weights: list[float], names: list[str]):
        if not (len(rewards) == len(weights) == len(names)) or not rewards:
            raise ValueError(f"{len(rewards)} rewards, {len(weights)} weights and {len(names)} names")
        self.rewards, self.weights, self.names = rewards, weights, names
        self.name = ",".join(names)
        # a candidate without references can be scored only where some reward needs none
        self.needs_references = all(getattr(fn, "needs_references", False) for fn in rewards)
        self.last: dict[str, list[float]] | None = None  # name -> the (N,) values of the last call

    def __call__(self, hypotheses: list[str], references: list[list[str]], **context: Any) -> list[float]:
        values = [fn(hypotheses, references, **context) for fn in self.rewards]  # J lists of N
        self.last = dict(zip(self.names, values))
        out = []
        for i in range(len(hypotheses)):
            terms = [w * v[i] for w, v in zip(self.weights, values) if not math.isnan(v[i])]
            out.append(math.fsum(terms) if terms else math.nan)
        return out


def statistics(values: dict[str, list[float]]) -> dict[str, float]:
    """Additive sums of each reward's values, NaN left out: {name/sum, name/squares, name/count}."""
    out = {}
    for name, v in values.items():
        kept = [x for x in v if not math.isnan(x)]
        out.update({f"{name}/sum": math.fsum(kept), f"{name}/squares": math.fsum(x * x for x in kept),
                    f"{name}/count": float(len(kept))})
    return out


def mean_std(sums: dict[str, float], names: list[str]) -> dict[str, float | None]:
    """reward/<name>/mean and /std (unbiased, as TRL's nanstd) from summed `statistics`; None where no candidate
    was scored (or one, for the std)."""
    out = {}
    for name in names:
        n, s, q = sums[f"{name}/count"], sums[f"{name}/sum"], sums[f"{name}/squares"]
        mean = s / n if n else None
        var = (q - n * mean * mean) / (n - 1) if n > 1 else None
        out[f"reward/{name}/mean"] = mean
        out[f"reward/{name}/std"] = math.sqrt(max(var, 0.0)) if var is not None else None
    return out


def names(spec: str) -> list[str]:
    """The rewards of `--reward spec`, comma-separated: a piece runs on over the commas after it where the
    longer text names a reward model's folder (a path may hold a comma), the longest such text first."""
    from .hfmodel import holds_model

    pieces, out, i = spec.split(","), [], 0
    while i < len(pieces):
        end = next((j for j in range(len(pieces), i + 1, -1) if holds_model(",".join(pieces[i:j]).strip())), i + 1)
        out.append(",".join(pieces[i:end]).strip())
        i = end
    return out


def recorded(spec: str) -> str:
    """`--reward spec` as a run records it: each of its rewards (`names`) as `registry.recorded` does."""
    from .registry import recorded as one

    return ",".join(one(s) for s in names(spec))


def from_flags(spec: str, weights: str | None, device: Any = None, causal: bool = False):
    """The reward `--reward spec [--reward-weights weights]` names: one plug-in, or a WeightedSum of the
    comma-separated plug-ins (weights 1 unless given, one per reward); a reward model among them on `device`,
    scoring prompt + completion where `causal` (see `registry.get`). RewardError (one line) on bad input."""
    from .registry import RewardError, get

    specs = names(spec)
    if not all(specs):
        raise RewardError(f"--reward {spec}: an empty reward name in the list")
    if weights is None and len(specs) == 1:
        return get(specs[0], device, causal)
    values = parse_weights(weights, len(specs), "--reward-weights", f"reward of --reward {spec}")
    rewards = [get(s, device, causal) for s in specs]
    return WeightedSum(rewards, values, display_names(specs, rewards))


def parse_weights(weights: str | None, count: int, flag: str, each: str) -> list[float]:
    """`count` finite weights from "w1,w2,..." (1 each where `weights` is None); RewardError naming `flag`, one
    weight per `each`, otherwise."""
    from .registry import RewardError

    if weights is None:
        return [1.0] * count
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise RewardError(f"{flag} {weights}: expected comma-separated numbers") from None
    if len(values) != count or not all(math.isfinite(w) for w in values):
        raise RewardError(f"{flag} {weights}: expected {count} finite numbers, one per {each}")
    return values
