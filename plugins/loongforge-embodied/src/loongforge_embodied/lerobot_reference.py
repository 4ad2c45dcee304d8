"""LeRobot's ``PI05Policy`` as the reference implementation of the PaliGemma-exact Pi0.5 (``Pi05GemmaFlavor
.reference_implementation()``): ``loongforge diff CHECKPOINT LEROBOT_DIR --reference B`` runs a LeRobot policy
directory (``config.json`` + ``model.safetensors``, as LeRobot's ``save_pretrained`` writes it; the weights of ours
through ``loongforge convert mcore-to-hf``) through the checkpoint's own task loss and names the first module,
under LeRobot's names, where our policy computes differently.

- Sizes: LeRobot 0.4.4 knows only Pi0.5's published sizes (``get_gemma_config``: ``gemma_2b`` / ``gemma_300m``,
  PaliGemma's So400m tower, 257152 ids). :func:`_at_flavor_sizes` hands LeRobot's own classes the flavor's sizes
  where they look them up, so a tiny flavor builds a tiny ``PI05Policy``; the rest (the flow, the masks, the layer
  loop) is LeRobot's code as released. LeRobot reshapes attention outputs with 8 heads, so the flavor needs 8.
- The loss: the task's ``validation_loss`` draws noise and time from the seeded generators and calls the model as
  it calls ours, ``(inputs, x_t, time) -> velocity``; :class:`_CalledAsOurs` turns that into a call of
  ``PI05Pytorch.forward`` (images from [0, 1] to [-1, 1] per camera, as ``PI05Policy`` prepares them) and returns
  the velocity ``action_out_proj`` computed there.
- Names: parameters through :func:`~loongforge_embodied.convert_lerobot.to_lerobot`; module pairs read off the
  conversion's name map (:func:`~loongforge_embodied.convert_lerobot.name_map`), plus each SigLIP block, each
  Gemma MLP and the expert's adaptive norms (whose parameters belong to their projection). Our modules that no
  output reads (the last layer's prefix queries and MLP, the LM's final norm: :meth:`Pi05GemmaPolicy.unused`) pair
  nothing: LeRobot computes them, we do not. LeRobot runs the vision tower once per camera, we once over all
  cameras: with more than one camera the tower's outputs pair nothing (its parameters and gradients still compare).

LeRobot 0.4.4's Pi0.5 also needs its patched transformers (a git branch: adaptive RMSNorm, gated residuals); it is
the caller's to provide it (``parity/lerobot`` installs a stand-in, see its README). Everything from LeRobot is
imported in :meth:`LeRobotPi05.load`, so the plugin imports without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import InteropError
from loongforge.models.family import ModulePair, module_pairs_from_parameters

from loongforge_embodied.convert_lerobot import (
    ACTION_EXPERT,
    LANGUAGE_MODEL,
    LEROBOT_PREFIX,
    UNUSED,
    VISION_TOWER,
    name_map,
    to_lerobot,
)
from loongforge_embodied.policies.pi05_gemma_flavors import Pi05GemmaFlavor

#: ``compute_layer_complete`` reshapes the joint attention's output with ``1 * 8 * head_dim``.
LEROBOT_HEADS = 8
#: Ours and LeRobot's compute the same numbers in another layout: SigLIP's patch convolution gives (B, d, h, w),
#: our patch embedding (a linear over flattened patches) (B, patches, d).
_UNPAIRED = ("vision.patch_embed",)


class _CalledAsOurs(torch.nn.Module):
    """LeRobot's ``PI05Pytorch`` called as our policy is, ``(inputs, x_t, time) -> velocity``.

    ``PI05Pytorch.forward`` takes clean actions and noise and mixes them itself; given ``x_t`` as both it computes
    ``t * x_t + (1 - t) * x_t`` (``x_t`` to a rounding) and its own velocity, which a hook on ``action_out_proj``
    returns (its loss, against ``noise - actions``, is not ours to use)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Mapping[str, torch.Tensor], x_t: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        if x_t.shape[1] != self.model.config.chunk_size:
            raise InteropError(f"LeRobot's config.json says chunk_size {self.model.config.chunk_size}, the task "
                               f"replays chunks of {x_t.shape[1]} (task.action_horizon)")
        tokens = inputs["tokens"]
        images = inputs.get("images")
        cameras = [] if images is None else [images[:, c] * 2.0 - 1.0 for c in range(images.shape[1])]
        shown = inputs.get("image_masks", torch.ones(tokens.shape[0], len(cameras), dtype=torch.bool))
        velocity: list[torch.Tensor] = []
        handle = self.model.action_out_proj.register_forward_hook(lambda _m, _a, out: velocity.append(out))
        try:
            self.model(cameras, [shown[:, c].bool() for c in range(len(cameras))], tokens, tokens != 0, x_t,
                       noise=x_t, time=time)
        finally:
            handle.remove()
        return velocity[0]


