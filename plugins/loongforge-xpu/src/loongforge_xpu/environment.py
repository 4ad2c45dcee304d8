"""Default XMLIR/BKCL environment for Kunlunxin P800 training, applied with ``os.environ.setdefault`` only.

The values are the ones every P800 training script in the reference LoongForge repository exports
(baidu-baige/LoongForge, ``docs/source/kunlun_tutorial/quick_start_llm_pretrain_p800.md`` and
``quick_start_llm_sft_p800.md``), minus the machine-specific ones (``BKCL_RDMA_NICS``,
``BKCL_SOCKET_IFNAME``, ``BKCL_RDMA_VERBS``/``BKCL_QPS_PER_CONNECTION`` for Hygon hosts, log paths), which
depend on the host's network cards and are documented in the plugin README instead. torch_xmlir and BKCL
read these when they initialise, so they must be set before ``torch_xmlir`` is imported and before the
process group is created -- which is when the trainer calls ``configure_env``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: name -> (default, why). The comments of the reference scripts, condensed.
DEFAULT_ENV: dict[str, tuple[str, str]] = {
    "CUDA_DEVICE_MAX_CONNECTIONS": ("1", "one hardware queue keeps communication/compute overlap ordered"),
    "XMLIR_MEGATRON_CORE_XPU_PLUGIN": ("1", "enable Kunlun's megatron-core patches (xpu_plugin); recommended"),
    "XMLIR_ENABLE_FAST_FC": ("true", "fast bf16 linear kernels (torch.nn.Linear and fused variants)"),
    "XMLIR_ENABLE_FAST_FC_FWD_OUT": ("true", "fast FC for the forward output"),
    "XMLIR_ENABLE_FAST_FC_BWD_DW": ("true", "fast FC for the weight gradient"),
    "XMLIR_ENABLE_FAST_FC_BWD_DX": ("true", "fast FC for the input gradient"),
    "XMLIR_ENABLE_LINEAR_FC_FUSION": ("1", "let linear layers bypass xblas FC fusion where addmm is faster"),
    "XMLIR_DIST_ASYNC_ISEND_IRECV": ("true", "asynchronous send/recv for pipeline parallelism"),
    "XMLIR_PARALLEL_SAVE_MEMORY": ("false", "favour speed over memory in parallel layers"),
    "XMLIR_BATCH_PARALLEL": ("false", "no communication-fusion operators (they disable cast-FC fusion in bf16)"),
    "BKCL_TREE_THRESHOLD": ("0", "BKCL collective algorithm threshold used by the reference scripts"),
    "BKCL_FORCE_L3_RDMA": ("0", "1 can run out of L3 memory"),
    "BKCL_ENABLE_XDR": ("1", "enable the XDR transport"),
    "BKCL_ALL_TO_ALL_OPT": ("1", "optimised multi-node all-to-all (MoE expert parallelism)"),
    "BKCL_RING_HOSTID_USE_RANK": ("1", "ring host ids by rank (BKCL 1.2.11+)"),
}


def apply_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each default that is not already set; return the ones this call set (for the run log)."""
    env = os.environ if environ is None else environ
    added = {}
    for name, (value, _why) in DEFAULT_ENV.items():
        if name not in env:
            env[name] = value
            added[name] = value
    return added
