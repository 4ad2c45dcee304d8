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
