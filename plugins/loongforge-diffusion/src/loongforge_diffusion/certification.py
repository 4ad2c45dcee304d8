"""The diffusion plugin's certification recipe (``loongforge certify``): the squares-image Qwen-Image MMDiT of
configs/diffusion-squares-image.yaml cut to seconds a step -- flow matching with the noise and timesteps drawn on
the host, so a backend and the CPU reference train on the same draws -- under DDP and FSDP2 on two ranks."""

from __future__ import annotations

from loongforge.certify.recipes import CertificationRecipe, Layout

#: Samples per step; the task engine has no gradient accumulation, so two ranks take half each.
BATCH = 8

IMAGE_DIT = CertificationRecipe(
    description=f"qwen-image-tiny (RGB pixels, 4 layers) on generated 16x16 squares, batch {BATCH}",
    config={
        "run": {"name": "certify-diffusion", "seed": 0},
        "model": {"name": "qwen-image-tiny",
                  "overrides": {"in_channels": 12, "out_channels": 3, "text_dim": 32, "num_layers": 4,
                                "num_heads": 2, "head_dim": 32, "axes_dims": [4, 14, 14]}},
        "optimizer": {"lr": 2.0e-3, "min_lr": 2.0e-4, "weight_decay": 0.0, "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 2, "decay": "cosine"},
        "training": {"micro_batch_size": BATCH},
        "task": {"samples": 256, "side": 16, "context_dropout": 0.1,
                 "flow_matching": {"sampling": "logit-normal", "shift": 3.0}, "sample": {"images": 0}},
    },
    layouts={"dp2": Layout(2, (f"training.micro_batch_size={BATCH // 2}",)),
             "fsdp2": Layout(2, (f"training.micro_batch_size={BATCH // 2}", "parallel.strategy=fsdp2"))},
    # the conformance suite's three steps: zero-initialised gates open one block per step, so one block; its text
    # stream's output is discarded (only the image stream reaches the head), so its FFN and text query norm never train
    suite={"config_overrides": ("task.samples=4", "model.overrides.num_layers=1"),
           "never_trained": ("blocks.0.txt.ffn.*", "blocks.0.txt.norm_q.weight")},
)