@contextlib.contextmanager
def _at_flavor_sizes(modeling_pi05: Any, flavor: Pi05GemmaFlavor) -> Iterator[None]:
    """LeRobot's Pi0.5 module with ``flavor``'s sizes where it reads its fixed ones: ``get_gemma_config`` (both
    Gemma variants), and the configs it prepares for ``PaliGemmaForConditionalGeneration`` (the SigLIP tower, the
    projector's width, the vocabulary, the rotary base) and the expert's ``GemmaForCausalLM``, with the flavor's
    norm epsilon in both; restored on exit."""
    f = flavor
    sizes = {"gemma_2b": (f.width, f.depth, f.mlp_dim), "gemma_300m": (f.expert_width, f.depth, f.expert_mlp_dim)}
    names = ("get_gemma_config", "PaliGemmaForConditionalGeneration", "GemmaForCausalLM")
    before = {name: getattr(modeling_pi05, name) for name in names}

    def gemma_config(variant: str) -> Any:
        width, depth, mlp = sizes[variant]
        return modeling_pi05.GemmaConfig(width, depth, mlp, f.heads, f.kv_heads, f.head_dim)

    def paligemma(config: Any) -> Any:
        vision, siglip = config.vision_config, f.siglip()
        vision.hidden_size, vision.intermediate_size = siglip.dim, siglip.ffn_dim
        vision.num_hidden_layers, vision.num_attention_heads = siglip.num_layers, siglip.num_heads
        vision.patch_size, vision.image_size, vision.projection_dim = siglip.patch_size, siglip.image_size, f.width
        vision.layer_norm_eps = siglip.eps
        text = config.text_config
        text.vocab_size, text.rms_norm_eps, text.rope_theta = f.vocab, f.eps, f.rope_theta
        return before["PaliGemmaForConditionalGeneration"](config)

    def expert(config: Any) -> Any:
        config.rms_norm_eps = f.eps
        return before["GemmaForCausalLM"](config)

    for name, stand_in in zip(names, (gemma_config, paligemma, expert), strict=True):
        setattr(modeling_pi05, name, stand_in)
    try:
        yield
    finally:
        for name, original in before.items():
            setattr(modeling_pi05, name, original)


