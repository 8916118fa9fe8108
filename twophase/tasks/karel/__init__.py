"""Karel program synthesis (Bunel et al., 2018, "Leveraging Grammar and Reinforcement Learning for Neural
Program Synthesis"): the DSL, worlds, an interpreter and a seeded task generator.

- `dsl`: `parse(program) -> Program` (raises `KarelSyntaxError`, a SyntaxError), `try_parse` (None on
  error), the token `VOCAB`; programs are strings like `DEF run m( WHILE c( frontIsClear c) w( move w) m)`.
- `world`: `World.from_text` / `to_text` / `from_arrays` / `to_array` (16 channels of Bunel et al.).
- `execute`: `execute(program, world, max_ticks=200) -> World | None` (memoised), `run(parsed, world,
  max_ticks)`, `trace(...) -> Trace` (status, final world, ticks, branch coverage), `branches(parsed)`.
- `generate`: `GeneratorParams`, `Example` (program + pairs; `.spec`, `.held_out`), `sample_example`, ...
- `dataset`: `generate_dataset(n_train, n_valid, n_test, seed, cache_dir=True, **params)`, cached as JSON
  lines; `load_dataset`, `save_dataset`.
- `stats`: split statistics (`python -m twophase.tasks.karel.stats`); `baselines`: enumeration and retrieval
  baselines (`python -m twophase.tasks.karel.baselines`); `grids`: `PairSet`, pairs with cached model input.
- `reward`: the execution reward `karel(hypotheses, references, spec)` (1 if all specification pairs pass)
  and `outcome`; `task`: `--task karel` (`Karel`; `architecture`: the model `--karel-model` builds,
  `twophase.models.karel.KarelModel` or `twophase.models.karel_paper.KarelPaperModel`); see docs/karel.md.

The interpreter compiles a parsed program once and memoises executions, because the reward executes every
candidate on every specification pair at every RL step (its speed: docs/results/).
"""
from .dataset import default_cache_dir, generate_dataset, load_dataset, save_dataset
from .dsl import ACTIONS, CONDITIONS, VOCAB, KarelSyntaxError, Program, parse, try_parse
from .execute import Trace, branches, clear_caches, execute, run, trace
from .generate import Example, GeneratorParams, is_canonical, sample_example, sample_program, sample_world
from .world import DIRS, World

__all__ = ["ACTIONS", "CONDITIONS", "DIRS", "VOCAB", "Example", "GeneratorParams", "KarelSyntaxError", "Program",
           "Trace", "World", "branches", "clear_caches", "default_cache_dir", "execute", "generate_dataset",
           "is_canonical", "load_dataset", "parse", "run", "sample_example", "sample_program", "sample_world",
           "save_dataset", "trace", "try_parse"]
