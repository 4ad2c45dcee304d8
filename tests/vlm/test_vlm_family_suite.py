"""The ModelFamilySuite for the composed VLM: ``vlm-tiny`` (SigLIP-tiny + MLP projector + llama-debug) builds
through the one builder with the device's layers, trains a step on an image-text batch (every vision and text
weight gets a gradient), saves and loads, and continues text deterministically. A composed VLM has no Hugging Face
layout, so it declares no adapter (the Qwen-VL and InternVL flavors do: tests/vlm/test_vlm_convert*.py)."""

from __future__ import annotations

import torch
from loongforge.testing.family_suite import ModelFamilySuite
from loongforge_vlm.model.flavors import FLAVORS

FLAVOR = FLAVORS["vlm-tiny"]


class TestVLMTiny(ModelFamilySuite):
    family = FLAVOR
    has_hf_adapter = False
    seq_length = 24
    own_modules = ("encoder.*",)  # the SigLIP encoder is plain torch; the language model is the device's

    def make_batch(self, family, generator):
        """Text of byte ids with one 32 px image's 16 placeholder tokens after the first token of each sample."""
        batch = super().make_batch(family, generator)
        tokens = batch["tokens"] % family.image_token_id  # no stray placeholders
        tokens[:, 1:17] = family.image_token_id
        batch["tokens"] = tokens
        batch["pixel_values"] = torch.randn(self.batch_size, 3, 32, 32, generator=generator)
        return batch


def test_the_batch_feeds_the_declared_extra_inputs():
    """What the megatron engine passes beside the text is the family's declared slot, and the suite's batch uses it."""
    assert "pixel_values" in FLAVOR.extra_inputs
    batch = TestVLMTiny().make_batch(FLAVOR, torch.Generator().manual_seed(0))
    assert set(batch) - {"tokens", "position_ids", "labels"} <= set(FLAVOR.extra_inputs)
    assert int((batch["tokens"] == FLAVOR.image_token_id).sum()) == 2 * 16


def test_generate_rebuilds_a_composed_checkpoint_through_its_family(tmp_path):
    """``loongforge generate`` on a VLM run's checkpoint: the family's ``build_chunk`` rebuilds the composed model
    (plain ``build_model`` could not load its vision weights) and the run's registered tokenizer is used."""
    from pathlib import Path

    from loongforge.config import load_config
    from loongforge.interop.generate import generate_from_checkpoint
    from loongforge.train.run import run_training

    config = Path(__file__).resolve().parents[2] / "configs" / "vlm-shapes.yaml"
    run_training(load_config(config, [f"run.output_dir={tmp_path}", "training.steps=1", "logging.progress=false",
                                      "logging.tensorboard=false"]))
    texts = [generate_from_checkpoint(tmp_path / "checkpoints", "What ", tokens=6) for _ in range(2)]
    assert texts[0] == texts[1] and texts[0].startswith("What ") and len(texts[0]) > len("What ")
