"""What the ``embodied`` plugin adds to the ``loongforge`` command line.

- ``loongforge collect ROOT``: Meta-World's scripted expert recorded as a LeRobotDataset (:mod:`.sim.collect`);
- ``loongforge fit-action-tokenizer DATASET --kind KIND --out DIR``: an action tokenizer (``uniform-bins``,
  ``quantile-bins``, ``fast``) fitted on a dataset's action chunks, with its round-trip error and compression
  (:mod:`.action_tokens.command`);
- ``loongforge serve CKPT``: a policy checkpoint behind a websocket (:mod:`.sim.server`);
- ``loongforge eval SOURCE``: closed-loop Meta-World success rate of a policy checkpoint, of a policy server
  (``ws://host:port``) or of uniform random actions (``random``) (:mod:`.sim.evaluate`);
- ``loongforge convert``: Pi0.5 weights from LeRobot / OpenPI safetensors into ours, and back
  (:mod:`.convert_lerobot`);
- ``loongforge convert rlds-to-lerobot SOURCE OUT``: RLDS / Open X-Embodiment episodes (TFDS TFRecord shards) as a
  LeRobotDataset v3.0 (:mod:`.data.rlds_lerobot`), a conversion direction this plugin adds to core's ``convert``;
- ``loongforge make-data synthetic-episodes ROOT``: a small synthetic LeRobotDataset with camera videos
  (:mod:`.data.synthetic`), for demos and tests without downloads; ``synthetic-rlds ROOT`` the same kind of
  episodes as a TFDS RLDS set (:mod:`.data.rlds_writer`).

Torch-free and simulator-free: ``loongforge eval`` and ``convert`` ask every plugin's claims about a source, so the
claims here read only a checkpoint's saved config or a safetensors header, and ``make-data`` sets up every
generator's options to list them, so those are declared here; the commands load when they run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loongforge.claims import checkpoint_model
from loongforge.commands import CommandRegistry

#: ``loongforge eval random``: the uniform-random baseline alone.
RANDOM_SOURCE = "random"
#: Where LeRobot / OpenPI keep the Pi0.5 weights in a state dict (after LeRobot's optional ``model.`` prefix).
_LEROBOT_PREFIX, _PI05_ROOT = "model.", "paligemma_with_expert."


def is_server(source: str) -> bool:
    return source.startswith(("ws://", "wss://"))


def is_random(source: str) -> bool:
    return source == RANDOM_SOURCE and not Path(source).exists()


def claims_eval(source: str, *, trust_code: bool) -> bool:
    """A policy server's address, ``random``, or a LoongForge checkpoint of a policy."""
    from loongforge_embodied.policies.flavor_base import PolicyFlavor

    return is_server(source) or is_random(source) or isinstance(checkpoint_model(source, trust_code=trust_code),
                                                                  PolicyFlavor)


def safetensors_file(source: str | Path) -> Path:
    """``source`` itself, or the ``model.safetensors`` of a checkpoint directory (LeRobot's ``pretrained_model``)."""
    path = Path(source).expanduser()
    return path / "model.safetensors" if path.is_dir() else path


def safetensors_header(source: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor names, ``__metadata__``), read without torch; ``{}`` when
    ``source`` is not one."""
    try:
        with safetensors_file(source).open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size)) if 0 < size < 1 << 27 else {}
    except (OSError, ValueError):
        return {}
    return header if isinstance(header, dict) else {}


def claims_lerobot(source: str, *, trust_code: bool) -> bool:
    """LeRobot / OpenPI Pi0.5 weights: tensor names under ``paligemma_with_expert.`` (``model.``-prefixed or not)."""
    return any(name.removeprefix(_LEROBOT_PREFIX).startswith(_PI05_ROOT) for name in safetensors_header(source))


def claims_ours(source: str, *, trust_code: bool) -> bool:
    """Our Pi0.5 safetensors: the flavor recorded in the metadata by the import."""
    return "flavor" in safetensors_header(source).get("__metadata__", {})


def claims_rlds(source: str, *, trust_code: bool) -> bool:
    """A TFDS dataset directory: ``dataset_info.json`` beside ``*.tfrecord-*`` shards (the names
    :mod:`loongforge_embodied.data.rlds` reads)."""
    path = Path(source).expanduser()
    return (path / "dataset_info.json").is_file() and any(path.glob("*.tfrecord-*"))


def _positive_int(text: str) -> int:
    """An argparse ``type``: an integer above zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_lerobot_version(parser: argparse.ArgumentParser) -> None:
    """``--lerobot-version``: whose dataset writer to follow (``lerobot_writer.LEROBOT_RELEASES``; this module stays
    free of the writer's imports)."""
    parser.add_argument("--lerobot-version", default="0.4", choices=("0.4", "0.6"),
                        help="follow LeRobot 0.4's writer (default) or 0.6's (v3.0 only: per-video encoder settings, "
                             "subtasks as language columns)")