@dataclass(frozen=True)
class LeRobotPi05:
    """LeRobot 0.4.4's ``PI05Policy`` of one flavor (:class:`~loongforge.models.family.ReferenceImplementation`)."""

    flavor: Pi05GemmaFlavor
    library: str = "lerobot"

    def load(self, path: Path) -> Any:
        """The policy directory ``path``: LeRobot's config read by LeRobot (device and dtype set to the CPU and
        float32), the policy built at the flavor's sizes, ``model.safetensors`` loaded into it; every tensor but the
        two heads Pi0.5 never reads must be there (LeRobot's ``from_pretrained`` would warn and go on with random
        weights). Those heads are then removed, as our conversion drops them, so parameters compare one to one."""
        path = Path(path)
        if self.flavor.heads != LEROBOT_HEADS:
            raise InteropError(f"{path}: LeRobot's Pi0.5 runs {LEROBOT_HEADS} query heads, the checkpoint's flavor "
                               f"has {self.flavor.heads} (model.overrides.heads)")
        weights = path / "model.safetensors"
        if not (path / "config.json").is_file() or not weights.is_file():
            raise InteropError(f"{path}: not a LeRobot policy directory (config.json and model.safetensors)")
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.pi05 import modeling_pi05
        from safetensors.torch import load_file

        config = PreTrainedConfig.from_pretrained(str(path))
        config.device, config.dtype = "cpu", "float32"
        with _at_flavor_sizes(modeling_pi05, self.flavor):
            policy = modeling_pi05.PI05Policy(config)
        state = policy._fix_pytorch_state_dict_keys(load_file(str(weights)), config)  # LeRobot's own renames
        state = {name if name.startswith(LEROBOT_PREFIX) else LEROBOT_PREFIX + name: t for name, t in state.items()}
        missing, unexpected = policy.load_state_dict(state, strict=False)
        missing = sorted(set(missing) - {LEROBOT_PREFIX + name for name in UNUSED})
        if missing or unexpected:
            raise InteropError(f"{weights}: {len(missing)} of LeRobot's tensors missing ({missing[:2]}), "
                               f"{len(unexpected)} unexpected ({unexpected[:2]}) for the checkpoint's flavor")
        for name in UNUSED:
            owner, _, head = name.rpartition(".weight")[0].rpartition(".")
            setattr(policy.model.get_submodule(owner), head, None)
        return policy.float().eval().requires_grad_(True)

    def avoided_tokens(self, path: Path) -> tuple[int, ...]:
        return ()  # the prompt ids come from the task's data, not from the replayed token batch

    def loss(self, model: Any, batch: Mapping[str, Any]) -> Any:
        return batch["task"].validation_loss(_CalledAsOurs(model.model), batch["batch"], batch["generators"])

    def module_pairs(self) -> tuple[ModulePair, ...]:
        """Each of our modules that is one LeRobot module renamed, each SigLIP block, Gemma MLP and adaptive norm;
        none for what only LeRobot computes (see the module docstring)."""
        f = self.flavor
        names = name_map(f)
        pairs = [*module_pairs_from_parameters(names)]
        pairs += [ModulePair(f"vision.blocks.{i}", f"{LEROBOT_PREFIX}{VISION_TOWER}encoder.layers.{i}")
                  for i in range(f.vision_depth if f.cameras else 0)]
        pairs += [ModulePair(f"layers.{i}.{stream}.mlp", f"{LEROBOT_PREFIX}{layers}{i}.mlp")
                  for i in range(f.depth) for stream, layers in (("prefix", LANGUAGE_MODEL + "layers."),
                                                                 ("expert", ACTION_EXPERT + "layers."))]
        # the adaptive norms hold no parameter of their own (their projection does), so the map does not name them
        pairs += [ModulePair(f"layers.{i}.expert.{norm}", f"{LEROBOT_PREFIX}{ACTION_EXPERT}layers.{i}.{norm}")
                  for i in range(f.depth) for norm in ("input_layernorm", "post_attention_layernorm")]
        pairs.append(ModulePair("expert_norm", f"{LEROBOT_PREFIX}{ACTION_EXPERT}norm"))
        skipped = set(_UNPAIRED) | _not_run(f)
        if f.cameras > 1:
            skipped |= {"vision", "projector"}
        return tuple(pair for pair in pairs if not any(pair.ours == name or pair.ours.startswith(name + ".")
                                                       for name in skipped))

    def parameters(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return to_lerobot(state, self.flavor)


def _not_run(flavor: Pi05GemmaFlavor) -> set[str]:
    """Names of our modules no output reads (:meth:`Pi05GemmaPolicy.unused`, built on the meta device)."""
    with torch.device("meta"):
        policy = flavor.build_policy()
    names = {id(module): name for name, module in policy.named_modules()}
    return {names[id(module)] for module in policy.unused()}
