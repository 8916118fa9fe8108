"""The GPU check (`python -m twophase.bench.gpu`, docs/gpu.md): one section per module, run by `runner`."""
