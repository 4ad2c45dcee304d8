"""GPU figures in one run: a ~1B Llama trains bf16 on one NVIDIA GPU through LoongForge (megatron-core local vs
Transformer Engine layers, eager vs ``training.compile: regional``, every FP8 recipe the GPU and TE offer) and
through plain megatron-core's own GPT training step on the same shape; tokens/s, MFU and memory to a JSON file.

Run through ``benchmarks/gpu_smoke.sh`` (which checks the machine first) or directly::

    python benchmarks/gpu_smoke.py --out gpu_smoke.json            # every case that applies, ~6 minutes on an H200
    python benchmarks/gpu_smoke.py --cases lf-local-bf16 mcore-local-bf16 --steps 30
    python benchmarks/gpu_smoke.py --dry-run --out dry.json        # CPU: the same code paths on llama-tiny

Cases (:func:`plan`): ``lf-{local,te}-bf16`` and ``lf-{local,te}-bf16-compiled`` (LoongForge's ``train`` API),
``lf-te-fp8-<recipe>`` for each usable recipe (:func:`loongforge_cuda.capability.usable_fp8_recipes`),
``lf-local-fp16`` (megatron's loss scaler) and ``mcore-{local,te}-bf16``: megatron-core's ``GPTModel`` built from
its own layer spec, wrapped in its ``Float16Module`` and ``DistributedDataParallel``, trained by
``get_forward_backward_func`` and ``get_megatron_optimizer`` -- what Megatron-LM's ``pretrain_gpt.py`` runs per
step, without LoongForge. The shape is the same on both sides (``llama3.2-1b``: 16 layers, d2048, GQA 32/8, vocab
128256, tied embeddings; seq 2048, micro-batch 4; the plain side uses unscaled RoPE, which changes no FLOPs). A
case that cannot run here (no TE, a recipe the GPU lacks, the time budget spent) is listed with its reason instead
of a figure.

Every case runs in a fresh child process (``--run``), so compile caches, allocator state and megatron's global
state do not leak between cases; ``--budget-s`` (default 420 s) bounds the whole run, so it finishes within 8
minutes even if a case hangs (each child gets what is left).

Throughput: tokens per second over the steps after ``--warmup`` (the compiled cases compile in those). Model FLOPs
utilisation counts the matmul FLOPs the model needs per trained token -- the layout planner's count
(:func:`loongforge.planner.timing.flops_per_token`, which a run's own ``mfu`` metric uses too): 6 x (parameters used
in matmuls, output layer included, input embedding excluded) + 6 x layers x seq x (query width), the
causal-attention score and value products for forward and backward -- over the GPU's dense bf16 peak (looked up by
name below, or ``--peak-tflops``; the H200's is 989 TFLOP/s). Recompute is off, so no FLOPs are counted twice.

Numerics (``cpu_vs_cuda`` in the JSON, before the cases): ``configs/quickstart.yaml`` (``llama-tiny``, the shipped
corpus, the byte tokenizer, seed 1234) trains fp32 for ``--numerics-steps`` (default 20) on the GPU with megatron's
local layers and on the CPU, each side in its own child process, both at once; the JSON has every step's loss on
both sides, the per-step relative difference ``|cuda - cpu| / |cpu|`` and its maximum, held to
:data:`NUMERICS_TOLERANCE` (1e-4). TF32 is off on the GPU side (``torch.set_float32_matmul_precision("highest")``,
``allow_tf32 = False`` for cuBLAS and cuDNN, ``NVIDIA_TF32_OVERRIDE=0``; neither LoongForge nor megatron-core turns
it on, and the child records the settings before and after training), so both sides multiply in IEEE fp32 and
differ only in summation order and kernels: ~1e-7 per op. Measured on the CPU, a 1e-6 relative perturbation of
the initial weights moves the quickstart's losses by at most 1.0e-6 over 20 steps (a 1e-3 one -- TF32's 10-bit
mantissa -- by 1.1e-3), so 1e-4 leaves a wide margin for fp32 and would fail with TF32 on, as it should.

``--with-tests`` first runs ``pytest -m "not slow" tests/cuda`` (the cuda plugin's suite on the real backend;
the slow test is this script's CPU dry run), bounded by ``--tests-timeout`` and the budget; its counts, failures
and run time go to the JSON's ``tests``. The JSON also records the versions of Python, torch (and its CUDA),
triton, megatron-core, LoongForge, Transformer Engine and flash-attn, and the optional packages that are missing
(``missing_optional``). ``--check`` only checks the machine: every required module (torch with CUDA,
megatron.core, loongforge, loongforge_cuda) and the optional ones, all reported at once (``gpu_smoke.sh`` runs it).

``--dry-run`` runs the same planner, children, runners and JSON writer on the CPU with ``llama-tiny`` at seq 64,
fp32 (megatron-core through LoongForge's CPU patches), 3 steps; TE and FP8 cases are listed as not run, and the
numerics' "cuda" side trains on the CPU too (5 steps), so its difference must be 0. It checks the machinery, not
the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What a bare lent device lacks, and how the next run brings it (also in ``--help`` and the cuda plugin's README).
DEVICE_NOTES = """\
The lent H200 (as found on a loan): Python 3.12 (/opt/torch/.venv/bin/python3) with torch 2.11.0+cu130, triton,
transformers, numpy, pluggy, pyyaml, safetensors, rich, tensorboard, psutil, pytest and pytest-timeout; no
megatron-core, loongforge, importlib-metadata, transformer-engine or flash-attn, and no network. Files reach it only
in the repository's working tree (64 MiB in all). Here: benchmarks/gpu_wheels.sh build/gpu_wheels (megatron-core
cp312, importlib-metadata with zipp and lazy-importer, loongforge-core, loongforge-cuda: 3.7 MiB); there:
benchmarks/gpu_smoke.sh --wheels build/gpu_wheels --with-tests --out OUT.json (carry build/gpu_wheels).
Transformer Engine cannot travel (the transformer_engine_cu13 wheel is 276 MB, transformer_engine_torch and
flash-attn are source-only), so its cases are listed as not run there. Device time is 15 minutes a session, 1-2 of
them the machine's start: the default budget (420 s, ~7.5 minutes with the install and checks) leaves ~5 minutes
for a shorter second try."""

#: Modules the run needs (module, distribution) and the optional ones whose cases are listed as not run without them.
REQUIRED_MODULES = (("torch", "torch"), ("megatron.core", "megatron-core"), ("loongforge", "loongforge-core"),
                    ("loongforge_cuda", "loongforge-cuda"))
OPTIONAL_MODULES = (("transformer_engine", "transformer-engine"), ("flash_attn", "flash-attn"))

#: The numerics case: this config, fp32 with TF32 off, CUDA against CPU, per-step losses held to this relative gap.
NUMERICS_CONFIG = ROOT / "configs" / "quickstart.yaml"
NUMERICS_TOLERANCE = 1e-4

#: ``--with-tests``: the cuda plugin's suite on the real backend (the slow test is this script's CPU dry run).
TESTS_TARGET = "tests/cuda"

#: Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by a substring of ``torch.cuda.get_device_name``.
PEAK_BF16_TFLOPS = (
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("H20", 148.0),
    ("B200", 2250.0), ("GB200", 2500.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
    ("L4", 121.0), ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 6000 Ada", 364.4),
)

#: The keys of every row of the JSON's ``cases`` (a case that did not run has ``status`` and ``reason`` only).
RESULT_KEYS = ("tokens_per_s", "step_ms", "flops_per_token", "tflops", "mfu", "peak_mem_gib", "final_loss",
               "compile_s")


@dataclass(frozen=True)
class Shape:
    model: str
    seq_length: int
    micro_batch_size: int
    precision: str  # what "bf16" cases train in on this device (fp32 on the CPU dry run)


SHAPES = {"gpu": Shape("llama3.2-1b", 2048, 4, "bf16"), "dry-run": Shape("llama-tiny", 64, 2, "fp32")}


@dataclass(frozen=True)
class Case:
    name: str
    runner: str  # "loongforge" or "mcore" (plain megatron-core)
    layers: str  # "local" or "te"
    precision: str  # "bf16", "fp8" or "fp16"
    compile: bool = False
    fp8_recipe: str | None = None


def plan(*, te_classes: frozenset[str], capability: tuple[int, int] | None) -> list[tuple[Case, str | None]]:
    """Every case, most wanted first (the budget may stop the run before the last), each with the reason it cannot
    run here (``None``: it runs). ``capability`` is ``None`` on the CPU dry run."""
    from loongforge_cuda.capability import FP8_RECIPES, usable_fp8_recipes

    no_te = "CPU dry run" if capability is None else (None if te_classes else "transformer-engine is not installed")
    cases: list[tuple[Case, str | None]] = []
    for layers in ("local", "te"):
        missing = no_te if layers == "te" else None
        cases += [(Case(f"lf-{layers}-bf16", "loongforge", layers, "bf16"), missing),
                  (Case(f"mcore-{layers}-bf16", "mcore", layers, "bf16"), missing)]
    usable = usable_fp8_recipes(capability, te_classes) if capability is not None else []
    for recipe, (minimum, cls) in FP8_RECIPES.items():
        if no_te:
            reason = no_te
        elif recipe not in usable:
            reason = (f"needs compute capability {minimum[0]}.{minimum[1]}+" if capability < minimum
                      else f"Transformer Engine lacks {cls}")
        else:
            reason = None
        cases.append((Case(f"lf-te-fp8-{recipe}", "loongforge", "te", "fp8", fp8_recipe=recipe), reason))
    for layers in ("te", "local"):
        cases.append((Case(f"lf-{layers}-bf16-compiled", "loongforge", layers, "bf16", compile=True),
                      no_te if layers == "te" else None))
    # fp16 parameters with megatron's dynamic loss scaler: the final loss shows that scaling works (CPUs refuse fp16)
    cases.append((Case("lf-local-fp16", "loongforge", "local", "fp16"), "CPU dry run" if capability is None else None))
    return cases


def _peak_mem_gib(device: str) -> float:
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak RSS (KiB on Linux)


def run_loongforge(case: Case, shape: Shape, device: str, steps: int, warmup: int) -> dict:
    """``case`` through LoongForge's public train API; throughput from the per-step metrics after ``warmup``."""
    from loongforge.config import load_config
    from loongforge.train.run import run_training

    precision = shape.precision if case.precision == "bf16" else case.precision
    options = {"layers": case.layers, **({"fp8_recipe": case.fp8_recipe} if case.fp8_recipe else {})}
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"device={device}", f"model.name={shape.model}", f"run.output_dir={out}", "run.seed=1",
            "data.dataset=shipped-corpus", "data.tokenizer=byte", f"data.seq_length={shape.seq_length}",
            f"training.micro_batch_size={shape.micro_batch_size}", f"training.steps={steps}",
            f"training.precision={precision}", f"training.compile={'regional' if case.compile else 'false'}",
            "checkpoint.save_at_end=false", "checkpoint.interval=0", "logging.progress=false",
            "logging.tensorboard=false", "logging.interval=1",
        ]
        if device == "cuda":  # the CPU backend takes no device options (it has local layers only)
            overrides.append("device_options={" + ", ".join(f"{k}: {v}" for k, v in options.items()) + "}")
        config = load_config(None, overrides)
        summary = run_training(config)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    step_s = [row["step_time"] for row in rows if "step_time" in row][warmup:]
    return {"step_ms": statistics.median(step_s) * 1e3, "final_loss": summary.get("final_loss"),
            "compile_s": summary.get("compile_s", 0.0)}


