"""The exception a SIGTERM becomes in the commands that take it as a Ctrl-C (:func:`rlhf_core.cli.sigterm_as_interrupt`).

Here, not in :mod:`rlhf_core.cli`, so that the library (the scheduler of retraining runs) can tell it from a Ctrl-C
without importing the commands."""


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised where Python raises KeyboardInterrupt for a Ctrl-C, so that a command's Ctrl-C paths (the
    line naming what was left, the finally blocks that close its workers) take it too, and say SIGTERM."""
