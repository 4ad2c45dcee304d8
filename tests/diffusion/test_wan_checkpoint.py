"""``load_wan_checkpoint`` reads single-file and sharded safetensors checkpoints in diffusers or original names,
returns our state dict bitwise, infers the flavor, and names the tensor or file when something is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from loongforge.errors import LoongForgeError
from loongforge_diffusion.wan.checkpoint import load_wan_checkpoint
from loongforge_diffusion.wan.diffusers_adapter import diffusers_config, to_diffusers
from loongforge_diffusion.wan.model import WanModel
from loongforge_diffusion.wan.original_adapter import to_original
from safetensors.torch import save_file
from wan_reference import tiny_flavor

CONVERTERS = {"diffusers": to_diffusers, "original": to_original}


def _flavor(task: str):
    """Tiny flavors with the released models' channel pattern: T2V in == out, I2V in = out + mask + image."""
    channels = {"t2v": (4, 4), "i2v": (9, 4), "ti2v": (48, 48)}[task]
    return tiny_flavor(task, 16).with_overrides(in_channels=channels[0], out_channels=channels[1],
                                                version="2.2" if task == "ti2v" else "2.1")


def _config(flavor, layout: str) -> dict:
    if layout == "diffusers":
        return {"_class_name": "WanTransformer3DModel", **diffusers_config(flavor)}
    return {"_class_name": "WanModel", "model_type": flavor.task, "dim": flavor.dim, "num_heads": flavor.num_heads,
            "eps": flavor.eps}


def _write(directory: Path, tensors: dict[str, torch.Tensor], *, shards: int = 1, config: dict | None = None) -> Path:
    directory.mkdir(parents=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(directory / "diffusion_pytorch_model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: tensors[n].contiguous() for n in part}, str(directory / file))
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("layout", ["diffusers", "original"])
@pytest.mark.parametrize(("task", "shards"), [("t2v", 1), ("i2v", 3), ("ti2v", 2)])
def test_loads_either_naming_bitwise_and_infers_the_flavor(tmp_path, layout, task, shards):
    torch.manual_seed(0)
    flavor = _flavor(task)
    model = WanModel(flavor)
    torch.nn.init.normal_(model.head.proj.weight)  # zero at init; make every tensor distinctive
    ours = model.state_dict()
    directory = _write(tmp_path / "ckpt", CONVERTERS[layout](ours), shards=shards, config=_config(flavor, layout))

    checkpoint = load_wan_checkpoint(directory)

    assert checkpoint.layout == layout
    assert sorted(checkpoint.state_dict) == sorted(ours)
    assert all(torch.equal(checkpoint.state_dict[k], v) for k, v in ours.items())
    assert checkpoint.fields == {name: getattr(flavor, name) for name in checkpoint.fields}
    assert checkpoint.flavor(text_len=flavor.text_len, rope_max_seq_len=flavor.rope_max_seq_len,
                             sample_shift=flavor.sample_shift) == flavor
    WanModel(checkpoint.flavor()).load_state_dict(checkpoint.state_dict, strict=True)


def test_heads_come_from_the_caller_or_the_released_head_dim(tmp_path):
    flavor = _flavor("t2v")
    tensors = to_original(WanModel(flavor).state_dict())
    bare = _write(tmp_path / "bare", tensors)
    with pytest.raises(LoongForgeError, match="number of attention heads.*pass num_heads"):
        load_wan_checkpoint(bare)
    assert load_wan_checkpoint(bare, num_heads=2).fields["num_heads"] == 2
    wide = flavor.with_overrides(dim=256, num_heads=2, num_layers=1)  # head dim 128 like every released model
    released = _write(tmp_path / "wide", to_original(WanModel(wide).state_dict()))
    assert load_wan_checkpoint(released).flavor() == wide.with_overrides(text_len=512, rope_max_seq_len=1024,
                                                                         sample_shift=5.0)


def test_wrong_checkpoints_are_errors_that_name_the_tensor_or_file(tmp_path):
    flavor = _flavor("t2v")
    tensors = to_original(WanModel(flavor).state_dict())
    for dropped, ours in (("blocks.1.ffn.0.weight", "blocks.1.ffn.fc1.weight"),
                          ("blocks.0.ffn.0.weight", "blocks.0.ffn.fc1.weight"),
                          ("blocks.1.self_attn.v.weight", "blocks.1.self_attn.qkv.weight")):
        truncated = {k: v for k, v in tensors.items() if k != dropped}
        directory = _write(tmp_path / dropped, truncated, config=_config(flavor, "original"))
        with pytest.raises(LoongForgeError, match=rf"(?=.*lacks)(?=.*'{re.escape(dropped)}')(?=.*'{re.escape(ours)}')"):
            load_wan_checkpoint(directory)
    with pytest.raises(LoongForgeError, match=r"img_emb\.emb_pos"):
        load_wan_checkpoint(_write(tmp_path / "flf2v", {**tensors, "img_emb.emb_pos": torch.zeros(1, 4, 24)}))
    with pytest.raises(LoongForgeError, match="not a Wan DiT checkpoint"):
        load_wan_checkpoint(_write(tmp_path / "other", {"model.embed_tokens.weight": torch.zeros(2, 2)}))
    sharded = _write(tmp_path / "sharded", tensors, shards=2)
    index = sharded / "diffusion_pytorch_model.safetensors.index.json"
    listing = json.loads(index.read_text())
    files = sorted(set(listing["weight_map"].values()))
    elsewhere = next(f for f in files if f != listing["weight_map"]["head.head.bias"])
    listing["weight_map"]["head.head.bias"] = elsewhere
    index.write_text(json.dumps(listing))
    with pytest.raises(LoongForgeError, match=rf"{elsewhere}: lacks tensor 'head\.head\.bias'"):
        load_wan_checkpoint(sharded)
    _write(tmp_path / "pipeline" / "transformer", tensors)
    with pytest.raises(LoongForgeError, match=r"subdirectories \['transformer'\]"):
        load_wan_checkpoint(tmp_path / "pipeline")
