"""LoRA on families with their own attention: with ``model.lora.targets`` left null the adapters go on every
tensor-parallel linear of each family's attention -- MLA's down- and up-projections and output, Gated DeltaNet's
input and output projections beside the gated attention's -- an SFT run trains only them, and the merged Hugging
Face export computes what the unmerged model computes (transformers reads it)."""

from __future__ import annotations

import pytest
import torch
import transformers
from loongforge import hookimpl, load_config

#: The adapted linears each family's attention has by default (leaf module names).
EXPECTED = {
    "deepseek-v3-tiny": {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                         "linear_proj"},
    "qwen3-next-tiny": {"in_proj", "out_proj", "linear_qkv", "linear_proj"},
}


class Trainable:
    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.names = sorted(n for n, p in trainer.model[0].named_parameters() if p.requires_grad)


@pytest.mark.parametrize("model", list(EXPECTED))
def test_default_targets_are_the_familys_attention_and_the_export_is_merged(model, tmp_path, register_plugin):
    from loongforge.interop.mcore_checkpoint import checkpoint_config, load_model_weights, resolve_family
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.models.lora import apply_lora
    from loongforge.train.run import run_training

    trainable = register_plugin(Trainable(), "trainable")
    config = load_config(None, [
        f"run.output_dir={tmp_path / 'run'}", f"model.name={model}", "data.dataset=shipped-chat",
        "data.seq_length=128", "data.pack=true", "training.phase=sft", "training.micro_batch_size=2",
        "training.steps=4", "training.threads=1", "optimizer.lr=0.02", "scheduler.warmup_steps=0",
        "model.lora.rank=4", "checkpoint.save_hf=true", "logging.progress=false", "logging.tensorboard=false",
    ])
    run_training(config)
    leaves = {n.split(".lora.")[0].rsplit(".", 1)[-1] for n in trainable.names}
    assert all(".lora." in n and ".self_attention." in n for n in trainable.names) and leaves == EXPECTED[model]

    ckpt = tmp_path / "run" / "checkpoints" / "step-0000004"
    tokens = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).unsqueeze(0).expand(2, -1)
    with standalone_world() as backend:  # the trained model with its adapters, not merged
        chunk = build_standalone(resolve_family(checkpoint_config(ckpt)), backend)
        apply_lora([chunk], config.model.lora, config.run.seed)
        load_model_weights(ckpt, [chunk])
        moved = max(p.abs().max().item() for n, p in chunk.named_parameters() if n.endswith("lora.weight_b"))
        with torch.no_grad():
            ours = chunk.eval()(tokens, positions, None)[..., :259]
    assert moved > 1e-3  # the adapters trained, so an export that dropped them would differ

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "hf").float().eval()
    assert not [n for n in hf.state_dict() if "lora" in n]
    with torch.no_grad():
        theirs = hf(tokens).logits[..., :259]
    assert (theirs - ours).abs().max().item() <= 1e-4
