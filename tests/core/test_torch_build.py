"""The installed torch's build facts, read from ``torch/version.py`` without importing torch (what lets the CUDA
backend's probe rule out a CPU-only build while ``check`` stays torch-free)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from loongforge.devices.torch_build import TorchBuild, _literal_assignments


def test_the_version_file_gives_what_torch_reports_without_importing_it():
    code = ("import json, sys; from loongforge.devices.torch_build import installed_torch_build; "
            "build = installed_torch_build(); "
            "print(json.dumps([build.version, build.cuda, build.hip, 'torch' in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == [torch.__version__, torch.version.cuda, torch.version.hip, False]


def test_a_cuda_build_file_is_read_as_such(tmp_path):
    """A CUDA wheel's file (annotated and plain assignments); a non-literal value is skipped, not executed."""
    version = tmp_path / "version.py"
    version.write_text("from typing import Optional\n\n__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\n"
                       "hip: Optional[str] = None\ngit_version = compute()\n", encoding="utf-8")
    facts = _literal_assignments(version)
    assert facts == {"__version__": "2.13.0+cu128", "cuda": "12.8", "hip": None}
    assert TorchBuild(facts["__version__"], facts["cuda"], facts["hip"]).cuda == "12.8"
    assert _literal_assignments(tmp_path / "absent.py") == {}
    (tmp_path / "broken.py").write_text("cuda = (\n", encoding="utf-8")
    assert _literal_assignments(tmp_path / "broken.py") == {}
