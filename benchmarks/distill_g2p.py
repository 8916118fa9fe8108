"""G2P distillation at equal CPU time: the pieces train.py has no flag for, and the table.

    python benchmarks/distill_g2p.py decode --teacher T.pt --count K --seed S --out kd.tsv   # sequence-level KD data
    python benchmarks/distill_g2p.py kd --data kd.tsv --init-from STUDENT.pt --mle-steps N --seed S --save-dir D
    python benchmarks/distill_g2p.py table --runs RUNS                                       # the results' table

`decode`: K training words drawn at random (the seed's), decoded by the teacher with twophase-decode (beam 5,
the validation beam), written as `word<TAB>phonemes`; the CPU seconds of the decode go to kd.tsv.json.
`kd`: MLE on that file from the student's weights: the g2p task with its training references replaced by the
teacher's outputs (validation and test are CMUdict's), through `twophase.fit`, so the run is train.py's.
`table`: test word accuracy and PER of every arm, per seed and the mean, with the CPU seconds each arm trained
(RUNS/{distill-b1,distill-b0.5,kd,kd-half}-s{1,2}/metrics.jsonl; a kd run's teacher seconds from
RUNS/<run>-s<seed>.tsv.json).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
from pathlib import Path

import twophase
from twophase.tasks.data import load_cmudict, load_tsv
from twophase.tasks.text import G2P


class TeacherG2P(G2P):
    """CMUdict G2P whose training pairs are (word, the teacher's beam output) from a TSV file."""

    def __init__(self, cfg, data: str):
        super().__init__(cfg)
        self.data = data

    def splits(self):
        _, valid, test = load_cmudict()
        return load_tsv(self.data, char_source=True), valid, test


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def decode(args) -> None:
    train, _, _ = load_cmudict()
    words = ["".join(s) for s in train.sources]
    chosen = random.Random(args.seed).sample(words, min(args.count, len(words)))
    out = Path(args.out)
    src = out.with_suffix(".src")
    src.write_text("".join(w + "\n" for w in chosen), encoding="utf-8")
    before = child_cpu_seconds()
    subprocess.run([sys.executable, "-m", "twophase.train.decode", "--checkpoint", args.teacher, "--input", str(src),
                    "--output", str(out.with_suffix(".hyp")), "--beam-size", "5", "--device", "cpu"], check=True)
    cpu = child_cpu_seconds() - before
    hyps = out.with_suffix(".hyp").read_text(encoding="utf-8").splitlines()
    out.write_text("".join(f"{w}\t{h}\n" for w, h in zip(chosen, hyps) if h.strip()), encoding="utf-8")
    Path(str(out) + ".json").write_text(json.dumps({"words": len(chosen), "decode_cpu_s": round(cpu, 1)}))
    print(f"{len(chosen)} words decoded by the teacher in {cpu:.1f} CPU s -> {out}")


def kd(args) -> None:
    cfg = twophase.Config(task="g2p", init_from=args.init_from, hidden_size=args.hidden_size,
                          embed_dim=args.embed_dim, mle_steps=args.mle_steps, lr=args.lr, lr_decay=1.0, rl_steps=0,
                          compare_mle=False, eval_every=10**9, save_every=10**9, seed=args.seed, threads=1,
                          save_dir=args.save_dir)
    twophase.fit(cfg, task=TeacherG2P(cfg, args.data))


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def arm_scores(run: Path, model: str) -> tuple[dict, float]:
    """The test scores of `model` in the run and the CPU seconds of its training steps (its last validation's)."""
    log = rows(run / "metrics.jsonl")
    test = [r for r in log if r["phase"] == "test" and r["model"] == model][-1]
    after = {"rl": "rl", "mle-continued": "mle-continued", "mle": "mle"}[model]
    evals = [r for r in log if r["phase"] == "eval" and r.get("after") == after]
    return test, (evals[-1]["train_s"] if evals else 0.0)


def table(args) -> None:
    runs = Path(args.runs)
    arms = [("student start (MLE warm start)", "distill-b1", "mle"),
            ("(a) MLE continued", "distill-b1", "mle-continued"),
            ("(b) sequence-level KD", "kd", "mle"),
            ("(b') sequence-level KD, the teacher's decoding inside the budget", "kd-half", "mle"),
            ("(c) on-policy distillation, beta 1", "distill-b1", "rl"),
            ("(d) on-policy distillation, beta 0.5", "distill-b0.5", "rl")]
    seeds = args.seeds
    print("| arm | " + " | ".join(f"seed {s}: word acc / PER / CPU s" for s in seeds) + " | mean word acc | mean PER |")
    print("|---|" + "---|" * (len(seeds) + 2))
    for name, run, model in arms:
        cells, accs, pers = [], [], []
        for s in seeds:
            d = runs / f"{run}-s{s}"
            if not (d / "metrics.jsonl").exists():
                cells.append("not run")
                continue
            try:
                test, cpu = arm_scores(d, model)
            except IndexError:
                cells.append("unfinished")
                continue
            if run.startswith("kd"):
                info = json.loads((runs / f"{run}-s{s}.tsv.json").read_text())
                cpu_text = f"{cpu:.0f} (+{info['decode_cpu_s']:.0f} teacher)"
            else:
                cpu_text = "0" if model == "mle" else f"{cpu:.0f}"
            accs.append(test["word_acc"])
            pers.append(test["per"])
            cells.append(f"{100 * test['word_acc']:.2f} / {100 * test['per']:.2f} / {cpu_text}")
        mean = (f"{100 * sum(accs) / len(accs):.2f} | {100 * sum(pers) / len(pers):.2f}" if accs else "- | -")
        print(f"| {name} | " + " | ".join(cells) + f" | {mean} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--teacher", required=True)
    d.add_argument("--count", type=int, required=True)
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--out", required=True)
    k = sub.add_parser("kd")
    k.add_argument("--data", required=True)
    k.add_argument("--init-from", required=True)
    k.add_argument("--mle-steps", type=int, required=True)
    k.add_argument("--lr", type=float, default=2e-4)  # train.py's --rl-lr: the rate of every arm
    k.add_argument("--hidden-size", type=int, default=64)
    k.add_argument("--embed-dim", type=int, default=16)
    k.add_argument("--seed", type=int, default=1)
    k.add_argument("--save-dir", required=True)
    t = sub.add_parser("table")
    t.add_argument("--runs", required=True)
    t.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    {"decode": decode, "kd": kd, "table": table}[args.command](args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
