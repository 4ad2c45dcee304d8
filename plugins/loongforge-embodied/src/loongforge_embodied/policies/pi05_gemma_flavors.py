"""``Pi05GemmaFlavor``: the sizes of a PaliGemma-exact Pi0.5 policy (:mod:`~loongforge_embodied.policies.
pi05_gemma`), and the named flavors ``pi05-gemma-tiny`` (CPU) and ``pi05-base`` (the published 3B sizes).

Torch-free like :mod:`~loongforge_embodied.policies.flavors`: the plugin registers these objects and ``loongforge
list`` must stay instant. The SigLIP tower's sizes are a :class:`loongforge_vlm.encoders.siglip_flavors.
SiglipFlavor` (the VLM plugin's encoder is reused as is). Prompts are our byte-level ids with the state bins
after them (:mod:`~loongforge_embodied.policies.prompt`), so ``vocab`` must hold ``1 + 256 + state_bins`` ids;
a published checkpoint's prompt would come from PaliGemma's SentencePiece tokenizer instead, which is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.listing import size_label

from loongforge_embodied.policies.flavor_base import PolicyFlavor
from loongforge_embodied.policies.flavors import TEXT_VOCAB


@dataclass(frozen=True)
class Pi05GemmaFlavor(PolicyFlavor):
    """SigLIP (``vision_*``, ``patch_size``, ``image_size``) + projector, the Gemma LM (``width`` ... ``vocab``)
    and the Gemma action expert (``expert_*``; same depth and head geometry as the LM, as Pi0.5 requires)."""

    vision_width: int = 32
    vision_depth: int = 1
    vision_mlp_dim: int = 64
    vision_heads: int = 2
    patch_size: int = 4
    image_size: int = 16
    cameras: int = 1
    width: int = 64
    depth: int = 2
    mlp_dim: int = 128
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 16
    vocab: int = TEXT_VOCAB + 256
    expert_width: int = 32
    expert_mlp_dim: int = 64
    text_len: int = 32               # prompt bytes kept; the state's bins follow
    state_bins: int = 256
    max_state_dim: int = 8
    max_action_dim: int = 8
    rope_theta: float = 10000.0
    eps: float = 1e-6
    min_period: float = 4e-3         # the flow time's sinusoidal embedding
    max_period: float = 4.0

    kind: ClassVar[str] = "pi05-gemma"
    POSITIVE: ClassVar[tuple[str, ...]] = (
        "vision_width", "vision_mlp_dim", "vision_heads", "width", "depth", "mlp_dim", "heads", "kv_heads",
        "head_dim", "vocab", "expert_width", "expert_mlp_dim", "text_len", "state_bins", "max_state_dim",
        "max_action_dim")
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ("vision_depth", "cameras")

    def __post_init__(self) -> None:
        self.check_sizes()
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ConfigError(f"pi05-gemma flavor: heads ({self.heads}) must be a multiple of kv_heads "
                              f"({self.kv_heads}) and head_dim ({self.head_dim}) even")
        if self.vocab < TEXT_VOCAB + self.state_bins:
            raise ConfigError(f"pi05-gemma flavor: vocab {self.vocab} cannot hold the prompt ids (padding, 256 "
                              f"bytes, {self.state_bins} state bins)")

    def siglip(self) -> Any:
        """The vision tower's :class:`~loongforge_vlm.encoders.siglip_flavors.SiglipFlavor`."""
        from loongforge_vlm.encoders.siglip_flavors import SiglipFlavor

        return SiglipFlavor(dim=self.vision_width, ffn_dim=self.vision_mlp_dim, num_heads=self.vision_heads,
                            num_layers=self.vision_depth, patch_size=self.patch_size, image_size=self.image_size)

    def build_policy(self) -> Any:
        from loongforge_embodied.policies.pi05_gemma import Pi05GemmaPolicy

        return Pi05GemmaPolicy(self)

    def frame_inputs(self, task: str, state: Any) -> dict[str, Any]:
        """``{"tokens": prompt ids}``: the task bytes, then the normalised state in ``state_bins`` bins."""
        from loongforge_embodied.policies.prompt import prompt_tokens

        return {"tokens": prompt_tokens(task, state, text_len=self.text_len, max_state_dim=self.max_state_dim,
                                        state_bins=self.state_bins)}

    def flow_matching(self) -> Any:
        """Pi0.5's convention (LeRobot's and openpi's): time 1 = noise, Beta(1.5, 1) times, velocity noise - actions."""
        from loongforge_embodied.policies import flow_matching

        return flow_matching

    def reference_implementation(self) -> Any:
        """LeRobot's ``PI05Policy`` at this flavor's sizes (:class:`loongforge_embodied.lerobot_reference.
        LeRobotPi05`), for ``loongforge diff CHECKPOINT LEROBOT_DIR --reference B``."""
        from loongforge_embodied.lerobot_reference import LeRobotPi05

        return LeRobotPi05(self)

    def num_params(self) -> int:
        """Parameter count from the sizes (``loongforge list`` does not build the model)."""
        from loongforge_vlm.encoders.siglip_flavors import num_params as siglip_params

        w, e, a = self.width, self.expert_width, self.max_action_dim
        attention = self.heads * self.head_dim

        def layer(width: int, mlp: int, norm: int) -> int:
            qkvo = 2 * width * attention + 2 * width * self.kv_heads * self.head_dim
            return 2 * norm + qkvo + 3 * width * mlp

        adaptive = e * 3 * e + 3 * e
        vision = siglip_params(self.siglip()) + self.vision_width * w + w if self.cameras else 0
        layers = self.depth * (layer(w, self.mlp_dim, w) + layer(e, self.expert_mlp_dim, adaptive))
        heads = (a * e + e) + 2 * (e * e + e) + (e * a + a)
        return vision + self.vocab * w + layers + w + adaptive + heads

    def describe(self) -> str:
        """One line for ``loongforge list``."""
        count = self.num_params()
        size = size_label(count)
        return (f"Pi0.5 (PaliGemma-exact: SigLIP + Gemma + Gemma action expert, adaRMS), {size} params, "
                f"{self.depth} layers, width {self.width} / expert {self.expert_width}, {self.heads} heads x "
                f"{self.head_dim} ({self.kv_heads} kv), {self.inputs_summary()} at {self.image_size}px")


FLAVORS: dict[str, Pi05GemmaFlavor] = {
    "pi05-gemma-tiny": Pi05GemmaFlavor(),
    # PaliGemma 3B (SigLIP So400m/14 at 224px, Gemma 2B) + the Gemma-300M action expert: LeRobot's / openpi's pi05.
    "pi05-base": Pi05GemmaFlavor(vision_width=1152, vision_depth=27, vision_mlp_dim=4304, vision_heads=16,
                                 patch_size=14, image_size=224, cameras=3, width=2048, depth=18, mlp_dim=16384,
                                 heads=8, kv_heads=1, head_dim=256, vocab=257152, expert_width=1024,
                                 expert_mlp_dim=4096, text_len=168, max_state_dim=32, max_action_dim=32),
}
