"""The Kunlunxin P800 device backend (XPyTorch / ``torch_xmlir``).

Kunlun's PyTorch runs in CUDA-compatible mode: ``import torch_xmlir`` routes the ``torch.cuda`` API and the
``nccl`` process-group backend to the XPU and BKCL. So tensors live on device type ``"cuda"`` and the
distributed backend is ``"nccl"`` -- as in baidu/vLLM-Kunlun's ``vllm_kunlun/platforms/kunlun.py``
(``KunlunPlatform.device_type == "cuda"``, ``dist_backend = "nccl"``) and the reference LoongForge P800 scripts
(``--distributed-backend nccl``). The same routing makes ``torch.cuda.is_available()`` true on a P800 host,
which is why this backend has a higher priority (300) than CUDA (200) and never asks ``torch.cuda`` when probing.

The probe looks for the ``torch_xmlir`` package with ``find_spec`` (without importing it: the import reads
the XMLIR/BKCL environment, which ``configure_env`` must set first) and for the driver's device nodes
``/dev/xpuN`` (the nodes Kunlun containers are started with, see vLLM-Kunlun's ``docs/source/installation.md``).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re
import shutil
from typing import Any

from loongforge.devices.base import DeviceModuleBackend, check_feature

from loongforge_xpu.environment import DEFAULT_ENV, apply_env_defaults
from loongforge_xpu.megatron_plugin import PATCH_MODULE, apply_megatron_xpu_plugin, describe_patches

#: What the P800 stack provides: bf16 and fp16 (vLLM-Kunlun's ``check_if_supports_dtype``) and sequence
#: parallelism (used by the reference scripts). No FP8, no Transformer Engine (the reference scripts disable
#: it: ``XFLAGS --disable transformer_engine_*``), no flash-attn package, no megatron CUDA graphs.
_SUPPORTED = frozenset({"bf16", "fp16", "sequence_parallel"})


class XPUBackend(DeviceModuleBackend):
    """Kunlunxin P800 XPUs through torch_xmlir's CUDA-compatible ``torch.cuda`` API and BKCL."""

    name = "xpu"
    priority = 300
    device_type = "cuda"
    dist_backend = "nccl"
    #: Device nodes of the Kunlun driver (one per XPU; ``/dev/xpuctrl`` is the control node and not counted).
    device_node_glob = "/dev/xpu[0-9]*"

    def device_nodes(self) -> list[str]:
        """The XPU device nodes present, in index order (a directory listing: no driver call)."""
        nodes = [p for p in glob.glob(self.device_node_glob) if re.search(r"xpu\d+$", p)]
        return sorted(nodes, key=lambda p: int(re.search(r"(\d+)$", p).group(1)))  # type: ignore[union-attr]

    def probe(self) -> tuple[bool, str]:
        """Available when torch_xmlir is installed and the driver exposes at least one ``/dev/xpuN``."""
        if importlib.util.find_spec("torch_xmlir") is None:
            return False, ("not present: torch_xmlir (Kunlun XPyTorch) is not importable; on a Kunlun host, install "
                           "Kunlun's XPyTorch wheel into this environment")
        nodes = self.device_nodes()
        if not nodes:
            return False, (f"torch_xmlir is installed but no Kunlun device node matches {self.device_node_glob}; "
                           "check the driver (xpu-smi), or start the container with the /dev/xpu* devices")
        return True, f"{len(nodes)} Kunlun XPU(s) ({', '.join(os.path.basename(n) for n in nodes)}) via torch_xmlir"

    def configure_env(self) -> None:
        """The XMLIR/BKCL defaults of :data:`loongforge_xpu.environment.DEFAULT_ENV` (setdefault only)."""
        apply_env_defaults()

    def apply_patches(self) -> None:
        """Kunlun's megatron-core patches when ``XMLIR_MEGATRON_CORE_XPU_PLUGIN`` asks for them (once)."""
        apply_megatron_xpu_plugin()

    def device_module(self) -> Any:
        """``torch.cuda``, after ``import torch_xmlir`` has routed it to the XPU."""
        importlib.import_module("torch_xmlir")
        return super().device_module()

    def planner_facts(self) -> dict[str, Any]:
        """The current XPU's memory and ranks per node with conservative speeds (see
        :mod:`loongforge_xpu.planner_facts`: no published P800 figures are claimed)."""
        from loongforge_xpu.planner_facts import xpu_facts

        return xpu_facts(self.device_module())

    def supports(self, feature: str) -> bool:
        """bf16, fp16 and sequence parallelism; no FP8, Transformer Engine, flash-attn or CUDA graphs."""
        check_feature(feature)
        return feature in _SUPPORTED

    def spec_provider(self) -> Any:
        """megatron-core's local layers, which Kunlun's ``xpu_plugin`` patches with fused XPU kernels, with a core
        attention that builds MLA too (:class:`~loongforge_xpu.spec.XPUSpecProvider`)."""
        from loongforge_xpu.spec import XPUSpecProvider

        return XPUSpecProvider()

    def doctor_rows(self) -> list[tuple[str, str]]:
        """The Kunlun stack: torch_xmlir, device nodes, xpu-smi, the patches and the XMLIR/BKCL environment.

        The patch row and the environment rows describe training's environment, that is this one with the
        :data:`DEFAULT_ENV` defaults ``configure_env`` fills in (without changing this process's)."""
        spec = importlib.util.find_spec("torch_xmlir")
        patches_installed = importlib.util.find_spec(PATCH_MODULE) is not None
        training_env = {**{name: value for name, (value, _why) in DEFAULT_ENV.items()}, **os.environ}
        rows = [
            ("torch_xmlir", (spec.origin or "installed") if spec is not None else "not installed"),
            ("device nodes", ", ".join(self.device_nodes()) or f"none matching {self.device_node_glob}"),
            ("xpu-smi", shutil.which("xpu-smi") or "not on PATH"),
            (PATCH_MODULE, "installed" if patches_installed else "not installed"),
            ("megatron patches", describe_patches(training_env, patches_installed)),
        ]
        user_set = {k for k in os.environ if k.startswith(("XMLIR_", "BKCL_"))}
        for name in sorted(set(DEFAULT_ENV) | user_set):
            default = f"(unset; configure_env sets {DEFAULT_ENV[name][0]})" if name in DEFAULT_ENV else "(unset)"
            rows.append((name, os.environ.get(name, default)))
        return rows