def run_mcore(case: Case, shape: Shape, device: str, steps: int, warmup: int) -> dict:
    """Plain megatron-core's GPT training step on ``shape`` (random token ids; the speed does not depend on them)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from loongforge.models.llama import FLAVORS

    if device == "cpu":  # megatron-core needs CUDA; LoongForge's CPU patches stand in for it in the dry run
        from loongforge.devices.cpu import CPUBackend

        CPUBackend().apply_patches()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    flavor = FLAVORS[shape.model]
    bf16 = shape.precision == "bf16"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=flavor.num_layers, hidden_size=flavor.hidden_size, ffn_hidden_size=flavor.ffn_hidden_size,
        num_attention_heads=flavor.num_attention_heads, num_query_groups=flavor.num_query_groups,
        normalization="RMSNorm", layernorm_epsilon=flavor.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32, bias_activation_fusion=device == "cuda",
        masked_softmax_fusion=device == "cuda", persist_layer_norm=device == "cuda",
        bias_dropout_fusion=device == "cuda", apply_rope_fusion=device == "cuda", attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=device == "cpu",
    )
    spec = (get_gpt_layer_with_transformer_engine_spec() if case.layers == "te"
            else get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = GPTModel(config, spec, vocab_size=flavor.vocab_size, max_sequence_length=shape.seq_length,
                     position_embedding_type="rope", rotary_base=int(flavor.rope_theta),
                     share_embeddings_and_output_weights=flavor.tie_word_embeddings)
    if device == "cuda":
        model.cuda()
    if bf16:
        model = Float16Module(config, model)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-4, weight_decay=0.1, clip_grad=1.0, bf16=bf16,
                        params_dtype=config.params_dtype), [model])
    seq, mbs = shape.seq_length, shape.micro_batch_size
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, -1)

    def forward_step(data_iterator, model):
        sample = next(data_iterator).to(device)
        per_token = model(sample[:, :-1], positions, None, labels=sample[:, 1:])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return per_token, loss_func

    times, loss = [], None
    for _ in range(steps):
        batch = [torch.randint(0, flavor.vocab_size, (mbs, seq + 1), generator=generator)]
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batch), model=[model], num_microbatches=1,
            seq_length=seq, micro_batch_size=mbs, forward_only=False)
        optimizer.step()
        loss = float(losses[0]["loss"])
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"step_ms": statistics.median(times[warmup:]) * 1e3, "final_loss": loss, "compile_s": 0.0}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _row(case: Case, **fields) -> dict:
    """One entry of the JSON's ``cases``: the case's settings, then its status and figures (or reason)."""
    settings = asdict(case)
    return {"case": settings.pop("name"), **settings, **fields}


def run_case(case: Case, shape: Shape, device: str, steps: int, warmup: int) -> dict:
    """One case in this (child) process: its figures, FLOPs and memory included."""
    from loongforge.models.llama import FLAVORS
    from loongforge.planner.memory import Workload
    from loongforge.planner.timing import flops_per_token

    runner = run_loongforge if case.runner == "loongforge" else run_mcore
    figures = runner(case, shape, device, steps, warmup)
    flops = flops_per_token(Workload(FLAVORS[shape.model], shape.seq_length))[0]  # the runs' own mfu count
    tokens_per_s = shape.seq_length * shape.micro_batch_size / (figures["step_ms"] / 1e3)
    return {**figures, "tokens_per_s": tokens_per_s, "flops_per_token": flops,
            "tflops": tokens_per_s * flops / 1e12, "peak_mem_gib": _peak_mem_gib(device)}


def probe(module: str, dist: str) -> tuple[str | None, str | None]:
    """``(version, None)`` when ``module`` imports, else ``(None, why not)``."""
    import importlib
    from importlib import metadata

    try:
        with warnings.catch_warnings():  # megatron warns at import that TE and Apex are missing: said below
            warnings.simplefilter("ignore")
            imported = importlib.import_module(module)
    except ImportError as exc:
        absent = exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))
        return None, "not installed" if absent else f"installed, but its import fails: {exc}"
    except Exception as exc:  # a broken build (a CUDA library or symbol missing) raises other errors too
        return None, f"installed, but its import fails: {type(exc).__name__}: {exc}"
    try:
        return metadata.version(dist), None
    except metadata.PackageNotFoundError:
        return str(getattr(imported, "__version__", "unknown")), None


def machine_report(required=REQUIRED_MODULES, optional=OPTIONAL_MODULES) -> dict:
    """Versions of everything the run uses, what is missing (all of it, not the first), and whether torch sees CUDA.
    ``problems`` are the messages that stop ``--check`` (and ``gpu_smoke.sh``); missing optional modules only name
    the cases that will be listed as not run."""
    import platform
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    problems, missing_optional = [], {}
    for module, dist in required:
        version, why = probe(module, dist)
        versions[dist] = version
        if why == "not installed":
            problems.append(f"gpu_smoke: {module} is not installed in {sys.executable} (see the header of "
                            "benchmarks/gpu_smoke.sh)")
        elif why:
            problems.append(f"gpu_smoke: {module} is {why}")
    for module, dist in optional:
        version, why = probe(module, dist)
        versions[dist] = version
        if why:
            missing_optional[dist] = why
    try:
        versions["triton"] = metadata.version("triton")
    except metadata.PackageNotFoundError:
        versions["triton"] = None
    cuda = {"available": False}
    if "torch" in sys.modules:
        import torch

        versions["torch_cuda"] = torch.version.cuda
        cuda["available"] = torch.cuda.is_available()
        if cuda["available"]:
            cuda |= {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
        elif versions.get("torch"):
            problems.append(f"gpu_smoke: torch {torch.__version__} sees no CUDA device (a CPU build of torch?)")
    return {"versions": versions, "cuda": cuda, "missing_optional": missing_optional, "problems": problems}


def check(report: dict) -> int:
    """Print ``machine_report``'s findings for a person; 1 when anything required is missing."""
    versions = report["versions"]
    found = [f"{name} {version}" for name, version in versions.items() if version is not None]
    print("gpu_smoke: " + ", ".join(found) + (f", GPU {report['cuda']['device']}" if report["cuda"]["available"]
                                              else ""))
    if report["missing_optional"]:
        names = ", ".join(f"{dist} ({why})" for dist, why in report["missing_optional"].items())
        print(f"gpu_smoke: optional, missing: {names}: those cases will be listed as not run")
    for problem in report["problems"]:
        print(problem, file=sys.stderr)
    return 1 if report["problems"] else 0


