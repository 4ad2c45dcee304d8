"""Our Wan DiT matches diffusers' ``WanTransformer3DModel`` built tiny from the same config.

Outputs, input gradients and every parameter gradient (mapped back to diffusers' names) must agree in fp32 to
rel-L2 < 1e-5 and max abs < 1e-4, for T2V, I2V (CLIP image branch) and Wan 2.2 TI2V per-token timesteps.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel
from loongforge_diffusion.wan.diffusers_adapter import diffusers_config, from_diffusers, to_diffusers
from loongforge_diffusion.wan.model import WanModel
from wan_reference import DIFFUSERS_I2V_TEXT_LEN, max_abs, rel_l2, tiny_flavor

REL, ABS = 1e-5, 1e-4
VIDEO = (2, 5, 3, 4, 6)  # batch, channels, frames, height, width -> 3 * 2 * 3 = 18 tokens with patch (1, 2, 2)


def _inputs(task: str, generator: torch.Generator) -> dict:
    batch = VIDEO[0]
    text_len = DIFFUSERS_I2V_TEXT_LEN if task == "i2v" else 7
    tokens = VIDEO[2] * (VIDEO[3] // 2) * (VIDEO[4] // 2)
    inputs = {
        "video": torch.randn(VIDEO, generator=generator),
        "context": torch.randn(batch, text_len, 16, generator=generator),
        "timestep": (torch.rand(batch, tokens, generator=generator) * 1000 if task == "ti2v"
                     else torch.tensor([3.0, 700.0])),
    }
    if task == "i2v":
        inputs["image_context"] = torch.randn(batch, 5, 24, generator=generator)
    return inputs


def _run(model, inputs: dict, weights: torch.Tensor, *, ours: bool) -> tuple[torch.Tensor, dict]:
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if k != "timestep"}
    if ours:
        out = model(leaves["video"], inputs["timestep"], leaves["context"], leaves.get("image_context"))
    else:
        out = model(leaves["video"], inputs["timestep"], leaves["context"],
                    encoder_hidden_states_image=leaves.get("image_context"), return_dict=False)[0]
    (out * weights).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize(("task", "head_dim"), [("t2v", 16), ("t2v", 64), ("i2v", 16), ("i2v", 64), ("ti2v", 16),
                                                 ("ti2v", 64)])
def test_forward_and_gradients_match_diffusers(task, head_dim):
    torch.manual_seed(0)
    flavor = tiny_flavor(task, head_dim)
    reference = WanTransformer3DModel(**diffusers_config(flavor))
    ours = WanModel(flavor)
    ours.load_state_dict(from_diffusers(reference.state_dict()))
    generator = torch.Generator().manual_seed(1)
    inputs = _inputs(task, generator)
    weights = torch.randn(VIDEO[0], 4, *VIDEO[2:], generator=generator)

    out, input_grads = _run(ours, inputs, weights, ours=True)
    ref_out, ref_input_grads = _run(reference, inputs, weights, ours=False)

    assert out.shape == ref_out.shape and ref_out.norm() > 0
    assert rel_l2(out, ref_out) < REL and max_abs(out, ref_out) < ABS
    for name, grad in input_grads.items():
        assert rel_l2(grad, ref_input_grads[name]) < REL, name
        assert max_abs(grad, ref_input_grads[name]) < ABS, name
    param_grads = to_diffusers({n: p.grad for n, p in ours.named_parameters()})
    ref_params = dict(reference.named_parameters())
    assert sorted(param_grads) == sorted(ref_params)
    for name, param in ref_params.items():
        assert param.grad is not None and param.grad.norm() > 0, name
        assert rel_l2(param_grads[name], param.grad) < REL, name
        assert max_abs(param_grads[name], param.grad) < ABS, name
