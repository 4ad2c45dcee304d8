"""``loongforge train`` for world-action models (``wam-*``): the policy task's data path, normaliser and acting API
(:class:`~loongforge_embodied.train_task.PolicyTask`) with the future camera frames as a second target.

Each training frame carries, beside its action chunk, the latents of the camera frames ``frame_stride``,
``2 * frame_stride``, ... frames later (``future``, (future_frames, 3, L, L); past an episode's end its last frame
repeats -- the scene holds still once the expert stops). One flow-matching time and noise per sample
(:mod:`~loongforge_embodied.policies.flow_matching`) make both noisy; the loss is
``video_loss_weight * video + action_loss_weight * action``, each term a velocity mean squared error
(:meth:`WorldActionTask.loss_terms`; the action term masks steps past the episode end, as every policy's does).

Acting (:meth:`WorldActionTask.act`) integrates both together from seeded noise and returns the actions as every
policy does; the frames it imagined on the way are kept in ``predicted_frames`` (decoded, uint8), which ``loongforge
eval --videos`` writes beside each rollout. After training, ``finish`` adds to ``eval.json`` the held-out loss terms
and the error of sampled future latents against the recorded ones and against a still-scene baseline (the observed
frame repeated), and writes ``predicted-frames.gif``: a held-out episode chunk by chunk, the observed frame and the
recorded future above, the observed frame and the predicted future below.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from loongforge.train.media import MediaLog, gif_bytes

from loongforge_embodied.data.lerobot_dataset import LeRobotDataset
from loongforge_embodied.policies import flow_matching as fm
from loongforge_embodied.policies.wam import decode_frames, encode_frames
from loongforge_embodied.train_task import (
    ACTION,
    NOT_INPUTS,
    PolicyFrames,
    PolicyTask,
    camera_image,
    seeded_noise,
)

#: Written by ``finish`` next to ``eval.json``.
PREDICTED_GIF = "predicted-frames.gif"
#: Side of each frame in the predicted-frame videos (the model's frames are upsampled to it).
VIDEO_FRAME = 64


class WorldActionTask(PolicyTask):
    """Joint video-latent and action flow matching of a :class:`~loongforge_embodied.policies.wam_flavors.WamFlavor`
    model; see the module docstring."""

    target_keys: ClassVar[tuple[str, ...]] = (*NOT_INPUTS, "future")

    def __init__(self, flavor: Any, config: Any) -> None:
        super().__init__(flavor, config)
        self.frame_stride = self.options.frame_stride
        self.loss_weights = {"video": self.options.video_loss_weight, "action": self.options.action_loss_weight}

    # -- data ------------------------------------------------------------------------------------------------
    def _frames(self, root: Path, episodes: list[int]) -> PolicyFrames:
        """The split's frames, each camera read at the observed frame and the ``future_frames`` later ones."""
        probe = LeRobotDataset(root)
        cameras = self.options.camera_keys(self.flavor.cameras, probe.camera_keys, root, self.source)
        offsets = [k * self.frame_stride / probe.fps for k in range(self.flavor.future_frames + 1)]
        dataset = LeRobotDataset(root, action_horizon=self.action_horizon, episodes=episodes,
                                 delta_timestamps={key: offsets for key in cameras})
        return PolicyFrames(dataset, cameras)

    def training_item(self, frame: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The policy task's item of the observed frame plus ``future`` (future_frames, 3, L, L) latents."""
        (key,) = self.camera_keys
        clip = frame[key]
        future = torch.stack([camera_image(image, self.flavor.image_size) for image in clip[1:]])
        return {**super().training_item({**frame, key: clip[0]}),
                "future": encode_frames(future, self.flavor.latent_size)}

    # -- training --------------------------------------------------------------------------------------------
    def loss_terms(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   generators: list[torch.Generator]) -> dict[str, torch.Tensor]:
        """``{"video": ..., "action": ...}``: the velocity errors of the future latents and of the action chunk at
        one time per sample, with noise and time drawn from ``generators`` (one per sample)."""
        actions, latents = batch["actions"], batch["future"].transpose(1, 2)  # (B, 3, F, L, L)
        device = actions.device
        t = self.flow.sample_time(generators).to(device)
        action_noise = fm.sample_noise(actions.shape[1:], generators).to(device)
        video_noise = fm.sample_noise(latents.shape[1:], generators).to(device)
        noisy_actions, action_target = self.flow.noisy_actions(actions, action_noise, t)
        tt = t.view(-1, 1, 1, 1, 1)
        noisy_video, video_target = tt * video_noise + (1 - tt) * latents, video_noise - latents
        inputs = {key: value for key, value in batch.items() if key not in self.target_keys}
        video_velocity, action_velocity = model(inputs, noisy_video, noisy_actions, t)
        return {"video": ((video_velocity - video_target) ** 2).mean(),
                "action": fm.masked_loss(action_velocity, action_target, batch["action_is_pad"], self.action_dim)}

    def validation_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                        generators: list[torch.Generator]) -> torch.Tensor:
        """The weighted sum of :meth:`loss_terms` (training's loss too)."""
        terms = self.loss_terms(model, batch, generators)
        return sum(self.loss_weights[name] * value for name, value in terms.items())

    # -- acting and evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def imagine(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], *, steps: int = 10,
                seed: int | Sequence[int] = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised action chunks (B, H, max_action_dim) and future latents (B, 3, F, L, L), integrated together
        from seeded noise in ``steps`` Euler steps (seeds as :meth:`PolicyTask.act` takes them)."""
        self._require_normaliser()
        device = next(model.parameters()).device
        inputs = {key: value.to(device) for key, value in inputs.items()}
        f = self.flavor
        actions, video = seeded_noise([(self.action_horizon, f.max_action_dim),
                                       (3, f.future_frames, f.latent_size, f.latent_size)], inputs, seed, device)
        dt = -1.0 / steps
        for k in range(steps):
            t = torch.full((actions.shape[0],), 1.0 + k * dt, device=device)
            video_velocity, action_velocity = model(inputs, video, actions, t)
            video, actions = video + dt * video_velocity, actions + dt * action_velocity
        return actions, video

    def act(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], *, steps: int = 10,
            seed: int | Sequence[int] = 0) -> np.ndarray:
        """(B, H, action_dim) chunks in the dataset's units; the imagined frames go to ``predicted_frames``
        (B, future_frames, image_size, image_size, 3) uint8."""
        actions, video = self.imagine(model, inputs, steps=steps, seed=seed)
        self.predicted_frames = decode_frames(video.transpose(1, 2), self.flavor.image_size).cpu().numpy()
        return self.normalizer.unnormalize(ACTION, actions[..., :self.action_dim].double().cpu().numpy())

    def finish(self, model: torch.nn.Module, output_dir: Path, media: MediaLog) -> dict[str, Any]:
        """The policy task's held-out action error, then the world model's own numbers and video (see the module
        docstring), all in ``eval.json``."""
        result = super().finish(model, output_dir, media)
        if not result:
            return result
        root = self._root()
        _, held_out = self._split(root)
        frames = self._frames(root, held_out[:1])
        items = [self.training_item(frame) for frame in frames.frames[::self.frame_stride]]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        opts = self.eval_options
        generators = [torch.Generator().manual_seed(opts.seed + i) for i in range(len(items))]
        with torch.no_grad():
            terms = {name: float(value) for name, value in self.loss_terms(model, batch, generators).items()}
        inputs = {key: value for key, value in batch.items() if key not in self.target_keys}
        _, video = self.imagine(model, inputs, steps=opts.steps, seed=opts.seed)
        truth = batch["future"].transpose(1, 2)
        observed = encode_frames(batch["images"][:, 0], self.flavor.latent_size)[:, :, None]
        frame_mse = {"model": float(((video - truth) ** 2).mean()),
                     "still_baseline": float(((observed - truth) ** 2).mean())}
        strips = _comparison(batch["images"][:, 0], truth, video, VIDEO_FRAME)
        gif = Path(output_dir) / PREDICTED_GIF
        gif.write_bytes(gif_bytes(strips, fps=2))
        media.videos("eval/predicted_frames", [strips], [f"episode {held_out[0]}: recorded (top), predicted"],
                     step=self.steps, fps=2)
        scores = json.loads((Path(output_dir) / "eval.json").read_text())
        scores.update(held_out_loss_terms=terms, held_out_frame_mse=frame_mse, predicted_frames=PREDICTED_GIF)
        (Path(output_dir) / "eval.json").write_text(json.dumps(scores, indent=1))
        return {**result, "held_out_loss_terms": terms, "held_out_frame_mse": frame_mse}


def _comparison(observed: torch.Tensor, truth: torch.Tensor, predicted: torch.Tensor, size: int) -> np.ndarray:
    """(B, 2 * size, (1 + F) * size, 3) uint8: per observation, the observed frame then the recorded future latents
    (top row) and the observed frame then the predicted ones (bottom row)."""
    seen = decode_frames(encode_frames(observed, truth.shape[-1]), size)[:, None]
    rows = [torch.cat([seen, decode_frames(latents.transpose(1, 2), size)], dim=1) for latents in (truth, predicted)]
    return torch.cat([torch.cat(row.unbind(1), dim=2) for row in rows], dim=1).numpy()
