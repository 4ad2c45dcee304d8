"""A LoRA run exports a plain Hugging Face checkpoint (adapters merged) whose logits equal the unmerged model's."""

from __future__ import annotations

import torch
import transformers
from loongforge import hookimpl, load_config  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def test_save_hf_and_convert_of_a_lora_run_match_the_unmerged_model(tmp_path):
    from loongforge.interop.convert import mcore_to_hf
    from loongforge.interop.mcore_checkpoint import load_model_weights
    from loongforge.interop.world import standalone_world
    from loongforge.models.decoder_model import build_model
    from loongforge.models.llama import FLAVORS
    from loongforge.models.lora import apply_lora
    from loongforge.train.run import run_training

    config = load_config(None, [
        f"run.output_dir={tmp_path / 'run'}", "model.name=llama-debug", "data.dataset=shipped-chat",
        "data.seq_length=128", "data.pack=true", "training.phase=sft", "training.micro_batch_size=2",
        "training.steps=3", "training.threads=1", "optimizer.lr=0.05", "scheduler.warmup_steps=0",
        "model.lora.rank=4", "model.lora.targets=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
        "checkpoint.save_hf=true", "logging.progress=false", "logging.tensorboard=false",
    ])
    run_training(config)
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000003"

    tokens = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).unsqueeze(0).expand(2, -1)
    with standalone_world() as backend:  # the trained model with its adapters, not merged
        model = build_model(FLAVORS["llama-debug"], backend=backend)
        apply_lora([model], config.model.lora, config.run.seed)
        load_model_weights(ckpt, [model])
        trained_b = max(p.abs().max().item() for n, p in model.named_parameters() if n.endswith("lora.weight_b"))
        with torch.no_grad():
            ours = model.eval()(tokens, positions, None)
    assert trained_b > 1e-3  # the adapters moved, so an export that dropped them would differ

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "hf").float().eval()
    assert not [n for n in hf.state_dict() if "lora" in n]
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert (theirs - ours).abs().max().item() <= 1e-4

    converted = tmp_path / "converted"
    mcore_to_hf(ckpt, converted)
    online, offline = load_file(ckpt / "hf" / "model.safetensors"), load_file(converted / "model.safetensors")
    assert online.keys() == offline.keys() and all(torch.equal(online[k], offline[k]) for k in online)


def test_generate_on_a_lora_checkpoint_uses_its_adapters(tmp_path):
    """``loongforge generate`` on a LoRA run's checkpoint writes what its merged export writes, not the base model."""
    from loongforge.data.tokenizers import ByteTokenizer
    from loongforge.interop.generate import generate_from_checkpoint
    from loongforge.interop.mcore_checkpoint import load_model_weights
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.models.generate import generate_text
    from loongforge.models.llama import FLAVORS
    from loongforge.train.run import run_training

    run_training(load_config(None, [
        f"run.output_dir={tmp_path / 'run'}", "model.name=llama-debug", "data.seq_length=64",
        "training.micro_batch_size=2", "training.steps=4", "training.threads=1", "optimizer.lr=0.05",
        "scheduler.warmup_steps=0", "model.lora.rank=4", "model.lora.targets=[linear_qkv,linear_fc1,linear_fc2]",
        "checkpoint.save_hf=true", "logging.progress=false", "logging.tensorboard=false",
    ]))
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000004"
    prompt, tokens = "It is a truth ", 24

    generated = generate_from_checkpoint(ckpt, prompt, tokens=tokens)
    exported = generate_from_checkpoint(ckpt / "hf", prompt, tokens=tokens, tokenizer="byte")
    assert generated == exported
    with standalone_world() as backend:  # what generate wrote before: the base weights alone, adapters dropped
        base = build_standalone(FLAVORS["llama-debug"], backend)
        load_model_weights(ckpt, [base])
        base_only = generate_text(base, ByteTokenizer(), prompt, tokens, max_positions=64, temperature=0.0)
    assert base_only != generated  # the adapters change the text, so dropping them cannot pass


class StartWeights:
    """Records, at train start, the first attention output projection and which parameters train."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        params = dict(trainer.model[0].named_parameters())
        self.proj = next(p for n, p in params.items()
                         if n.endswith("decoder.layers.0.self_attention.linear_proj.weight")).detach().clone()
        self.frozen = [n for n, p in params.items() if not p.requires_grad]
        self.names = list(params)


def test_model_load_of_a_lora_checkpoint_starts_from_its_merged_weights(tmp_path, register_plugin):
    """``model.load: <LoRA checkpoint>`` starts a full fine-tune from what the LoRA run trained (adapters folded in,
    as its Hugging Face export has them), not from the base weights alone, and leaves every weight trainable."""
    from loongforge.interop.mcore_checkpoint import load_model_weights
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.models.llama import FLAVORS
    from loongforge.train.run import run_training

    common = ["model.name=llama-debug", "data.seq_length=64", "training.micro_batch_size=2", "training.threads=1",
              "logging.progress=false", "logging.tensorboard=false"]
    run_training(load_config(None, [
        f"run.output_dir={tmp_path / 'lora'}", *common, "training.steps=3", "optimizer.lr=0.05",
        "scheduler.warmup_steps=0", "model.lora.rank=4", "model.lora.targets=[linear_proj]", "checkpoint.save_hf=true",
    ]))
    ckpt = tmp_path / "lora" / "checkpoints" / "step-0000003"
    recorder = register_plugin(StartWeights(), "start-weights")
    run_training(load_config(None, [f"run.output_dir={tmp_path / 'full'}", *common, "training.steps=1",
                                    f"model.load={ckpt}", "checkpoint.save_at_end=false"]))
    merged = load_file(ckpt / "hf" / "model.safetensors")["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(recorder.proj, merged)
    assert recorder.frozen == [] and not [n for n in recorder.names if ".lora." in n]
    with standalone_world() as backend:  # what model.load read before: the base weight, adapters dropped
        base = build_standalone(FLAVORS["llama-debug"], backend)
        load_model_weights(ckpt, [base])
        base_proj = base.decoder.layers[0].self_attention.linear_proj.weight.detach()
    assert (base_proj - merged).abs().max().item() > 1e-3
