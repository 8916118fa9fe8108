"""The package's one-line error: a refusal of what the user gave (a flag, a file, a plug-in, a model), whose
message is one line naming what is at fault. The commands print it as `PROG: error: MESSAGE` and exit 2, with no
traceback; `twophase.fit` raises it. Each kind keeps its own name and its other base (ValueError, OSError), so that
callers catching those still do."""


class OneLineError(Exception):
    """A refusal of the user's input; str(err) is one line naming the flag, file or plug-in at fault."""


class UsageError(OneLineError, ValueError):
    """What the user gave cannot make this run (a flag, a combination of flags, a task, a file): one line."""