def configure_synthetic_episodes(parser: argparse.ArgumentParser) -> None:
    """The options of ``loongforge make-data synthetic-episodes`` (run by :func:`loongforge_embodied.data.synthetic.
    run`)."""
    parser.add_argument("root", help="output directory (must not hold a dataset yet)")
    parser.add_argument("--version", default="v3.0", choices=("v2.1", "v3.0"), help="LeRobot format version")
    parser.add_argument("--codec", default="h264", choices=("h264", "av1", "png"),
                        help="camera frames as H.264 or AV1 mp4 videos, or PNG images inside the parquet files")
    parser.add_argument("--lengths", type=_positive_int, nargs="+", metavar="FRAMES",
                        help="frames of each episode, one episode per length (default: the test set's 12 15 10)")
    parser.add_argument("--fps", type=_positive_int, default=10, help="frame rate recorded in the dataset")
    parser.add_argument("--subtasks", action="store_true",
                        help="annotate each episode with two subtasks (LeRobot 0.4: subtask_index; 0.6: language rows)")
    add_lerobot_version(parser)


def register_commands(commands: CommandRegistry) -> None:
    module = "loongforge_embodied"
    commands.add("collect", help="record Meta-World's scripted expert as a LeRobotDataset",
                 configure=f"{module}.sim.collect:configure", run=f"{module}.sim.collect:run")
    commands.add("fit-action-tokenizer", help="fit an action tokenizer (bins, FAST) on a LeRobotDataset's action "
                                              "chunks; print its round-trip error and compression",
                 configure=f"{module}.action_tokens.command:configure", run=f"{module}.action_tokens.command:run")
    commands.add("serve", help="serve a policy checkpoint over a websocket (msgpack messages)",
                 configure=f"{module}.sim.server:configure", run=f"{module}.sim.server:run")
    commands.add_handler("eval", "metaworld-closed-loop", claims=claims_eval,
                         accepts="a LoongForge policy checkpoint, a policy server ws://HOST:PORT, or 'random' "
                                 "(Meta-World success rate)",
                         configure=f"{module}.sim.evaluate:configure", run=f"{module}.sim.evaluate:run")
    commands.add_handler("convert hf-to-mcore", "lerobot-pi05", claims=claims_lerobot,
                         accepts="LeRobot / OpenPI Pi0.5 safetensors (a file, or a directory with model.safetensors)",
                         configure=f"{module}.convert_lerobot:configure_from_lerobot",
                         run=f"{module}.convert_lerobot:run_from_lerobot")
    commands.add_handler("convert mcore-to-hf", "pi05-to-lerobot", claims=claims_ours,
                         accepts="our Pi0.5 safetensors (written by the LeRobot import, flavor in its metadata)",
                         configure=f"{module}.convert_lerobot:configure_to_lerobot",
                         run=f"{module}.convert_lerobot:run_to_lerobot")
    commands.add_conversion("rlds-to-lerobot", help="RLDS / Open X-Embodiment episodes (a TFDS dataset directory) -> "
                                                    "LeRobotDataset v3.0", source="a TFDS RLDS dataset directory "
                                                    "(dataset_info.json and *.tfrecord-* shards)")
    commands.add_handler("convert rlds-to-lerobot", "rlds-tfrecord", claims=claims_rlds,
                         accepts="a TFDS dataset directory: dataset_info.json beside *.tfrecord-NNNNN-of-NNNNN shards",
                         configure=f"{module}.data.rlds_lerobot:configure", run=f"{module}.data.rlds_lerobot:run")
    commands.add_generator("synthetic-rlds", help="a small synthetic RLDS dataset in TFDS format (TFRecord shards of "
                                                  "tf.train.Example episodes, PNG frames)",
                           configure=f"{module}.data.rlds_writer:configure", run=f"{module}.data.rlds_writer:run")
    commands.add_generator("synthetic-episodes", help="a small synthetic LeRobotDataset (states, actions, camera "
                                                      "videos of a moving square)",
                           configure=f"{module}.commands:configure_synthetic_episodes",
                           run=f"{module}.data.synthetic:run")
