"""Where and how the computation runs: the device and its float32 modes (`devices`), mixed precision
(`amp`), memory figures (`memory`), a step's profile and phase two's chunk size from a memory budget
(`profiling`), data-parallel processes (`distributed`) and sharded models with what a checkpoint holds of a model
(`fsdp`).

This layer sits below `twophase.train` and above the core: it imports core modules, never the trainer.
"""