def _fp32_matmuls() -> dict:
    """IEEE fp32 matmuls (TF32 off) in this process; the settings as torch reports them."""
    import torch

    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return _matmul_settings()


def _matmul_settings() -> dict:
    """torch's TF32 switches, the legacy ones and (torch 2.9+) ``fp32_precision``; one torch refuses to read cannot
    stop the run (some versions raise when the legacy and the new switches were both used)."""
    import torch

    readers = {
        "float32_matmul_precision": torch.get_float32_matmul_precision,
        "cuda_matmul_allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
        "cuda_matmul_fp32_precision": lambda: getattr(torch.backends.cuda.matmul, "fp32_precision", None),
        "cudnn_fp32_precision": lambda: getattr(torch.backends.cudnn, "fp32_precision", None),
    }
    settings: dict = {}
    for name, read in readers.items():
        try:
            settings[name] = read()
        except Exception as exc:  # recorded instead
            settings[name] = f"unreadable: {exc}"[:200]
    return settings | {"NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE")}


def run_numerics_side(device: str, steps: int) -> dict:
    """One side of the numerics case in this (child) process: the quickstart, fp32, every step's loss."""
    from loongforge.config import load_config
    from loongforge.train.run import run_training

    before = _fp32_matmuls()
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"device={device}", f"run.output_dir={out}", f"training.steps={steps}", "training.precision=fp32",
            "training.sample_tokens=0", "checkpoint.save_at_end=false", "checkpoint.interval=0",
            "logging.progress=false", "logging.tensorboard=false", "logging.interval=1",
        ]
        if device == "cuda":  # the CPU has megatron's local layers only; the GPU side uses them too
            overrides.append("device_options={layers: local}")
        config = load_config(str(NUMERICS_CONFIG), overrides)
        summary = run_training(config)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row and "step" in row}
    return {"device": device, "model": config.model.name, "seed": config.run.seed,
            "losses": [losses[step] for step in sorted(losses)], "final_loss": summary.get("final_loss"),
            "matmul_before": before, "matmul_after": _matmul_settings()}


