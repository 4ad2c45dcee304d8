"""``loongforge convert`` of Qwen2-VL (the vlm plugin's converters): a saved transformers Qwen2-VL directory becomes
a LoongForge checkpoint whose model computes transformers' logits, and converting it back writes the original tensors
bitwise; bad inputs are one line and write nothing."""

from __future__ import annotations

import torch
from loongforge.cli import main
from loongforge_vlm.model.flavors import FLAVORS
from safetensors.torch import load_file
from vlm_reference import mixed_batch, reference_model


def test_round_trip_through_a_checkpoint_is_bitwise(tmp_path, capsys):
    flavor = FLAVORS["qwen2-vl-tiny"]
    reference_model(flavor).save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    assert "as model 'qwen2-vl-tiny' (fp32)" in capsys.readouterr().out
    assert main(["convert", "mcore-to-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


def test_converted_checkpoint_computes_transformers_logits(tmp_path):
    from loongforge.interop.mcore_checkpoint import load_model_weights
    from loongforge.interop.world import standalone_world
    from loongforge_vlm.model.vlm import build_vlm

    flavor = FLAVORS["qwen2-vl-tiny"]
    reference = reference_model(flavor)
    reference.save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    batch = mixed_batch(flavor, video=False)
    with torch.no_grad():
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                             mm_token_type_ids=batch["mm_token_type_ids"]).logits
    with standalone_world() as backend, torch.no_grad():
        ours = build_vlm(flavor, backend=backend).eval()
        load_model_weights(tmp_path / "ours", [ours])
        logits = ours(batch["input_ids"], None, batch["attention_mask"], pixel_values=batch["pixel_values"],
                      image_grid_thw=batch["image_grid_thw"])
    keep = batch["attention_mask"].bool()
    assert (logits[keep] - expected[keep]).abs().max().item() <= 1e-4


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys):
    flavor = FLAVORS["qwen2-vl-tiny"]
    reference_model(flavor).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' own progress output
    out = str(tmp_path / "out")
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), out, "--model", "qwen2.5-vl-tiny"]) == 2
    err = capsys.readouterr().err
    # core's converter reads VLM directories through the family's registered reader and adapter
    assert err.startswith("error: ") and "does not match model 'qwen2.5-vl-tiny'" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert main(["convert", "mcore-to-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2  # not a checkpoint
    err = capsys.readouterr().err  # no converter claims an HF directory as a LoongForge checkpoint
    assert err.count("\n") == 1 and f"no registered handler claims '{tmp_path / 'hf'}'" in err, err
    assert "hf-exportable-checkpoint (loongforge-core): a LoongForge checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_a_saved_checkpoint_config_rebuilds_overridden_parts():
    """What ``convert hf-to-mcore`` records for a model whose parts differ from every registered flavor's (the
    nearest name, the differing parts as plain mappings in ``config.yaml``) rebuilds that model; a mapping that is
    no part is one line naming it."""
    import pytest
    from loongforge.config.sections import section_to_dict
    from loongforge.errors import ConfigError
    from loongforge.models.hf_adopt import name_model
    from loongforge.models.qwen import FLAVORS as QWEN

    internvl = FLAVORS["internvl-tiny"]
    models = [internvl.with_overrides(foundation=QWEN["qwen3-tiny"]),
              internvl.with_overrides(encoder=FLAVORS["vlm-tiny"].encoder.with_overrides(post_norm=False)),
              FLAVORS["qwen2-vl-tiny"].with_overrides(encoder=FLAVORS["qwen2.5-vl-tiny"].encoder)]
    for model in models:
        name, overrides = name_model(model, None, "hf")
        assert FLAVORS[name].with_overrides(**section_to_dict(overrides)) == model
    with pytest.raises(ConfigError, match=r"^vlm flavor: override encoder=\{'layers': 3\} is neither"):
        internvl.with_overrides(encoder={"layers": 3})
