"""Shared fixtures for core tests."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    """A TCP port free on this host now (for one torchrun or process-group rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_cpu_world():
    """A one-process gloo world with megatron parallel state at TP=PP=1 and the CPU patches applied.

    Yields the CPU backend. Module-scoped because megatron's state is global: every test module that
    needs it gets a fresh world and tears it down, so tests that create their own world are unaffected.
    """
    import torch
    import torch.distributed as dist
    from loongforge.devices.cpu import CPUBackend
    from megatron.core import parallel_state, tensor_parallel

    backend = CPUBackend()
    backend.apply_patches()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    try:
        yield backend
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


#: Tiny Hugging Face configs, one per family switch we convert (fp32, no downloads). Llama 3.1-style
#: RoPE scaling uses a short original context so the scaling changes most frequencies; Qwen3's head_dim 32
#: with 4 heads (128) != hidden 64, as in the real sizes.
HF_TINY_CASES = {
    "llama3-rope-untied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32, "rope_theta": 500000.0})),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-qknorm-untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3-qknorm-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "mixtral-top2": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-moe-top4": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False)),
    # top-1 routing with the full-softmax probability as the weight (megatron's pre-softmax router); Mixtral's
    # renormalised top-1 converts too, but trains only with a balancing loss (tests/core/test_moe_top1.py)
    "qwen3-moe-top1": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=48, norm_topk_prob=False)),
}
HF_TINY_COMMON = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=384, max_position_embeddings=256, rms_norm_eps=1e-6,
)
#: Tiny configs of the families whose config.json keys differ from Llama's: complete settings (not merged with
#: HF_TINY_COMMON), vocabularies that are not a multiple of 128 so megatron's padded rows are exercised.
HF_FAMILY_CASES = {
    "gpt2-tied": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=389, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "pythia-parallel-rotary": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=389,
        max_position_embeddings=256, hidden_act="gelu", tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    "phi-shared-norm-gqa": ("PhiConfig", "PhiForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=389, max_position_embeddings=256, hidden_act="gelu_new",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4})),
    "gemma-geglu-gqa": ("GemmaConfig", "GemmaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=389, max_position_embeddings=256, rms_norm_eps=1e-6)),
    # Small caps and window so that soft-capping and the sliding window change the result on 24-48 tokens;
    # query_pre_attn_scalar != head_dim so the score scale is tested; layers alternate sliding / full.
    "gemma2-softcap-window": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=389, max_position_embeddings=256, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=2.0, final_logit_softcapping=4.0)),
}
HF_TINY_CASES.update(HF_FAMILY_CASES)
#: transformers model types whose RMSNorm weight is stored zero-centred (applied as ``1 + w``).
ZERO_CENTRED_NORMS = ("gemma", "gemma2")


def tiny_settings(case: str) -> dict:
    """The transformers config settings of tiny case ``case`` (Llama-style cases on top of HF_TINY_COMMON)."""
    extra = HF_TINY_CASES[case][2]
    return dict(extra) if case in HF_FAMILY_CASES else {**HF_TINY_COMMON, **extra}


def make_hf_model(config_cls: str, model_cls: str, settings: dict, seed: int = 0):
    """A random fp32 transformers model; weights drawn with a large spread (and norms away from 1) so that a
    mis-mapped head, bias or norm moves the logits far more than the 1e-4 tolerance."""
    import torch
    import transformers

    config = getattr(transformers, config_cls)(**settings, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or ".ln_" in name:
                param.uniform_(0.5, 1.5)
                if config.model_type in ZERO_CENTRED_NORMS and name.endswith("norm.weight"):
                    param.sub_(1.0)  # these norms scale by 1 + w: the same effective spread
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.15)
    return model


def word_tokenizer(directory, vocab_size: int) -> list[str]:
    """A whitespace word-level ``tokenizer.json`` with ``vocab_size`` ids (``<eos>`` = 0) saved into ``directory``, as
    a user's Hugging Face directory holds one; returns the words by id."""
    import json

    import tokenizers

    words = ["<eos>", "<unk>", *(f"w{i}" for i in range(2, vocab_size))]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return words


@pytest.fixture
def hf_tiny(tmp_path):
    """``hf_tiny(case) -> (directory, model)``: a tiny HF checkpoint saved with ``save_pretrained``."""

    def build(case: str, **overrides):
        config_cls, model_cls, _ = HF_TINY_CASES[case]
        model = make_hf_model(config_cls, model_cls, {**tiny_settings(case), **overrides})
        directory = tmp_path / f"hf-{case}"
        model.save_pretrained(directory)
        return directory, model

    return build


def checkpoint_logits(checkpoint, tokens):
    """Logits of the model in a LoongForge checkpoint, built at TP=PP=1 in a world of its own."""
    import torch
    from loongforge.checkpoint.layout import find_checkpoint
    from loongforge.interop.mcore_checkpoint import (
        checkpoint_config,
        checkpoint_dtype,
        load_model_weights,
        resolve_family,
    )
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone

    path = find_checkpoint(checkpoint)
    config = checkpoint_config(path)
    with standalone_world() as backend:
        model = build_standalone(resolve_family(config), backend, checkpoint_dtype(path, config))
        load_model_weights(path, [model])
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
        with torch.no_grad():
            return model.eval()(tokens, positions, None)
