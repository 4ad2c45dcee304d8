"""Targeted patches that let megatron-core train on CPU under gloo.

megatron-core assumes CUDA in places that have nothing to do with the math: device queries, ``device="cuda"``
literals, streams, the CUDA RNG, and dtype checks by CUDA type name. Each patch below fixes one such
assumption where megatron looks the name up, so the rest of megatron runs unmodified:

* :func:`~loongforge.devices.megatron_cpu.modules.install_torch_views` -- the modules in
  :data:`~loongforge.devices.megatron_cpu.modules.CUDA_ASSUMING_MODULES` see a CPU view of ``torch``
  (``torch.cuda.current_device()`` -> ``"cpu"``, ``device="cuda"`` -> ``"cpu"``, no-op streams/synchronize).
* :func:`~loongforge.devices.megatron_cpu.rng.patch_rng_tracker` -- the RNG tracker keeps CPU generator states.
* :func:`~loongforge.devices.megatron_cpu.optimizer.patch_optimizer_type_checks` -- optimizer constructors
  accept CPU parameters.
* :func:`~loongforge.devices.megatron_cpu.optimizer.patch_clip_grads` -- gradient clipping without the CUDA
  type assertion.
* :func:`~loongforge.devices.megatron_cpu.moe.patch_router_gemm` -- the MoE router without Transformer Engine.
* :func:`~loongforge.devices.megatron_cpu.moe.patch_alltoall_splits` -- the MoE alltoall dispatcher's split
  sizes as host sequences for gloo.
* :func:`~loongforge.devices.megatron_cpu.rope_cp.patch_rope_cp_slice` -- RoPE's per-rank slice under context
  parallelism (megatron moves its index with ``.cuda()``).
* :func:`~loongforge.devices.megatron_cpu.rope.patch_rope_kernel` -- RoPE in one pass each way (megatron's
  unfused path is six kernels and a copy per call; TE's fused RoPE replaces it on GPU).
* :func:`~loongforge.devices.megatron_cpu.swiglu.patch_swiglu_kernel` -- megatron's fused-SwiGLU entry point
  without ``torch.compile`` (two kernels each way, no gradient ``cat``; megatron's compiled kernel on GPU).
* :func:`~loongforge.devices.megatron_cpu.fusion_helpers.run_fusion_helpers_eagerly` -- megatron's
  ``jit_fuser`` helpers (router bias, dispatch preprocessing, norms) as written instead of compiled by Inductor
  at each process's first forward (~6.5 s of CPU per MoE process).
* :func:`~loongforge.devices.megatron_cpu.gemm.patch_linear_gemm` -- the local linear layers on oneDNN's GEMM
  where a probe finds it faster than torch's MKL ``mm`` (AMD hosts: ~25% on the layers' products).
* :func:`~loongforge.devices.megatron_cpu.tp_regions.patch_single_rank_crossings` -- the tensor-parallel region
  crossings as plain identities on a one-rank group (no autograd node; keeps compiled layers in AOTAutograd's
  cache).
* :func:`~loongforge.devices.megatron_cpu.embedding.patch_tied_embedding_setup` -- tied embeddings at PP > 1
  (the construction-time all-reduce of the two copies).
* :func:`~loongforge.devices.megatron_cpu.mla.patch_mla_te_flag` -- multi-latent attention (DeepSeek-V2/V3)
  without Transformer Engine (megatron's MLA module believes TE is present when only its mock is, and its
  ``isinstance(..., TELinear)`` check then raises).

Checked against megatron-core 0.16.1 (what Python 3.11 resolves ``megatron-core>=0.15`` to): GPTModel with
the local spec at TP=1, TP=2, TP=2 + sequence parallel and PP=2 (gloo, torchrun), DistributedDataParallel,
``get_megatron_optimizer`` (Adam, fp32 and bf16, with and without the distributed optimizer), gradient
clipping, ``OptimizerParamScheduler``, MoE (ep=1/2, both dispatchers, tp=2 + etp=1 + ep=2), and
``dist_checkpointing`` save/load of the model and the
(non-distributed) optimizer state, and ``MLASelfAttention`` built from the CPU spec provider (against
transformers' ``DeepseekV3Attention``, and at cp=2 against one rank: ``tests/core/test_cpu_mla.py``).

Importing this package is cheap; the patches import torch and megatron when applied.
"""

from __future__ import annotations

_applied = False


def apply_megatron_cpu_patches() -> None:
    """Apply every CPU patch once (idempotent); call before building megatron models or optimizers."""
    global _applied
    if _applied:
        return
    from loongforge.devices.megatron_cpu.embedding import patch_tied_embedding_setup
    from loongforge.devices.megatron_cpu.fusion_helpers import run_fusion_helpers_eagerly
    from loongforge.devices.megatron_cpu.gemm import patch_linear_gemm
    from loongforge.devices.megatron_cpu.mla import patch_mla_te_flag
    from loongforge.devices.megatron_cpu.modules import install_torch_views
    from loongforge.devices.megatron_cpu.moe import patch_alltoall_splits, patch_router_gemm
    from loongforge.devices.megatron_cpu.optimizer import patch_clip_grads, patch_optimizer_type_checks
    from loongforge.devices.megatron_cpu.rng import patch_rng_tracker
    from loongforge.devices.megatron_cpu.rope import patch_rope_kernel
    from loongforge.devices.megatron_cpu.rope_cp import patch_rope_cp_slice
    from loongforge.devices.megatron_cpu.swiglu import patch_swiglu_kernel
    from loongforge.devices.megatron_cpu.tp_regions import patch_single_rank_crossings

    install_torch_views()
    patch_rng_tracker()
    patch_optimizer_type_checks()
    patch_clip_grads()
    patch_router_gemm()
    patch_alltoall_splits()
    patch_tied_embedding_setup()
    patch_mla_te_flag()
    patch_rope_cp_slice()
    patch_rope_kernel()
    patch_swiglu_kernel()
    run_fusion_helpers_eagerly()
    patch_linear_gemm()
    patch_single_rank_crossings()
    _applied = True
