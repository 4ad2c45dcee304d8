"""The ModelFamilySuite for the diffusion families the task engine trains: each builds through its task
(``make_task(config).build_model()``, the same weights under the same seed), trains one flow-matching step on a
batch of its recipe's data, and saves and loads through the task checkpoint's safetensors file."""

from __future__ import annotations

from pathlib import Path

from loongforge.plugins import get_host
from loongforge.testing.family_suite import ModelFamilySuite

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class TestWanTiny(ModelFamilySuite):
    family = get_host().registry("model").load("wan-tiny")
    causal_lm = False
    config_path = str(CONFIGS / "diffusion-moving-squares.yaml")
    config_overrides = ("task.samples=4",)


class TestQwenImageTiny(ModelFamilySuite):
    family = get_host().registry("model").load("qwen-image-tiny")
    causal_lm = False
    config_path = str(CONFIGS / "diffusion-squares-image.yaml")
    #: One block: zero-initialised gates open one layer per step, so the text stream of the first of six blocks
    #: would see its first non-zero gradient only after more steps than the suite takes.
    config_overrides = ("task.samples=4", "model.overrides.num_layers=1")
    #: The last block's text-stream output is discarded (only the image stream reaches the head), as in diffusers'
    #: QwenImageTransformer2DModel: its feed-forward and its text queries' norm never train.
    never_trained = ("blocks.0.txt.ffn.*", "blocks.0.txt.norm_q.weight")
