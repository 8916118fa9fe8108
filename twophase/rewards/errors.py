"""The one error of the rewards package, in a module of its own so that every reward module can raise it."""

from ..errors import OneLineError


class RewardError(OneLineError, ValueError):
    """A reward could not be found, loaded or run; the message is one line naming the plug-in."""
