"""``loongforge train`` for VLA policies: the core trainer's task (``loongforge.tasks``) over any policy flavor
(Pi0, Pi0.5, GR00T-style, ...) trained by flow matching on a LeRobotDataset, and the API that acts with it.

A flavor provides ``build_policy()``, ``frame_inputs(task, normalised_state)`` (its per-frame inputs besides
images: prompt ids, a padded state, ...) and ``flow_matching()`` (its time convention: ``sample_time``,
``noisy_actions``, ``euler_sample``); the policy is called as ``model(inputs, x_t, t) -> velocity`` with
``inputs`` the batched frame inputs plus ``"images"`` (B, cameras, 3, S, S) when ``flavor.cameras > 0``.

A run config names a flavor (``model: pi05-tiny``) and puts the policy options under ``task:``::

    task:
      data: null                 # a LeRobotDataset root (v2.1/v3.0) or an RLDS mixture spec (*.yaml); null writes
                                 # the synthetic reach set
      synthetic: {episodes: 64, length: 20, seed: 0}   # its size, when data is null
      held_out_episodes: 8       # the last episodes: never trained on, used by the evaluation
      action_horizon: 10         # action chunk length H
      normalization: quantiles   # states and actions: quantiles (Pi0.5), mean_std, min_max or identity
      cameras: null              # camera keys in order; null takes the dataset's first `cameras` of the flavor
      eval: {frames: 128, steps: 10, seed: 0}   # after training; frames: 0 skips it
      recompute: false           # activation checkpointing of every layer (policies/recompute.py)

Stats for the normaliser come from the training frames. With ``evaluation.interval > 0`` core's loop logs the
validation loss: the flow-matching loss of the trained policy on the held-out episodes' frames (or on every episode
of the LeRobotDataset root ``evaluation.data`` names), normalised with the training stats, with the same noise and
times at every evaluation. After training, ``finish`` samples action chunks for
held-out frames (Euler, ``eval.steps`` steps from seeded noise) and reports their mean squared error against the
recorded chunks, in the dataset's units over non-padded steps, next to two baselines that ignore the
observation: zeros and the training mean action.

Acting after training (closed-loop evaluation, a robot): ``task, model, _ = load_task_model(checkpoint)`` restores
the task's state (normaliser, dimensions, cameras, horizon; see :meth:`PolicyTask.state_dict`), then
``task.act(model, batched task.observation_inputs(text, state, images))`` gives chunks in the dataset's units.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from loongforge.config.plugin_sections import task_options
from loongforge.errors import ConfigError
from loongforge.tasks import TaskBase, sample_generators
from loongforge.train.media import MediaLog

from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.normalize import Normalizer
from loongforge_embodied.data.stats import compute_stats
from loongforge_embodied.policies import flow_matching as fm
from loongforge_embodied.policies.reach import write_reach_dataset
from loongforge_embodied.policies.recompute import checkpoint_layers
from loongforge_embodied.task_options import PolicyTaskOptions

STATE, ACTION = "observation.state", "action"
#: Batch keys that are targets or bookkeeping, not model inputs (``action_ids``: a token policy's targets).
NOT_INPUTS = ("actions", "action_is_pad", "index", "action_ids")


class PolicyFrames:
    """The frames of one split of a LeRobotDataset, read once and held in memory (small robot sets), and their
    training items: the model inputs of :meth:`PolicyTask.observation_inputs` plus ``actions`` (H,
    max_action_dim) normalised and zero-padded and ``action_is_pad`` (H,); ``raw_actions`` keeps the
    unnormalised chunks for evaluation."""

    def __init__(self, dataset: LeRobotDataset, cameras: list[str]) -> None:
        self.frames = [dataset[i] for i in range(len(dataset))]
        if not self.frames:
            raise ConfigError(f"{dataset.root}: the selected episodes have no frames")
        self.cameras = cameras
        self.state_dim = self.frames[0][STATE].shape[-1]
        self.action_dim = self.frames[0][ACTION].shape[-1]
        self.raw_actions = torch.stack([torch.as_tensor(f[ACTION], dtype=torch.float32) for f in self.frames])
        self.items: list[dict[str, torch.Tensor]] = []

    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        """Stats of the frames' own state and (first) action, from which the training split's normaliser is built."""
        return {key: compute_stats(np.stack([f[key] if key == STATE else f[key][0] for f in self.frames]))
                for key in (STATE, ACTION)}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def camera_image(image: np.ndarray, size: int) -> torch.Tensor:
    """A camera frame as the policy's (3, size, size) float in [0, 1]: CHW float as the dataset decodes it, or
    HWC uint8 as a camera or simulator renders it (converted the way the dataset does)."""
    if image.dtype == np.uint8:
        image = image.transpose(2, 0, 1).astype(np.float32) / 255.0
    out = torch.as_tensor(image, dtype=torch.float32)
    if out.shape[-2:] != (size, size):
        out = F.interpolate(out[None], size=(size, size), mode="bilinear", antialias=True)[0]
    return out


class PolicyTask(TaskBase):
    """Flow-matching training of one policy flavor on a LeRobotDataset, and acting with the trained policy; see the
    module docstring. The flavor supplies the model (``build_policy``), the per-frame inputs besides images
    (``frame_inputs``) and its flow-matching time convention (``flow_matching``), so this class serves every
    policy family.

    After :meth:`build_dataset` (or :meth:`load_state_dict` from a checkpoint's state) it holds what acting needs:
    the normaliser, the state/action dimensions, the camera keys in order and the action horizon.
    """

    #: Batch keys that are not model inputs (targets, bookkeeping): left out of what :meth:`act` is given.
    target_keys: ClassVar[tuple[str, ...]] = NOT_INPUTS
    #: (B, frames, S, S, 3) uint8 frames the policy predicted in its last :meth:`act` call, one row per
    #: observation; ``None`` for a policy that predicts actions only (a world-action model sets them).
    predicted_frames: np.ndarray | None = None

    def __init__(self, flavor: Any, config: Any) -> None:
        self.options: PolicyTaskOptions = task_options(flavor, config)
        self.synthetic = self.options.synthetic
        self.eval_options = self.options.eval
        self.flavor = flavor.with_overrides(**config.model.overrides) if config.model.overrides else flavor
        self.seed = config.run.seed
        self.output_dir = Path(config.run.output_dir)
        self.source = config.source
        #: Training steps taken (with the sample index, it seeds each sample's noise and time).
        self.steps = 0
        self.action_horizon = self.options.action_horizon
        self.train: PolicyFrames | None = None
        #: Set by build_dataset / load_state_dict: the training split's stats and normaliser, dims and cameras.
        self.stats: dict[str, dict[str, np.ndarray]] | None = None
        self.normalizer: Normalizer | None = None
        self.state_dim: int | None = None
        self.action_dim: int | None = None
        self.camera_keys: list[str] | None = None

    @property
    def flow(self) -> Any:
        """The flavor's flow-matching convention (a task whose policy is not trained by flow matching never asks)."""
        return self.flavor.flow_matching()

    # -- data ------------------------------------------------------------------------------------------------
    def _root(self) -> Path:
        if self.options.data is not None:
            return self.options.data_root(self.output_dir)
        s = self.synthetic
        name = f"reach-{s.episodes}x{s.length}-{self.flavor.image_size}px-seed{s.seed}"
        return write_reach_dataset(self.output_dir / "data" / name, episodes=s.episodes, length=s.length,
                                   image_size=self.flavor.image_size, seed=s.seed)

    def _split(self, root: Path) -> tuple[list[int], list[int]]:
        return self.options.split([ep.index for ep in LeRobotDataset(root).episodes], root, self.source)

    def _frames(self, root: Path, episodes: list[int]) -> PolicyFrames:
        dataset = LeRobotDataset(root, action_horizon=self.action_horizon, episodes=episodes)
        cameras = self.options.camera_keys(self.flavor.cameras, dataset.camera_keys, root, self.source,
                                           dataset.info.depth_keys)
        return PolicyFrames(dataset, cameras)

    def build_dataset(self) -> PolicyFrames:
        """The training episodes, normalised with their own stats (``task.normalization``)."""
        root = self._root()
        train_episodes, _ = self._split(root)
        self.train = self._frames(root, train_episodes)
        self.flavor.check_dims(self.train.state_dim, self.train.action_dim, root)
        mode = self.options.normalization
        self._set_inference_state(self.train.stats(), {STATE: mode, ACTION: mode}, state_dim=self.train.state_dim,
                                  action_dim=self.train.action_dim, camera_keys=self.train.cameras)
        self.fit_targets(root, train_episodes, self.train)
        self.train.items = [self.training_item(frame) for frame in self.train.frames]
        return self.train

    def fit_targets(self, root: Path, episodes: list[int], frames: PolicyFrames) -> None:
        """Called once the training frames are read and the normaliser is set, before the items are made: where a
        task fits what its targets need from the training split (a token policy's action tokenizer). Flow matching
        needs nothing more."""

    def _set_inference_state(self, stats: dict[str, dict[str, np.ndarray]], modes: dict[str, str], *,
                             state_dim: int, action_dim: int, camera_keys: list[str]) -> None:
        self.stats, self.normalizer = stats, Normalizer(stats, modes)
        self.state_dim, self.action_dim, self.camera_keys = state_dim, action_dim, list(camera_keys)

    def _require_normaliser(self) -> None:
        """A one-line :class:`ConfigError` when the task cannot act yet (no normaliser: neither trained nor loaded)."""
        if self.normalizer is None:
            raise ConfigError("the policy task has no normaliser yet: call build_dataset(), or load the task from a "
                              "checkpoint (loongforge.train.task_checkpoint.load_task_model)")

    def observation_inputs(self, task_text: str, state: np.ndarray,
                           images: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
        """One frame's model inputs (unbatched): the flavor's ``frame_inputs`` of the normalised state and, when
        the flavor has cameras, ``"images"`` (cameras, 3, S, S) from ``images[key]`` for each camera key in order
        (CHW float in [0, 1] or HWC uint8). ``state`` is in the dataset's units. Training items use this too."""
        self._require_normaliser()
        state = np.asarray(state, dtype=np.float64)
        if state.shape != (self.state_dim,):
            raise ValueError(f"state has shape {state.shape}; the policy was trained on {self.state_dim} dimensions")
        normalised = torch.as_tensor(self.normalizer.normalize(STATE, state), dtype=torch.float32)
        inputs = self.flavor.frame_inputs(task_text, normalised)
        if self.camera_keys:
            missing = [key for key in self.camera_keys if key not in (images or {})]
            if missing:
                raise ValueError(f"images lack camera(s) {missing}; the policy reads {self.camera_keys}")
            size = self.flavor.image_size
            inputs["images"] = torch.stack([camera_image(images[key], size) for key in self.camera_keys])
        return inputs

    def training_item(self, frame: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A LeRobotDataset frame as a training sample (normalised with the task's normaliser)."""
        actions = torch.zeros(frame[ACTION].shape[0], self.flavor.max_action_dim)
        actions[:, :self.action_dim] = torch.as_tensor(
            self.normalizer.normalize(ACTION, frame[ACTION].astype(np.float64)), dtype=torch.float32)
        return {**self.observation_inputs(frame["task"], frame[STATE], {k: frame[k] for k in self.camera_keys}),
                "actions": actions, "action_is_pad": torch.as_tensor(frame[f"{ACTION}_is_pad"], dtype=torch.bool)}

    # -- training --------------------------------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        """The flavor's policy; with ``task.recompute`` its layers recompute their activations in backward."""
        model = self.flavor.build_policy()
        if self.options.recompute:
            checkpoint_layers(model)
        return model

    def validation_dataset(self, paths: list[str], samples: int) -> PolicyFrames:
        """``evaluation:``: the held-out episodes' frames, or every episode of the one LeRobotDataset root
        ``paths`` names, as training items normalised with the training split's normaliser (all frames are read;
        the evaluation takes the first ``samples``)."""
        if self.options.validation_paths(paths, self.source):
            root = Path(paths[0]).expanduser()
            episodes = [ep.index for ep in LeRobotDataset(root).episodes]
        else:
            root = self._root()
            _, episodes = self._split(root)
        frames = self._frames(root, episodes)
        dims = (frames.state_dim, frames.action_dim)
        if dims != (self.state_dim, self.action_dim):
            raise ConfigError(f"{self.source}: evaluation.data {root} has state/action dimensions {dims}; the "
                              f"training data has {(self.state_dim, self.action_dim)}")
        frames.items = [self.training_item(frame) for frame in frames.frames]
        return frames

    def training_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow-matching loss with noise and time drawn per sample from (seed, step, dataset index): the same
        draws on one process or spread over data-parallel ranks, so every layout trains the same run."""
        self.steps += 1
        return self.validation_loss(model, batch, sample_generators(self.seed, self.steps, batch["index"]))

    def validation_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                        generators: list[torch.Generator]) -> torch.Tensor:
        """The flow-matching loss of ``batch`` with noise and time from ``generators``, one per sample (training
        and validation differ only in where the draws come from)."""
        inputs, x_t, t, target = self.flow_batch(batch, generators)
        return fm.masked_loss(model(inputs, x_t, t), target, batch["action_is_pad"], self.action_dim)

    def flow_batch(self, batch: dict[str, torch.Tensor], generators: list[torch.Generator]) -> tuple[
            dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(model inputs, x_t, t, target velocity)`` of ``batch``, noise and time drawn from ``generators``."""
        actions = batch["actions"]
        t = self.flow.sample_time(generators).to(actions.device)
        noise = fm.sample_noise(actions.shape[1:], generators).to(actions.device)
        x_t, target = self.flow.noisy_actions(actions, noise, t)
        return {key: value for key, value in batch.items() if key not in NOT_INPUTS}, x_t, t, target

    def state_dict(self) -> dict[str, Any]:
        """The step count and everything acting needs after a restart, as plain python values (checkpoints load
        it with ``torch.load(weights_only=True)``)."""
        state: dict[str, Any] = {"steps": self.steps, "action_horizon": self.action_horizon}
        if self.normalizer is not None:
            state.update(state_dim=self.state_dim, action_dim=self.action_dim, camera_keys=list(self.camera_keys),
                         normalizer={"modes": dict(self.normalizer.modes),
                                     "stats": {key: {name: np.asarray(v).tolist() for name, v in values.items()}
                                               for key, values in self.stats.items()}})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.action_horizon = int(state.get("action_horizon", self.action_horizon))
        saved = state.get("normalizer")
        if saved is not None:
            stats = {key: {name: np.asarray(v, dtype=np.float64) for name, v in values.items()}
                     for key, values in saved["stats"].items()}
            self._set_inference_state(stats, saved["modes"], state_dim=int(state["state_dim"]),
                                      action_dim=int(state["action_dim"]), camera_keys=state["camera_keys"])

    # -- acting and evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], *, steps: int = 10,
            seed: int | Sequence[int] = 0) -> np.ndarray:
        """(B, H, action_dim) action chunks in the dataset's units for batched ``inputs`` (stacked
        :meth:`observation_inputs`): the flavor's Euler integration over ``steps`` steps from noise seeded by
        ``seed``, then unnormalised (float64). A sequence of B seeds seeds each sample's noise on its own, so a
        sample's chunk does not depend on what else is in the batch (a batched closed-loop evaluation acts as a
        serial one); an integer seeds the whole batch's noise at once."""
        self._require_normaliser()
        device = next(model.parameters()).device
        inputs = {key: value.to(device) for key, value in inputs.items()}
        (noise,) = seeded_noise([(self.action_horizon, self.flavor.max_action_dim)], inputs, seed, device)
        chunks = self.flow.euler_sample(lambda x, t: model(inputs, x, t), noise, steps)
        return self.normalizer.unnormalize(ACTION, chunks[..., :self.action_dim].double().cpu().numpy())

    def finish(self, model: torch.nn.Module, output_dir: Path, media: MediaLog) -> dict[str, Any]:
        """Held-out action MSE of sampled chunks against the recorded ones and two baselines (also written to
        ``<output_dir>/eval.json``)."""
        opts = self.eval_options
        root = self._root()
        _, held_out = self._split(root)
        if opts.frames <= 0 or not held_out:
            return {}
        frames = self._frames(root, held_out)
        count = len(frames.frames)
        picked = np.linspace(0, count - 1, min(opts.frames, count)).round().astype(int).tolist()
        items = [self.training_item(frames.frames[i]) for i in picked]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0] if key not in self.target_keys}
        model.eval()
        predicted = torch.as_tensor(self.act(model, batch, steps=opts.steps, seed=opts.seed))
        truth = frames.raw_actions[picked].double()
        valid = ~torch.stack([item["action_is_pad"] for item in items])
        mean = torch.as_tensor(self.stats[ACTION]["mean"])

        def mse(guess: torch.Tensor) -> float:
            return float((((guess - truth) ** 2).mean(-1) * valid).sum() / valid.sum())

        scores = {"policy": mse(predicted), "mean_baseline": mse(mean.expand_as(truth)),
                  "zero_baseline": mse(torch.zeros_like(truth))}
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "eval.json").write_text(json.dumps({"held_out_action_mse": scores, "frames": len(items),
                                                                "episodes": held_out}, indent=1))
        return {"held_out_action_mse": scores}

    def sample_files(self, model: torch.nn.Module, prompts: list[str], out_dir: Path, *, steps: int, guidance: float,
                     seed: int, fmt: str) -> list[Path]:
        """Policies act on observations, not prompts alone: ``loongforge sample`` has nothing to write."""
        raise ConfigError("a VLA policy samples actions from observations; `loongforge sample` (prompts to media) "
                          "does not apply (training reports held-out action error in eval.json)")


def seeded_noise(shapes: Sequence[tuple[int, ...]], inputs: dict[str, torch.Tensor], seed: int | Sequence[int],
                 device: torch.device) -> list[torch.Tensor]:
    """Standard normal noise of each of ``shapes`` for a batch of ``inputs`` (B rows), on ``device``: an integer
    ``seed`` draws the whole batch's noise from one generator, shape after shape; a sequence of B seeds draws each
    row's from its own generator, so a row's noise does not depend on what else is in the batch."""
    batch = next(iter(inputs.values())).shape[0]
    if isinstance(seed, int):
        generator = torch.Generator().manual_seed(seed)
        return [torch.randn(batch, *shape, generator=generator).to(device) for shape in shapes]
    if len(seed) != batch:
        raise ValueError(f"{len(seed)} seeds for a batch of {batch} observations")
    generators = [torch.Generator().manual_seed(s) for s in seed]
    rows = [[torch.randn(shape, generator=g) for shape in shapes] for g in generators]
    return [torch.stack([row[i] for row in rows]).to(device) for i in range(len(shapes))]
