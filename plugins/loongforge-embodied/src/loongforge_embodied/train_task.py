"""``loongforge train`` for VLA policies: the core trainer's task (``loongforge.tasks``) over a Pi0.5-style policy
trained by flow matching on a LeRobotDataset.

A run config names a flavor (``model: pi05-tiny``) and puts the policy options under ``task:``::

    task:
      data: null                 # a LeRobotDataset root (v2.1/v3.0); null writes the synthetic reach set
      synthetic: {episodes: 64, length: 20, seed: 0}   # its size, when data is null
      held_out_episodes: 8       # the last episodes: never trained on, used by the evaluation
      action_horizon: 10         # action chunk length H
      normalization: quantiles   # states and actions: quantiles (Pi0.5), mean_std, min_max or identity
      cameras: null              # camera keys in order; null takes the dataset's first `cameras` of the flavor
      eval: {frames: 128, steps: 10, seed: 0}   # after training; frames: 0 skips it

Stats for the normaliser come from the training frames. After training, ``finish`` samples action chunks for
held-out frames (Euler, ``eval.steps`` steps from seeded noise) and reports their mean squared error against the
recorded chunks, in the dataset's units over non-padded steps, next to two baselines that ignore the
observation: zeros and the training mean action.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from loongforge.errors import ConfigError
from loongforge.tasks import checked_options as checked
from loongforge.tasks import sample_generators

from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.data.normalize import MODES, Normalizer
from loongforge_embodied.data.stats import compute_stats
from loongforge_embodied.policies import flow_matching as fm
from loongforge_embodied.policies.flavors import Pi05Flavor
from loongforge_embodied.policies.pi05 import Pi05Policy
from loongforge_embodied.policies.prompt import prompt_tokens
from loongforge_embodied.policies.reach import write_reach_dataset

#: ``task:`` keys and their defaults.
OPTIONS: dict[str, Any] = {"data": None, "synthetic": {}, "held_out_episodes": 8, "action_horizon": 10,
                           "normalization": "quantiles", "cameras": None, "eval": {}}
SYNTHETIC_OPTIONS: dict[str, Any] = {"episodes": 64, "length": 20, "seed": 0}
EVAL_OPTIONS: dict[str, Any] = {"frames": 128, "steps": 10, "seed": 0}
STATE, ACTION = "observation.state", "action"


class PolicyFrames:
    """Frames of a LeRobotDataset as the policy's tensors, converted once and held in memory (small robot sets).

    Items: ``images`` (cameras, 3, S, S), ``tokens`` (prompt ids), ``actions`` (H, max_action_dim) normalised and
    zero-padded, ``action_is_pad`` (H,); ``raw_actions`` keeps the unnormalised chunks for evaluation.
    """

    def __init__(self, dataset: LeRobotDataset, flavor: Pi05Flavor, cameras: list[str],
                 normalizer: Normalizer | None = None) -> None:
        frames = [dataset[i] for i in range(len(dataset))]
        if not frames:
            raise ConfigError(f"{dataset.root}: the selected episodes have no frames")
        #: Stats of the frames' own state and action (for the training split, whose normaliser they build).
        self.stats = None if normalizer is not None else {
            key: compute_stats(np.stack([f[key] if key == STATE else f[key][0] for f in frames]))
            for key in (STATE, ACTION)}
        self.action_dim = frames[0][ACTION].shape[-1]
        if self.action_dim > flavor.max_action_dim:
            raise ConfigError(f"{dataset.root}: actions have {self.action_dim} dimensions, the flavor takes at most "
                              f"{flavor.max_action_dim} (raise model.overrides.max_action_dim)")
        self.flavor, self.cameras, self.frames = flavor, cameras, frames
        self.items: list[dict[str, torch.Tensor]] = []
        self.raw_actions = torch.stack([torch.as_tensor(f[ACTION], dtype=torch.float32) for f in frames])
        if normalizer is not None:
            self.normalize(normalizer)

    def normalize(self, normalizer: Normalizer) -> None:
        """Build the items with ``normalizer`` (the training split's, for held-out frames too)."""
        flavor = self.flavor
        self.items = []
        for frame in self.frames:
            state = torch.as_tensor(normalizer.normalize(STATE, frame[STATE].astype(np.float64)), dtype=torch.float32)
            actions = torch.zeros(frame[ACTION].shape[0], flavor.max_action_dim)
            actions[:, :self.action_dim] = torch.as_tensor(normalizer.normalize(ACTION, frame[ACTION].astype(
                np.float64)), dtype=torch.float32)
            self.items.append({
                "images": torch.stack([_image(frame[key], flavor.image_size) for key in self.cameras]),
                "tokens": prompt_tokens(frame["task"], state, text_len=flavor.text_len,
                                        max_state_dim=flavor.max_state_dim, state_bins=flavor.state_bins),
                "actions": actions,
                "action_is_pad": torch.as_tensor(frame[f"{ACTION}_is_pad"], dtype=torch.bool),
            })

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def _image(chw: np.ndarray, size: int) -> torch.Tensor:
    image = torch.as_tensor(chw, dtype=torch.float32)
    if image.shape[-2:] != (size, size):
        image = F.interpolate(image[None], size=(size, size), mode="bilinear", antialias=True)[0]
    return image


class PolicyTask:
    """Flow-matching training of one Pi0.5-style flavor on a LeRobotDataset; see the module docstring."""

    def __init__(self, flavor: Pi05Flavor, config: Any) -> None:
        where = f"task in {config.source}"
        self.options = checked(dict(config.task), OPTIONS, where)
        self.synthetic = checked(dict(self.options["synthetic"]), SYNTHETIC_OPTIONS,
                                 f"task.synthetic in {config.source}")
        self.eval_options = checked(dict(self.options["eval"]), EVAL_OPTIONS, f"task.eval in {config.source}")
        if self.options["normalization"] not in MODES:
            raise ConfigError(f"{where}: normalization '{self.options['normalization']}' is unknown; choose one of "
                              f"{', '.join(MODES)}")
        self.flavor = flavor.with_overrides(**config.model.overrides) if config.model.overrides else flavor
        self.seed = config.run.seed
        self.output_dir = Path(config.run.output_dir)
        self.source = config.source
        #: Training steps taken (with the sample index, it seeds each sample's noise and time).
        self.steps = 0
        self.train: PolicyFrames | None = None
        self.normalizer: Normalizer | None = None

    # -- data ------------------------------------------------------------------------------------------------
    def _root(self) -> Path:
        if self.options["data"] is not None:
            return Path(self.options["data"]).expanduser()
        s = self.synthetic
        name = f"reach-{s['episodes']}x{s['length']}-{self.flavor.image_size}px-seed{s['seed']}"
        return write_reach_dataset(self.output_dir / "data" / name, episodes=s["episodes"], length=s["length"],
                                   image_size=self.flavor.image_size, seed=s["seed"])

    def _split(self, root: Path) -> tuple[list[int], list[int]]:
        all_episodes = [ep.index for ep in LeRobotDataset(root).episodes]
        held = int(self.options["held_out_episodes"])
        if not 0 <= held < len(all_episodes):
            raise ConfigError(f"task.held_out_episodes in {self.source}: {held}, but {root} has "
                              f"{len(all_episodes)} episodes (keep at least one for training)")
        return all_episodes[:len(all_episodes) - held], all_episodes[len(all_episodes) - held:]

    def _frames(self, root: Path, episodes: list[int], normalizer: Normalizer | None) -> PolicyFrames:
        dataset = LeRobotDataset(root, action_horizon=int(self.options["action_horizon"]), episodes=episodes)
        cameras = self.options["cameras"] or dataset.camera_keys[:self.flavor.cameras]
        if len(cameras) != self.flavor.cameras or set(cameras) - set(dataset.camera_keys):
            raise ConfigError(f"task.cameras in {self.source}: {cameras}; the flavor takes {self.flavor.cameras} of "
                              f"{root}'s cameras {dataset.camera_keys}")
        return PolicyFrames(dataset, self.flavor, list(cameras), normalizer)

    def build_dataset(self) -> PolicyFrames:
        """The training episodes, normalised with their own stats (``task.normalization``)."""
        root = self._root()
        train_episodes, _ = self._split(root)
        self.train = self._frames(root, train_episodes, None)
        mode = self.options["normalization"]
        self.normalizer = Normalizer(self.train.stats, {STATE: mode, ACTION: mode})
        self.train.normalize(self.normalizer)
        return self.train

    # -- training --------------------------------------------------------------------------------------------
    def build_model(self) -> Pi05Policy:
        return Pi05Policy(self.flavor)

    def training_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow-matching loss with noise and time drawn per sample from (seed, step, dataset index): the same
        draws on one process or spread over data-parallel ranks, so every layout trains the same run."""
        self.steps += 1
        generators = sample_generators(self.seed, self.steps, batch["index"])
        actions = batch["actions"]
        t = fm.sample_time(generators).to(actions.device)
        noise = fm.sample_noise(actions.shape[1:], generators).to(actions.device)
        x_t, target = fm.noisy_actions(actions, noise, t)
        velocity = model(batch["images"], batch["tokens"], x_t, t)
        return fm.masked_loss(velocity, target, batch["action_is_pad"], self.train.action_dim)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    # -- evaluation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample_actions(self, model: torch.nn.Module, images: torch.Tensor, tokens: torch.Tensor, horizon: int, *,
                       steps: int, seed: int) -> torch.Tensor:
        """Normalised (B, H, max_action_dim) chunks by Euler integration from seeded noise."""
        noise = torch.randn(images.shape[0], horizon, self.flavor.max_action_dim,
                            generator=torch.Generator().manual_seed(seed))
        return fm.euler_sample(lambda x, t: model(images, tokens, x, t), noise, steps)

    def finish(self, model: torch.nn.Module, output_dir: Path) -> dict[str, Any]:
        """Held-out action MSE of sampled chunks against the recorded ones and two baselines (also written to
        ``<output_dir>/eval.json``)."""
        opts = self.eval_options
        root = self._root()
        _, held_out = self._split(root)
        if opts["frames"] <= 0 or not held_out:
            return {}
        frames = self._frames(root, held_out, self.normalizer)
        picked = np.linspace(0, len(frames) - 1, min(int(opts["frames"]), len(frames))).round().astype(int).tolist()
        batch = {key: torch.stack([frames[i][key] for i in picked]) for key in ("images", "tokens", "action_is_pad")}
        model.eval()
        chunks = self.sample_actions(model, batch["images"], batch["tokens"], int(self.options["action_horizon"]),
                                     steps=int(opts["steps"]), seed=int(opts["seed"]))
        dim = frames.action_dim
        predicted = torch.as_tensor(self.normalizer.unnormalize(ACTION, chunks[..., :dim].double().numpy()))
        truth = frames.raw_actions[picked].double()
        valid = ~batch["action_is_pad"]
        mean = torch.as_tensor(self.train.stats[ACTION]["mean"])

        def mse(guess: torch.Tensor) -> float:
            return float((((guess - truth) ** 2).mean(-1) * valid).sum() / valid.sum())

        scores = {"policy": mse(predicted), "mean_baseline": mse(mean.expand_as(truth)),
                  "zero_baseline": mse(torch.zeros_like(truth))}
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "eval.json").write_text(json.dumps({"held_out_action_mse": scores, "frames": len(picked),
                                                                "episodes": held_out}, indent=1))
        return {"held_out_action_mse": scores}

    def sample_files(self, model: torch.nn.Module, prompts: list[str], out_dir: Path, *, steps: int, guidance: float,
                     seed: int, fmt: str) -> list[Path]:
        """Policies act on observations, not prompts alone: ``loongforge sample`` has nothing to write."""
        raise ConfigError("a VLA policy samples actions from observations; `loongforge sample` (prompts to media) "
                          "does not apply (training reports held-out action error in eval.json)")
