"""Which megatron-core modules see the CPU view of ``torch`` (see :mod:`.torch_view`), and installing it.

Each entry was found by running the paths LoongForge uses on CPU (GPTModel forward/backward at TP/SP/PP,
DDP, the megatron optimizers, clipping, dist_checkpointing) or by reading the module for
``torch.cuda.*``/``device="cuda"`` on those paths. The comment says which CUDA assumption the module makes.
"""

from __future__ import annotations

import importlib

CUDA_ASSUMING_MODULES: tuple[str, ...] = (
    # GlobalMemoryBuffer allocates on torch.cuda.current_device(); local_multi_tensor_l2_norm returns a
    # device="cuda" tensor (used by grad-norm computation without Apex/TE).
    "megatron.core.utils",
    # barriers call torch.cuda.synchronize().
    "megatron.core.parallel_state",
    # CudaRNGStatesTracker.add / model_parallel_cuda_manual_seed use torch.cuda RNG calls.
    "megatron.core.tensor_parallel.random",
    # weight allocation on torch.cuda.current_device() (GPU init path) and SP all-gather buffers.
    "megatron.core.tensor_parallel.layers",
    # TP/SP gather/scatter output buffers on torch.cuda.current_device().
    "megatron.core.tensor_parallel.mappings",
    # broadcast_data (TP data broadcast) sizes/buffers with device="cuda" / current_device().
    "megatron.core.tensor_parallel.data",
    # split/gather helpers allocate on torch.cuda.current_device().
    "megatron.core.tensor_parallel.utils",
    # get_default_causal_mask (used by megatron's own DotProductAttention) builds its mask with device="cuda".
    "megatron.core.transformer.utils",
    # megatron's DotProductAttention: off-by-one/learnable softmax offsets on torch.cuda.current_device().
    "megatron.core.transformer.dot_product_attention",
    # torch.cuda.empty_cache() when retrying an out-of-memory MLP chunk.
    "megatron.core.transformer.mlp",
    # num-token counters with device="cuda"; autocast("cuda") when enable_autocast.
    "megatron.core.pipeline_parallel.schedules",
    # PP send/recv buffers on torch.cuda.current_device(); torch.cuda.synchronize() after batched p2p.
    "megatron.core.pipeline_parallel.p2p_communication",
    # grad-norm and zero-count accumulators with device="cuda".
    "megatron.core.optimizer.clip_grads",
    # found_inf / scale tensors with device="cuda"; torch.cuda.empty_cache().
    "megatron.core.optimizer.optimizer",
    # loss-scale tensors with device="cuda" (fp16).
    "megatron.core.optimizer.grad_scaler",
    # gather buffers on torch.cuda.current_device().
    "megatron.core.optimizer.distrib_optimizer",
    # validation/result tensors with device="cuda", torch.cuda RNG state capture.
    "megatron.core.rerun_state_machine",
    # torch.cuda.Stream for overlapped grad reduction; torch.cuda.synchronize().
    "megatron.core.distributed.distributed_data_parallel",
    # communication stream context, warm-up tensor with device="cuda", buffers on current_device().
    "megatron.core.distributed.param_and_grad_buffer",
    # inference/cp buffers on torch.cuda.current_device().
    "megatron.core.transformer.attention",
    # offloading/cuda-graph helper tensors on torch.cuda.current_device().
    "megatron.core.transformer.transformer_layer",
    # Float16Module / cuda-graph helpers allocate on torch.cuda.current_device().
    "megatron.core.transformer.module",
    # MTP / inference tensors on torch.cuda.current_device().
    "megatron.core.models.gpt.gpt_model",
    # the multi-token-prediction loss tracker allocates on torch.cuda.current_device().
    "megatron.core.transformer.multi_token_prediction",
    # inv_freq on torch.cuda.current_device() unless use_cpu_initialization.
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    # dist_checkpointing: shard exchange buffers with device="cuda", torch.cuda.synchronize(),
    # verification tensors with device="cuda".
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    # MoE: router/expert buffers on current_device(), side streams in shared experts and the a2a dispatcher.
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
)


def install_torch_views(module_names: tuple[str, ...] = CUDA_ASSUMING_MODULES) -> list[str]:
    """Rebind ``torch`` to the CPU view in each module that exists in this megatron version.

    Returns the names that were patched; modules absent from an older or newer megatron are skipped, since
    a missing module cannot make CUDA assumptions.
    """
    from loongforge.devices.megatron_cpu.torch_view import install_torch_cpu_view, make_torch_cpu_view

    view = make_torch_cpu_view()
    patched = []
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if install_torch_cpu_view(module, view):
            patched.append(name)
    return patched
