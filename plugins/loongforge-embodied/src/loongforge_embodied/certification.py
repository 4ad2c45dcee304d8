"""The embodied plugin's certification recipe (``loongforge certify``): the Pi0.5-style policy of
configs/embodied-tiny.yaml on a small synthetic LeRobot set it writes itself, cut to seconds a step (no closed-loop
evaluation after training), one process and data-parallel on two ranks."""

from __future__ import annotations

from loongforge.certify.recipes import CertificationRecipe, Layout

#: Samples per step; the task engine has no gradient accumulation, so two ranks take half each.
BATCH = 8

POLICY = CertificationRecipe(
    description=f"pi05-tiny on a synthetic reach set (16 episodes of 20 frames), batch {BATCH}",
    config={
        "run": {"name": "certify-embodied", "seed": 0},
        "model": {"name": "pi05-tiny", "overrides": {"text_len": 24}},
        "optimizer": {"lr": 2.0e-3, "min_lr": 2.0e-4, "weight_decay": 0.0, "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 2, "decay": "cosine"},
        "training": {"micro_batch_size": BATCH},
        "task": {"synthetic": {"episodes": 16, "length": 20, "seed": 0}, "held_out_episodes": 4,
                 "action_horizon": 10, "normalization": "mean_std", "eval": {"frames": 0}},
    },
    layouts={"dp2": Layout(2, (f"training.micro_batch_size={BATCH // 2}",))},
    suite={"config_overrides": ("task.synthetic.episodes=4", "task.held_out_episodes=1")},
)
