"""The lighter megatron-core import (:mod:`loongforge.megatron_import`), each case in a fresh interpreter.

What must hold: after ``import loongforge``, importing megatron imports neither ``wandb`` nor TensorBoard nor runs
dynamo, megatron sees them as absent while a later import gets the real module (or the genuine "not installed"),
megatron's ``jit_fuser`` still compiles -- at a helper's first call -- with the helper's results unchanged, and a
megatron imported before LoongForge is left as it was.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap


def _run(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_megatron_imports_without_wandb_tensorboard_or_dynamo_and_they_stay_importable() -> None:
    facts = _run("""
        import json, sys
        import loongforge
        import megatron.core, megatron.core.timers, megatron.core.models.gpt, megatron.core.optimizer
        facts = {"wandb_loaded": "wandb" in sys.modules, "dynamo_loaded": "torch._dynamo" in sys.modules,
                 "tensorboard_loaded": sorted(m for m in sys.modules if "tensorboard" in m),
                 "timers_wandb_is_none": megatron.core.timers.wandb is None,
                 "timers_writer_is_none": megatron.core.timers.SummaryWriter is None}
        try:
            import wandb
            facts["later_wandb"] = wandb.__name__
        except ModuleNotFoundError as error:
            facts["later_wandb"] = "missing: " + str(error)
        from torch.utils.tensorboard import SummaryWriter
        facts["later_writer"] = SummaryWriter.__module__
        print(json.dumps(facts))
    """)
    assert facts["wandb_loaded"] is False
    assert facts["dynamo_loaded"] is False
    assert facts["tensorboard_loaded"] == []
    assert facts["timers_wandb_is_none"] is True
    assert facts["timers_writer_is_none"] is True
    installed = importlib.util.find_spec("wandb") is not None
    assert facts["later_wandb"] == ("wandb" if installed else "missing: No module named 'wandb'")
    assert facts["later_writer"] == "torch.utils.tensorboard.writer"


def test_tensorboard_imported_before_megatron_keeps_its_place() -> None:
    facts = _run("""
        import json
        from torch.utils.tensorboard import SummaryWriter
        import loongforge
        import megatron.core.timers
        print(json.dumps({"same_writer": megatron.core.timers.SummaryWriter is SummaryWriter}))
    """)
    assert facts == {"same_writer": True}


def test_jit_fuser_compiles_at_first_call_with_unchanged_results() -> None:
    facts = _run("""
        import json, sys, torch
        import loongforge
        from megatron.core import jit
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
        from loongforge.megatron_import import deferred_compile
        before = "torch._dynamo" in sys.modules
        x, bias = torch.randn(4, 16), torch.randn(16)
        eager = torch.nn.functional.silu((x + bias)[:, :8]) * (x + bias)[:, 8:]
        fused = bias_swiglu(x, bias)
        print(json.dumps({"deferred": jit.jit_fuser is deferred_compile, "dynamo_before_call": before,
                          "dynamo_after_call": "torch._dynamo" in sys.modules,
                          "max_diff": (fused - eager).abs().max().item()}))
    """)
    assert facts["deferred"] is True
    assert facts["dynamo_before_call"] is False and facts["dynamo_after_call"] is True
    assert facts["max_diff"] < 1e-6


def test_megatron_imported_first_is_left_alone() -> None:
    facts = _run("""
        import json, sys, torch
        import megatron.core.jit
        import loongforge
        from loongforge.megatron_import import MegatronImportFinder
        print(json.dumps({"jit_fuser_is_torch_compile": megatron.core.jit.jit_fuser is torch.compile,
                          "finder": any(isinstance(f, MegatronImportFinder) for f in sys.meta_path)}))
    """)
    assert facts == {"jit_fuser_is_torch_compile": True, "finder": False}
