"""Synthetic seq2seq tasks written as TSV files, for tests: copy, reverse and sort of short digit strings."""
import random

TASKS = {"copy": lambda x: x, "reverse": lambda x: x[::-1], "sort": sorted}


def write_task(path, task: str, n: int, seed: int = 0, alphabet: str = "abcdefg", max_len: int = 6) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            src = [rng.choice(alphabet) for _ in range(rng.randint(1, max_len))]
            f.write(" ".join(src) + "\t" + " ".join(TASKS[task](src)) + "\n")


def task_dir(tmp_path_factory, n_train: int, n_valid: int):
    """A temporary folder with train.tsv and valid.tsv of the 'reverse' task (for module-scoped fixtures)."""
    d = tmp_path_factory.mktemp("task")
    write_task(d / "train.tsv", "reverse", n_train, seed=0)
    write_task(d / "valid.tsv", "reverse", n_valid, seed=1)
    return d


def small_task_here(tmp_path, monkeypatch):
    """train.tsv (60 rows) and valid.tsv (8) of the 'reverse' task in tmp_path, made the working directory (the
    config files' and Config's relative paths are read from there)."""
    write_task(tmp_path / "train.tsv", "reverse", 60, seed=0)
    write_task(tmp_path / "valid.tsv", "reverse", 8, seed=1)
    monkeypatch.chdir(tmp_path)
    return tmp_path
