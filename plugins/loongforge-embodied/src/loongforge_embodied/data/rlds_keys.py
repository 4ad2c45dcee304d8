"""Which RLDS features of a dataset are its cameras, state, action and instruction: one :class:`RLDSKeyMap` per
dataset, a few of the Open X-Embodiment (OXE) sets shipped by name.

Why maps: OXE datasets agree on the RLDS envelope (``steps/is_first``, ``steps/is_last``, ``steps/reward`` ...) but
not on what is inside a step -- bridge keeps a 7-D ``action`` and ``observation/state``, fractal (RT-1) splits its
action into ``world_vector``, ``rotation_delta`` and ``gripper_closedness_action`` and puts the instruction under
``observation``. A key map names the flattened Example keys (``steps/...``, as TFDS stores a step sequence) and
concatenates several into one state or action vector, in the order given, the way OXE's standardisation does.
Torch- and numpy-free (a mixture spec names maps when a config is checked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.errors import ConfigError


@dataclass(frozen=True)
class RLDSKeyMap:
    """The flattened RLDS feature keys of one dataset's steps, and the LeRobot names they become."""

    #: LeRobot camera key -> the RLDS feature holding that camera's encoded JPEG/PNG frames, one per step.
    cameras: dict[str, str] = field(default_factory=lambda: {"observation.images.image": "steps/observation/image"})
    #: Features concatenated (in this order) into ``observation.state``.
    state: tuple[str, ...] = ("steps/observation/state",)
    #: Features concatenated (in this order) into ``action``.
    action: tuple[str, ...] = ("steps/action",)
    #: The per-step instruction text (the first step's is the episode's task); ``None``: the episodes have none.
    instruction: str | None = "steps/language_instruction"
    #: The per-step reward, kept as ``next.reward`` by the conversion; ``None``: not kept.
    reward: str | None = "steps/reward"

    def __post_init__(self) -> None:
        if not self.action:
            raise ConfigError("an RLDS key map needs at least one action feature")
        for key in (*self.cameras.values(), *self.state, *self.action, self.instruction, self.reward):
            if key is not None and not key.startswith("steps/"):
                raise ConfigError(f"RLDS key '{key}' is not a step feature; step features are flattened as "
                                  "'steps/<name>' (e.g. steps/observation/image)")

    def required(self) -> list[str]:
        """Every key an episode must have for this map."""
        keys = [*self.cameras.values(), *self.state, *self.action, self.instruction, self.reward]
        return [key for key in keys if key is not None]


#: Shipped maps. ``default`` is the plain RLDS layout (what ``make-data synthetic-rlds`` writes); ``bridge`` is
#: OXE's ``bridge_dataset`` (BridgeData V2: wrist-free third-person ``image_0``, 7-D state and action);
#: ``fractal`` is OXE's ``fractal20220817_data`` (RT-1: the action as world vector + rotation delta + gripper, the
#: state as the base-pose-reached flag + gripper-closed flag, the instruction inside the observation).
KEY_MAPS: dict[str, RLDSKeyMap] = {
    "default": RLDSKeyMap(),
    "bridge": RLDSKeyMap(cameras={"observation.images.image_0": "steps/observation/image_0"},
                         state=("steps/observation/state",), action=("steps/action",),
                         instruction="steps/language_instruction"),
    "fractal": RLDSKeyMap(cameras={"observation.images.image": "steps/observation/image"},
                          state=("steps/observation/base_pose_tool_reached", "steps/observation/gripper_closed"),
                          action=("steps/action/world_vector", "steps/action/rotation_delta",
                                  "steps/action/gripper_closedness_action"),
                          instruction="steps/observation/natural_language_instruction"),
}


def key_map(name: str) -> RLDSKeyMap:
    """The shipped map ``name``; a :class:`ConfigError` listing the known ones otherwise."""
    try:
        return KEY_MAPS[name]
    except KeyError:
        raise ConfigError(f"unknown RLDS key map '{name}'; known: {', '.join(KEY_MAPS)} (or give the keys "
                          "themselves: cameras, state, action, instruction, reward)") from None