def compare_losses(cuda: list[float], cpu: list[float], tolerance: float = NUMERICS_TOLERANCE) -> dict:
    """Per-step ``|cuda - cpu| / |cpu|``, its maximum, and whether every step is within ``tolerance``."""
    if len(cuda) != len(cpu) or not cpu:
        return {"rel_diff": [], "max_rel_diff": None, "within_tolerance": False,
                "reason": f"{len(cuda)} losses on the cuda side, {len(cpu)} on the cpu side"}
    rel = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(cuda, cpu, strict=True)]
    finite = all(math.isfinite(value) for value in rel)
    return {"rel_diff": rel, "max_rel_diff": max(rel) if finite else None,
            "within_tolerance": finite and max(rel) <= tolerance}


def run_numerics(steps: int, dry_run: bool, deadline: float, budget_s: float) -> dict:
    """The numerics case: a CUDA child and a CPU child (in the dry run both on the CPU) at once, then the comparison.
    A side that fails or outlives the budget makes the block ``failed``, never the run."""
    block = {"config": str(NUMERICS_CONFIG.relative_to(ROOT)), "precision": "fp32", "tf32": False, "steps": steps,
             "tolerance_rel": NUMERICS_TOLERANCE, "cuda_side_device": "cpu (dry run)" if dry_run else "cuda"}
    if deadline - time.monotonic() < 10:
        return {**block, "status": "not run", "reason": f"time budget of {budget_s:.0f} s spent"}
    print(f"cpu-vs-cuda: training the quickstart fp32 for {steps} steps on both sides ...", flush=True)
    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0"}
    sides = {"cuda": "cpu" if dry_run else "cuda", "cpu": "cpu"}
    children, logs = {}, {}
    for side, device in sides.items():
        logs[side] = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
        children[side] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--numerics", device, "--numerics-steps", str(steps)],
            stdout=logs[side][0], stderr=logs[side][1], text=True, env=env)
    results, errors = {}, {}
    for side, child in children.items():
        try:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            errors[side] = f"stopped at the time budget of {budget_s:.0f} s"
        stdout, stderr = (_read(log) for log in logs[side])
        found = [line[7:] for line in stdout.splitlines() if line.startswith("RESULT ")]
        if side not in errors and (child.returncode or not found):
            print(f"cpu-vs-cuda ({side} side): FAILED\n{stderr[-3000:]}", flush=True)
            errors[side] = (stderr.strip().splitlines() or ["no output"])[-1]
        elif found:
            results[side] = json.loads(found[0])
    if errors:
        return {**block, "status": "failed", "reason": "; ".join(f"{side} side: {why}" for side, why in errors.items())}
    cuda, cpu = results["cuda"], results["cpu"]
    comparison = compare_losses(cuda["losses"], cpu["losses"])
    status = "ok" if comparison["within_tolerance"] else "out of tolerance"
    after = cuda["matmul_after"]  # what the GPU side multiplied in, read back after training
    block["tf32"] = (after["cuda_matmul_allow_tf32"] is True or after["float32_matmul_precision"] != "highest"
                     or after["cuda_matmul_fp32_precision"] == "tf32")
    print(f"cpu-vs-cuda: max relative loss difference {comparison['max_rel_diff']} over {steps} steps "
          f"(tolerance {NUMERICS_TOLERANCE:g}): {status}", flush=True)
    return {**block, "status": status, "model": cpu["model"], "seed": cpu["seed"], **comparison,
            "final_loss": {"cuda": cuda["final_loss"], "cpu": cpu["final_loss"]},
            "losses": {"cuda": cuda["losses"], "cpu": cpu["losses"]},
            "matmul": {"cuda": {"before": cuda["matmul_before"], "after": cuda["matmul_after"]},
                       "cpu": {"before": cpu["matmul_before"], "after": cpu["matmul_after"]}}}


