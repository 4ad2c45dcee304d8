"""What the installed torch was built for, read without importing torch.

Why: importing torch costs seconds (more under load), and the commands that do no training -- ``check``,
``doctor``, ``plan`` -- only need to know whether a CUDA or ROCm build is installed to rule a backend out. torch
writes its build facts into ``torch/version.py`` as plain literal assignments (``cuda = '12.4'`` or ``None``), so
they are read from that file's syntax tree, never executed. Once torch is imported (or when that file is
unreadable), its own ``torch.version`` is the answer.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class TorchBuild:
    """The installed torch's version and the accelerator toolkits it was compiled against (``None``: not)."""

    version: str
    cuda: str | None
    hip: str | None


def installed_torch_build() -> TorchBuild:
    """The installed torch's build: from its version file when torch is not imported yet, else (and when that file
    cannot be read) from ``torch.version``."""
    if "torch" not in sys.modules:
        spec = importlib.util.find_spec("torch")
        facts = _literal_assignments(Path(spec.origin).with_name("version.py")) if spec and spec.origin else {}
        if isinstance(facts.get("__version__"), str):
            return TorchBuild(facts["__version__"], facts.get("cuda"), facts.get("hip"))
    import torch

    return TorchBuild(str(torch.__version__), torch.version.cuda, getattr(torch.version, "hip", None))


def _literal_assignments(path: Path) -> dict[str, object]:
    """``NAME = <literal>`` (plain or annotated) at the top of ``path``; empty when the file is missing or not
    Python."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    facts: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                facts[target.id] = ast.literal_eval(value)
            except ValueError:  # not a literal (a call, a name): not a build fact
                continue
    return facts
