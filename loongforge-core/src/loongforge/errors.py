"""Exceptions whose message is the whole story.

The CLI prints these as one line without a traceback, so each message must say what was wrong, where
(file, key, sample) and what to do next.
"""

from __future__ import annotations


class LoongForgeError(Exception):
    """Base of errors that are the user's to fix; the CLI prints them as one line."""


class ConfigError(LoongForgeError):
    """A config file or override is malformed: bad YAML, unknown key, wrong type or bad value."""


class PluginLoadError(LoongForgeError):
    """A plugin failed to import or register."""


class InteropError(LoongForgeError):
    """A checkpoint or config that cannot be converted; the message names the file, key or tensor."""


class TrainingDivergedError(LoongForgeError):
    """A step's loss or gradient norm was not finite (``training.on_nonfinite: stop``); the message names the step,
    the value and the newest checkpoint saved before it, which is where a fixed run resumes from."""


class UntrustedCheckpointError(LoongForgeError):
    """Loading a checkpoint would run code that came with it: a pickled object that is not plain checkpoint data
    (refused before it is unpickled), or a ``pkg.module:attr`` name in its recorded config without ``--trust-code``.
    The message names the file and what was refused."""


class TrainingPreempted(LoongForgeError):
    """SIGTERM or SIGUSR1 arrived during training (``checkpoint.save_on_signal``): every rank saved a checkpoint at
    the step boundary after it and stopped. Not a failure of the run: ``loongforge train`` prints the message (the
    signal, the step, the checkpoint) as one line and exits with :attr:`exit_status`, which a job script can tell
    from an error (2) and requeue on; the same command resumes from that checkpoint."""

    exit_status = 3
    #: The signals that preempt a run, by name (the launcher of ``--nproc`` forwards the same ones to its ranks;
    #: SIGUSR1 does not exist on Windows).
    signals = ("SIGTERM", "SIGUSR1")
