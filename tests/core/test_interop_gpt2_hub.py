"""``loongforge convert`` of a GPT-2 file as the hub publishes it (in its own module: the conversion builds
megatron worlds of its own, which the module-scoped world of test_models_families.py would collide with)."""

from __future__ import annotations

import torch
from conftest import checkpoint_logits  # noqa: E402
from loongforge.cli import main  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def test_hub_style_gpt2_file_without_base_prefix_converts(hf_tiny, tmp_path, capsys):
    """openai-community/gpt2's model.safetensors names tensors ``h.0...``/``wte.weight`` (saved from GPT2Model)
    and keeps the causal-mask buffers ``h.<i>.attn.bias``; both must convert like transformers loads them."""
    hf_dir, hf = hf_tiny("gpt2-tied")
    tensors = load_file(hf_dir / "model.safetensors")
    hub = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    hub.update({f"h.{i}.attn.bias": torch.ones(1, 1, 256, 256).tril() for i in range(2)})
    save_file(hub, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore")]) == 0
    tokens = torch.randint(0, 389, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits
    assert (checkpoint_logits(tmp_path / "mcore", tokens)[..., :389] - expected).abs().max().item() <= 1e-5
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")  # written as transformers 5 saves it
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
