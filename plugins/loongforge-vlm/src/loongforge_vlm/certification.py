"""The VLM plugin's certification recipe (``loongforge certify``): configs/vlm-shapes.yaml's model (SigLIP-tiny,
an MLP projector, qwen3-tiny) on generated shapes questions, cut to seconds a step, at the megatron layouts the
composed model takes on two ranks."""

from __future__ import annotations

from loongforge.certify.recipes import CertificationRecipe, Layout

VLM = CertificationRecipe(
    description="siglip-tiny + mlp + qwen3-tiny on generated shapes VQA, sequences of 128, global batch 8",
    config={
        "run": {"name": "certify-vlm", "seed": 0},
        "model": {"encoder": "siglip-tiny", "projector": "mlp", "foundation": "qwen3-tiny"},
        "data": {"dataset": "vlm-shapes", "tokenizer": "byte-vision", "seq_length": 128, "pack": True},
        "optimizer": {"lr": 2.0e-3, "min_lr": 2.0e-4, "weight_decay": 0.0},
        "scheduler": {"warmup_steps": 2, "decay": "cosine"},
        "training": {"phase": "sft", "micro_batch_size": 4, "global_batch_size": 8, "sample_tokens": 0},
    },
    layouts={"tp2": Layout(2, ("parallel.tp=2",)), "pp2": Layout(2, ("parallel.pp=2",)), "dp2": Layout(2)},
)