def _read(handle) -> str:
    handle.seek(0)
    text = handle.read()
    handle.close()
    return text


def summarise_junit(path: Path) -> dict:
    """Counts and failed test ids from pytest's ``--junitxml`` file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if "failure" in kinds:
            counts["failed"] += 1
            failures.append(test_id)
        elif "error" in kinds:
            counts["errors"] += 1
            failures.append(test_id)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def run_tests(target: str, timeout: float) -> dict:
    """``pytest -m "not slow" target`` in a child bounded by ``timeout``; never raises."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                   f"--junitxml={junit}", target]
        block = {"command": f"pytest -q -m 'not slow' {target}", "timeout_s": round(timeout)}
        start = time.monotonic()
        try:
            child = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return {**block, "status": "timed out", "seconds": round(time.monotonic() - start, 1),
                    "tail": out[-2000:]}
        block["seconds"] = round(time.monotonic() - start, 1)
        if not junit.exists():
            return {**block, "status": "error", "returncode": child.returncode,
                    "tail": (child.stdout + child.stderr)[-2000:]}
        summary = summarise_junit(junit)
    status = "passed" if child.returncode == 0 else ("failed" if summary["failed"] or summary["errors"] else "error")
    block |= {"status": status, "returncode": child.returncode, **summary}
    if status != "passed":
        block["tail"] = (child.stdout + child.stderr)[-2000:]
    print(f"tests: {target}: {status} ({summary['passed']} passed, {summary['failed']} failed, {summary['errors']} "
          f"errors, {summary['skipped']} skipped in {block['seconds']} s)", flush=True)
    return block


