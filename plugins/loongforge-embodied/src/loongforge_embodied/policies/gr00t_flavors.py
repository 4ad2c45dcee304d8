"""``Gr00tFlavor``: the sizes of one GR00T-N1.6-style policy, and the table of named flavors.

Torch-free at import, because the plugin's collector hook registers these objects and ``loongforge list`` must stay
instant (``frame_inputs`` and ``build_policy`` import torch when a run calls them). Only CPU-sized flavors exist:
GR00T's backbone is a 2B Eagle VLM (SigLIP + a Qwen3 LLM cut at its 12th layer), which this plain-torch policy
replaces by a small transformer, so a "real size" name would not mean real weights. For scale, N1.5's released
action head is a 16-block DiT of 32 heads x 48 (width 1536, output 1024) over 2048-wide VL features with a 4-layer
VL self-attention, states padded to 64 and actions to 32 dimensions, a 16-step horizon, 32 embodiments and 4 Euler
steps; ``gr00t-small`` keeps those ratios at CPU size (see :mod:`loongforge_embodied.policies.gr00t`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.listing import size_label

from loongforge_embodied.policies.flavor_base import PolicyFlavor

#: A frame's embodiment id until a task option chooses one (the category of the per-embodiment MLPs).
DEFAULT_EMBODIMENT = 0


@dataclass(frozen=True)
class Gr00tFlavor(PolicyFlavor):
    """One policy: a VL backbone (``width``, ``depth``; then ``vl_layers`` self-attention layers, GR00T's "vlln"
    adapter) and a DiT action head (``dit_heads`` x ``dit_head_dim`` wide, ``dit_depth`` blocks that alternate
    cross- and self-attention) between per-embodiment state/action encoders and action decoders of width
    ``hidden``. States and actions are zero-padded to ``max_state_dim`` / ``max_action_dim``. ``alternate_vl``
    (N1.6's AlternateVLDiT) gives the cross-attention blocks the image patches and the text in turn; N1.5's joint
    keys (``false``) left ``gr00t-tiny`` blind to its camera (see ``Gr00tPolicy.cross_attention_keys``)."""

    cameras: int = 1
    image_size: int = 16
    patch_size: int = 4
    text_len: int = 32               # task bytes kept (longer texts are cut)
    max_state_dim: int = 8
    max_action_dim: int = 8
    max_horizon: int = 32            # learned positions of action tokens (GR00T: max_seq_len)
    embodiments: int = 4             # per-embodiment weight sets (GR00T: max_num_embodiments = 32)
    width: int = 48                  # VL backbone width (= VL feature width)
    depth: int = 2                   # VL backbone layers
    heads: int = 3                   # backbone and VL self-attention heads
    head_dim: int = 16
    vl_layers: int = 1               # self-attention layers after the backbone's LayerNorm
    dit_heads: int = 3               # DiT heads; the DiT's token width is dit_heads * dit_head_dim
    dit_head_dim: int = 16
    dit_depth: int = 4               # even blocks cross-attend to VL features, odd blocks self-attend
    alternate_vl: bool = True        # cross-attention blocks take image, text, image ... keys (N1.6); False: all
    hidden: int = 64                 # DiT output width, state encoder / action decoder hidden width
    future_tokens: int = 0           # learned tokens between the state and the actions (GR00T N1.5: 32)
    time_channels: int = 32          # sinusoid channels of the DiT's timestep encoder (GR00T: 256)
    mlp_ratio: int = 4
    eps: float = 1e-6

    kind: ClassVar[str] = "gr00t"
    POSITIVE: ClassVar[tuple[str, ...]] = ("text_len", "max_state_dim", "max_action_dim", "max_horizon",
                                           "embodiments", "width", "heads", "head_dim", "dit_heads", "dit_head_dim",
                                           "dit_depth", "hidden", "time_channels", "mlp_ratio")
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ("cameras", "depth", "vl_layers", "future_tokens")

    def __post_init__(self) -> None:
        self.check_sizes()
        if self.dit_width % 2 or self.time_channels % 2 or self.time_channels < 4:
            raise ConfigError(f"gr00t flavor: dit_heads * dit_head_dim ({self.dit_width}) must be even and "
                              f"time_channels ({self.time_channels}) even and >= 4 (sinusoidal time embeddings)")

    @property
    def dit_width(self) -> int:
        """Width of the DiT's tokens (GR00T: input_embedding_dim)."""
        return self.dit_heads * self.dit_head_dim

    def build_policy(self) -> Any:
        from loongforge_embodied.policies.gr00t import Gr00tPolicy

        return Gr00tPolicy(self)

    def frame_inputs(self, task: str, state: Any) -> dict[str, Any]:
        """One frame's inputs besides images: task bytes ``tokens`` (text_len,), the normalised ``state`` zero-padded
        to (max_state_dim,), and the ``embodiment`` id (a 0-d long tensor)."""
        import torch

        from loongforge_embodied.policies.prompt import padded_state, text_tokens

        return {"tokens": text_tokens(task, self.text_len), "state": padded_state(state, self.max_state_dim),
                "embodiment": torch.tensor(DEFAULT_EMBODIMENT)}

    def flow_matching(self) -> ModuleType:
        from loongforge_embodied.policies import gr00t_flow

        return gr00t_flow

    def num_params(self) -> int:
        """Parameter count, computed from the sizes (``loongforge list`` must not build the model)."""
        w, d, hid, ratio = self.width, self.dit_width, self.hidden, self.mlp_ratio
        images = _linear(3 * self.patch_size ** 2, w) + self.cameras * self.patches * w if self.cameras else 0
        backbone = images + (1 + 256 + self.text_len) * w  # byte embeddings, text positions
        backbone += self.depth * _block(w, self.heads, self.head_dim, ratio, context=None, bias=False, cond=None)
        adapter = 2 * w + self.vl_layers * _block(w, self.heads, self.head_dim, ratio, context=None, bias=True,
                                                  cond=None)
        dit = _linear(self.time_channels, d) + _linear(d, d)
        dit += sum(_block(d, self.dit_heads, self.dit_head_dim, ratio, context=None if i % 2 else w, bias=True,
                          cond=d) for i in range(self.dit_depth))
        dit += _linear(d, 2 * d) + _linear(d, hid)
        per_embodiment = (_linear(self.max_state_dim, hid) + _linear(hid, d)                     # state encoder
                          + _linear(self.max_action_dim, d) + _linear(2 * d, d) + _linear(d, d)  # action encoder
                          + _linear(hid, hid) + _linear(hid, self.max_action_dim))               # action decoder
        tokens = (self.future_tokens + self.max_horizon) * d
        return backbone + adapter + dit + self.embodiments * per_embodiment + tokens

    def describe(self) -> str:
        """One line for ``loongforge list``."""
        return (f"GR00T-N1.6-style VLA policy (DiT flow matching), {size_label(self.num_params())} params, VL width "
                f"{self.width} x {self.depth}+{self.vl_layers} layers, DiT {self.dit_depth} blocks of "
                f"{self.dit_heads} heads x {self.dit_head_dim}, {self.embodiments} embodiments, "
                f"{self.inputs_summary()}")


FLAVORS: dict[str, Gr00tFlavor] = {
    "gr00t-tiny": Gr00tFlavor(),
    "gr00t-small": Gr00tFlavor(image_size=32, text_len=48, max_state_dim=64, max_action_dim=32, width=128, depth=4,
                               heads=4, head_dim=32, vl_layers=2, dit_heads=4, dit_head_dim=24, dit_depth=8,
                               hidden=64, future_tokens=8, time_channels=64),
}


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _block(dim: int, heads: int, head_dim: int, mlp_ratio: int, *, context: int | None, bias: bool,
           cond: int | None) -> int:
    """One attention + feed-forward layer: the norms (AdaLN from ``cond``, affine LayerNorm, or RMSNorm when
    ``bias`` is off), attention over ``context``-wide keys/values, and the feed-forward (GELU with biases, or
    bias-free GeGLU when ``bias`` is off)."""
    inner = heads * head_dim
    attention = _linear(dim, inner, bias) + 2 * _linear(context or dim, inner, bias) + _linear(inner, dim, bias)
    if cond:
        norms = _linear(cond, 2 * dim)
    else:
        norms = 2 * (2 * dim if bias else dim)
    ff = _linear(dim, mlp_ratio * dim) + _linear(mlp_ratio * dim, dim) if bias else 3 * mlp_ratio * dim * dim
    return norms + attention + ff
