"""The one error type of the data package.

Bad data is the user's to fix, so it is a :class:`~loongforge.errors.LoongForgeError` (the CLI prints it as
one line) and a ``ValueError`` (callers outside LoongForge catch it as the usual bad-value error). Every
message names the file, and the line where there is one.
"""

from __future__ import annotations

from loongforge.errors import LoongForgeError


class DataError(LoongForgeError, ValueError):
    """An input, tokenizer directory or token dataset is missing, malformed or inconsistent."""