def peak_tflops(gpu: str, override: float | None) -> float | None:
    if override:
        return override
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in gpu), None)


def _machine(dry_run: bool) -> tuple[str, str, frozenset[str], tuple[int, int] | None]:
    """(device, its name, TE's recipe classes, compute capability; ``None`` on the CPU)."""
    import torch
    from loongforge_cuda.capability import te_recipe_classes

    if dry_run:
        return "cpu", "cpu (dry run)", frozenset(), None
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke: torch sees no CUDA device; use --dry-run to check the script on the CPU")
    return "cuda", torch.cuda.get_device_name(), te_recipe_classes(), torch.cuda.get_device_capability()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0], epilog=DEVICE_NOTES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="steps per case (default 20; 3 with --dry-run)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 5; 1)")
    parser.add_argument("--cases", nargs="*", default=None, help="names of cases to run (default: all)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of this GPU")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="wall-clock bound of the whole run, tests and numerics included (default 420)")
    parser.add_argument("--numerics-steps", type=int, default=None,
                        help="steps of the quickstart's CUDA vs CPU fp32 comparison (default 20; 5 with --dry-run; "
                             "0 skips it)")
    parser.add_argument("--with-tests", action="store_true",
                        help=f"first run pytest -m 'not slow' {TESTS_TARGET} (bounded by --tests-timeout)")
    parser.add_argument("--tests-timeout", type=float, default=150.0, help="bound of --with-tests (default 150 s)")
    parser.add_argument("--check", action="store_true",
                        help="only check this machine: every missing module at once, exit 1 if a required one is")
    parser.add_argument("--dry-run", action="store_true", help="CPU, llama-tiny: check the machinery")
    parser.add_argument("--out", type=Path, default=Path("gpu_smoke.json"))
    parser.add_argument("--run", help=argparse.SUPPRESS)  # child mode: a Case as JSON
    parser.add_argument("--numerics", help=argparse.SUPPRESS)  # child mode: one side of the numerics case
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.dry_run else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 5)
    numerics_steps = args.numerics_steps if args.numerics_steps is not None else (5 if args.dry_run else 20)
    shape = SHAPES["dry-run" if args.dry_run else "gpu"]
    if args.check:
        return check(machine_report())
    if args.numerics:
        print("RESULT " + json.dumps(run_numerics_side(args.numerics, numerics_steps)))
        return 0
    if args.run:
        case = Case(**json.loads(args.run))
        print("RESULT " + json.dumps(run_case(case, shape, "cpu" if args.dry_run else "cuda", steps, warmup)))
        return 0

    deadline = time.monotonic() + args.budget_s
    machine = machine_report()
    device, gpu, te_classes, capability = _machine(args.dry_run)
    planned = plan(te_classes=te_classes, capability=capability)
    if args.cases is not None:
        unknown = set(args.cases) - {case.name for case, _ in planned}
        if unknown:
            sys.exit(f"gpu_smoke: unknown case(s) {', '.join(sorted(unknown))}; known: "
                     f"{', '.join(case.name for case, _ in planned)}")
        planned = [(case, reason) for case, reason in planned if case.name in args.cases]
    peak = None if args.dry_run else peak_tflops(gpu, args.peak_tflops)
    tests = None
    if args.with_tests:  # neither the tests nor the numerics can stop the cases, whatever goes wrong in them
        print(f"tests: pytest -m 'not slow' {TESTS_TARGET} ...", flush=True)
        try:
            tests = run_tests(TESTS_TARGET, min(args.tests_timeout, deadline - time.monotonic()))
        except Exception as exc:
            tests = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    try:
        numerics = (run_numerics(numerics_steps, args.dry_run, deadline, args.budget_s) if numerics_steps > 0
                    else {"status": "not run", "reason": "--numerics-steps 0"})
    except Exception as exc:
        numerics = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    rows = []
    for case, reason in planned:
        left = deadline - time.monotonic()
        if reason is None and left < 10:
            reason = f"time budget of {args.budget_s:.0f} s spent"
        if reason is not None:
            print(f"{case.name}: not run ({reason})", flush=True)
            rows.append(_row(case, status="not run", reason=reason))
            continue
        print(f"{case.name}: training {steps} steps ...", flush=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--run", json.dumps(asdict(case)),
                   "--steps", str(steps), "--warmup", str(warmup), *(["--dry-run"] if args.dry_run else [])]
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            rows.append(_row(case, status="failed", reason=f"stopped at the time budget of {args.budget_s:.0f} s"))
            continue
        results = [line[7:] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if child.returncode or not results:
            print(f"{case.name}: FAILED\n{child.stderr[-3000:]}", flush=True)
            rows.append(_row(case, status="failed", reason=(child.stderr.strip().splitlines() or ["no output"])[-1]))
            continue
        figures = json.loads(results[0])
        figures["mfu"] = figures["tflops"] / peak if peak else None
        rows.append(_row(case, status="ok", **figures))

    report = {"gpu": gpu, "device": device, "dry_run": args.dry_run, "shape": asdict(shape), "steps": steps,
              "warmup": warmup, "peak_bf16_tflops": peak, "budget_s": args.budget_s,
              "versions": machine["versions"], "missing_optional": machine["missing_optional"],
              "tests": tests, "cpu_vs_cuda": numerics, "cases": rows, "ratios": ratios(rows)}
    args.out.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"\nwrote {args.out}")
    failed = any(row["status"] == "failed" for row in rows) or numerics["status"] in ("failed", "out of tolerance")
    return 1 if failed or (tests is not None and tests["status"] != "passed") else 0


