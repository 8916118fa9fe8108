"""A run: the trainer and its steps (`trainer`; `steps`: one module per step family, given the parts as plain data),
the run that owns them (`run`, `runstate`, `runparts`, `mlephase`), validation and the KL reference (`evaluation`,
`klreference`), the run's directory and checkpoints (`rundir`, `checkpoint`, `resume`, `report`), where a command
starts from (`startpoint`), the run's set-up in run order (`recipe`) and the commands around it (`cli`, `fit`,
`decode`). Only the run and those commands hold a `run.Run`: every other part is given what it uses (the trainer,
the run's state, the parts and functions it calls) and writes its own part of a checkpoint."""
