"""Make the FAKE vendor modules in tests/fakes importable (see tests/fakes/README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

FAKES = Path(__file__).resolve().parents[1] / "fakes"
if str(FAKES) not in sys.path:
    sys.path.insert(0, str(FAKES))