def ratios(rows: list[dict]) -> dict[str, float]:
    """Throughput ratios the issue asks for, where both sides ran: LoongForge over plain megatron-core (same
    layers), compiled over eager, TE over local, each FP8 recipe over TE bf16."""
    speed = {row["case"]: row["tokens_per_s"] for row in rows if row["status"] == "ok"}
    pairs = {f"lf-{layers}-bf16 / mcore-{layers}-bf16": (f"lf-{layers}-bf16", f"mcore-{layers}-bf16")
             for layers in ("local", "te")}
    pairs |= {f"lf-{layers}-bf16-compiled / lf-{layers}-bf16": (f"lf-{layers}-bf16-compiled", f"lf-{layers}-bf16")
              for layers in ("local", "te")}
    pairs["lf-te-bf16 / lf-local-bf16"] = ("lf-te-bf16", "lf-local-bf16")
    pairs |= {f"{name} / lf-te-bf16": (name, "lf-te-bf16") for name in speed if name.startswith("lf-te-fp8-")}
    return {label: speed[a] / speed[b] for label, (a, b) in pairs.items() if a in speed and b in speed}


def print_table(report: dict) -> None:
    print(f"\n{'case':<26} {'tokens/s':>12} {'step ms':>9} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} "
          f"{'compile s':>9} {'final loss':>10}")
    for row in report["cases"]:
        if row["status"] != "ok":
            print(f"{row['case']:<26} {row['status']}: {row['reason']}")
            continue
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        loss = f"{row['final_loss']:.3f}" if row.get("final_loss") is not None else "-"
        print(f"{row['case']:<26} {row['tokens_per_s']:>12,.0f} {row['step_ms']:>9.1f} {row['tflops']:>9.2f} "
              f"{mfu:>7} {row['peak_mem_gib']:>9.2f} {row['compile_s']:>9.1f} {loss:>10}")
    for label, value in report["ratios"].items():
        print(f"{label}: {value:.3f}")
    numerics = report["cpu_vs_cuda"]
    if numerics["status"] in ("ok", "out of tolerance"):
        gap = numerics["max_rel_diff"]
        final = numerics["final_loss"]
        print(f"cpu vs cuda, fp32 quickstart, {numerics['steps']} steps: max relative loss difference "
              f"{'not finite' if gap is None else f'{gap:.2e}'} (tolerance {numerics['tolerance_rel']:g}), final loss "
              f"{final['cuda']} (cuda) / {final['cpu']} (cpu): {numerics['status']}")
    else:
        print(f"cpu vs cuda: {numerics['status']} ({numerics['reason']})")
    if report["tests"] is not None:
        tests = report["tests"]
        print(f"tests: {tests['status']}" + (f" ({tests['passed']} passed, {tests['failed']} failed, "
                                              f"{tests['errors']} errors, {tests['skipped']} skipped)"
                                              if "passed" in tests else ""))
    if report["missing_optional"]:
        print("optional, missing: " + ", ".join(report["missing_optional"]))
    print(f"\n{report['gpu']}; MFU against a dense bf16 peak of "
          f"{report['peak_bf16_tflops'] or 'unknown (pass --peak-tflops)'} TFLOP/s")


if __name__ == "__main__":
    sys.exit(main())
