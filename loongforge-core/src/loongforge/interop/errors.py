"""The one error type of Hugging Face interop, so the CLI prints a conversion problem as one line."""

from __future__ import annotations

from loongforge.errors import LoongForgeError


class InteropError(LoongForgeError):
    """A checkpoint or config that cannot be converted; the message names the file, key or tensor."""
