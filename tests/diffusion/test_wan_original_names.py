"""Conversion to and from the original Wan names (Wan-Video/Wan2.1 and Wan2.2 ``WanModel``) is exact and agrees
with diffusers' own conversion script."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel
from loongforge.errors import LoongForgeError
from loongforge_diffusion.wan.diffusers_adapter import diffusers_config, from_diffusers
from loongforge_diffusion.wan.original_adapter import from_original, to_original
from wan_reference import tiny_flavor

#: The renames diffusers' scripts/convert_wan_to_diffusers.py (TRANSFORMER_KEYS_RENAME_DICT) applies to the
#: original names, in its order, as plain substring replacements; norm2/norm3 are swapped through a placeholder.
SCRIPT_RENAMES = (
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("head.modulation", "scale_shift_table"),
    ("head.head", "proj_out"),
    ("modulation", "scale_shift_table"),
    ("ffn.0", "ffn.net.0.proj"),
    ("ffn.2", "ffn.net.2"),
    ("norm2", "norm__placeholder"),
    ("norm3", "norm2"),
    ("norm__placeholder", "norm3"),
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("self_attn.q", "attn1.to_q"),
    ("self_attn.k", "attn1.to_k"),
    ("self_attn.v", "attn1.to_v"),
    ("self_attn.o", "attn1.to_out.0"),
    ("self_attn.norm_q", "attn1.norm_q"),
    ("self_attn.norm_k", "attn1.norm_k"),
    ("cross_attn.q", "attn2.to_q"),
    ("cross_attn.k", "attn2.to_k"),
    ("cross_attn.v", "attn2.to_v"),
    ("cross_attn.o", "attn2.to_out.0"),
    ("cross_attn.norm_q", "attn2.norm_q"),
    ("cross_attn.norm_k", "attn2.norm_k"),
    ("attn2.to_k_img", "attn2.add_k_proj"),
    ("attn2.to_v_img", "attn2.add_v_proj"),
    ("attn2.norm_k_img", "attn2.norm_added_k"),
)


def _script_rename(name: str) -> str:
    for old, new in SCRIPT_RENAMES:
        name = name.replace(old, new)
    return name


def _expected_original_shapes(with_image: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the original WanModel for ``tiny_flavor(task, 16)``: dim 32, ffn 48, text 16, freq 32,
    5 -> 4 channels, patch (1, 2, 2), 2 blocks, CLIP width 24 (I2V), written out from the original model.py."""
    d, linear = 32, lambda o, i: {"weight": (o, i), "bias": (o,)}  # noqa: E731
    modules = {
        "patch_embedding": {"weight": (d, 5, 1, 2, 2), "bias": (d,)},
        "text_embedding.0": linear(d, 16), "text_embedding.2": linear(d, d),
        "time_embedding.0": linear(d, 32), "time_embedding.2": linear(d, d), "time_projection.1": linear(6 * d, d),
        "head.head": linear(4 * 1 * 2 * 2, d),
    }
    if with_image:
        modules.update({"img_emb.proj.0": {"weight": (24,), "bias": (24,)}, "img_emb.proj.1": linear(24, 24),
                        "img_emb.proj.3": linear(d, 24), "img_emb.proj.4": {"weight": (d,), "bias": (d,)}})
    shapes = {"head.modulation": (1, 2, d)}
    for i in range(2):
        b = f"blocks.{i}"
        shapes.update({f"{b}.modulation": (1, 6, d), f"{b}.self_attn.norm_q.weight": (d,),
                       f"{b}.self_attn.norm_k.weight": (d,), f"{b}.cross_attn.norm_q.weight": (d,),
                       f"{b}.cross_attn.norm_k.weight": (d,)})
        for attn in ("self_attn", "cross_attn"):
            modules.update({f"{b}.{attn}.{p}": linear(d, d) for p in "qkvo"})
        modules.update({f"{b}.norm3": {"weight": (d,), "bias": (d,)}, f"{b}.ffn.0": linear(48, d),
                        f"{b}.ffn.2": linear(d, 48)})
        if with_image:
            modules.update({f"{b}.cross_attn.k_img": linear(d, d), f"{b}.cross_attn.v_img": linear(d, d)})
            shapes[f"{b}.cross_attn.norm_k_img.weight"] = (d,)
    shapes.update({f"{m}.{p}": s for m, params in modules.items() for p, s in params.items()})
    return shapes


def _reference(task: str) -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(**diffusers_config(tiny_flavor(task, 16)))


@pytest.mark.parametrize("task", ["t2v", "i2v", "ti2v"])
def test_diffusers_ours_original_ours_is_bitwise(task):
    ours = from_diffusers(_reference(task).state_dict())
    original = to_original(ours)
    back = from_original(original)
    assert sorted(back) == sorted(ours)
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    assert all(torch.equal(v, again) for v, again in zip(original.values(), to_original(back).values(), strict=True))


@pytest.mark.parametrize(("task", "with_image"), [("t2v", False), ("i2v", True)])
def test_original_names_and_shapes_match_the_wan_repository(task, with_image):
    original = to_original(from_diffusers(_reference(task).state_dict()))
    assert {k: tuple(v.shape) for k, v in original.items()} == _expected_original_shapes(with_image)


@pytest.mark.parametrize("task", ["t2v", "i2v", "ti2v"])
def test_agrees_with_diffusers_conversion_script(task):
    """Our original names, renamed as diffusers' script renames a released checkpoint, are exactly diffusers'
    names for the same tensors."""
    reference = _reference(task).state_dict()
    original = to_original(from_diffusers(reference))
    renamed = {_script_rename(k): v for k, v in original.items()}
    assert sorted(renamed) == sorted(reference)
    assert all(torch.equal(renamed[k], reference[k]) for k in reference)


def test_errors_name_the_tensor():
    original = to_original(from_diffusers(_reference("t2v").state_dict()))
    with pytest.raises(LoongForgeError, match=r"img_emb\.emb_pos"):
        from_original({**original, "img_emb.emb_pos": torch.zeros(1, 514, 1280)})
    del original["blocks.1.self_attn.k.bias"]
    with pytest.raises(LoongForgeError, match=r"blocks\.1\.self_attn\.qkv\.bias.*blocks\.1\.self_attn\.k\.bias"):
        from_original(original)
    with pytest.raises(LoongForgeError, match=r"blocks\.0\.bogus"):
        to_original({"blocks.0.bogus": torch.zeros(1)})
