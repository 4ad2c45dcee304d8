"""The DeepSeek-V2/V3 family (DeepSeek-V3, Kimi-K2, Moonlight, DeepSeek-V2-Lite), built through core's family seams
only, as a plugin would: a :class:`~loongforge.models.deepseek.flavor.DeepSeekFlavor` (torch-free data), per-layer
megatron specs from the device's provider (:mod:`~loongforge.models.deepseek.layer_spec`, handed to core as a
``DecoderSpec``), the Hugging Face reader and adapter (:mod:`~loongforge.models.deepseek.hf`,
:mod:`~loongforge.models.deepseek.hf_layout`), counts (:mod:`~loongforge.models.deepseek.counts`) and the
registration functions core's hooks call (:mod:`~loongforge.models.deepseek.registration`).

Importing this package is cheap: flavors and readers import torch and megatron only when a model is built.
"""

from __future__ import annotations

from loongforge.models.deepseek.flavor import DeepSeekFlavor
from loongforge.models.deepseek.flavors import FLAVORS, HF_IDS

__all__ = ["FLAVORS", "HF_IDS", "DeepSeekFlavor"]
