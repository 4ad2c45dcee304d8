"""Policy -> FP8 per GEMM module, checked against the module names and shapes of tiny megatron models."""

from __future__ import annotations

import pytest
from loongforge_cuda.fp8.policy import ModulePolicy, Policy, PolicyError
from loongforge_cuda.fp8.selection import (
    check_shapes,
    gemm_shape,
    module_kind,
    named_gemm_modules,
    plan_fp8,
    tokens_per_microbatch,
)
from loongforge_cuda.fp8.shapes import module_shapes, parse_shape

LLAMA = {"model.name": "llama-debug"}


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process gloo world with megatron's parallel state at TP=PP=EP=1 (core's own helpers)."""
    from loongforge.devices.cpu import CPUBackend
    from loongforge.parallel.distributed import init_distributed, shutdown_distributed
    from megatron.core import parallel_state, tensor_parallel

    backend = CPUBackend()
    backend.apply_patches()
    info = init_distributed(backend)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        yield backend
    finally:
        shutdown_distributed(info)


def _flavor(name: str, **overrides):
    from loongforge.plugins import get_registry

    return get_registry("model").load(name).with_overrides(**overrides)


def _built(backend, flavor):
    from loongforge.models.decoder_model import build_model

    return build_model(flavor, backend=backend)


def test_module_kind_drops_layer_and_expert_indices():
    assert module_kind("decoder.layers.11.mlp.linear_fc1") == "mlp.linear_fc1"
    assert module_kind("module.decoder.layers.0.self_attention.linear_qkv") == "self_attention.linear_qkv"
    assert module_kind("decoder.layers.3.mlp.experts.local_experts.5.linear_fc2") == "mlp.experts.linear_fc2"
    assert module_kind("decoder.layers.3.mlp.experts.linear_fc2") == "mlp.experts.linear_fc2"
    assert module_kind("output_layer") is None
    assert module_kind("embedding.word_embeddings") is None


def test_flavor_shapes_match_what_megatron_builds(megatron_world):
    """The benchmark measures the GEMMs a run executes: shapes from the flavor == the built model's weights."""
    for flavor in (_flavor("llama-debug"),
                   _flavor("qwen3-moe-tiny", num_layers=1, moe_shared_expert_intermediate_size=64)):
        modules = named_gemm_modules(_built(megatron_world, flavor))
        built = {module_kind(name): gemm_shape(m) for name, m in modules.items()}
        expected = {kind: (i, o) for kind, (i, o, _) in module_shapes(flavor).items()}
        assert built == expected
    moe = module_shapes(_flavor("qwen3-moe-tiny"))
    assert moe["mlp.experts.linear_fc1"] == (256, 256, 0.5)  # top-4 of 8 experts, SwiGLU 2 * 128
    assert moe["self_attention.linear_qkv"] == (256, (8 + 2 * 4) * 64, 1.0)


def test_tensor_parallel_shapes_split_the_parallel_dimension():
    full, tp2 = module_shapes(_flavor("llama-tiny")), module_shapes(_flavor("llama-tiny"), tp=2)
    assert tp2["mlp.linear_fc1"] == (256, full["mlp.linear_fc1"][1] // 2, 1.0)
    assert tp2["mlp.linear_fc2"] == (full["mlp.linear_fc2"][0] // 2, 256, 1.0)
    with pytest.raises(ValueError, match=r"not divisible by tensor-parallel size 3"):
        module_shapes(_flavor("llama-tiny"), tp=3)


def test_parse_shape():
    assert parse_shape("mlp.linear_fc1=4096,28672") == ("mlp.linear_fc1", (4096, 28672, 1.0))
    assert parse_shape("mlp.experts.linear_fc1=2048,1536,0.0625")[1] == (2048, 1536, 0.0625)
    with pytest.raises(ValueError, match="expected kind=in_features,out_features"):
        parse_shape("mlp.linear_fc1=4096")


def _policy_for(flavor, thresholds: dict[str, int | None]) -> Policy:
    modules = {kind: ModulePolicy(i, o, thresholds[kind], s) for kind, (i, o, s) in module_shapes(flavor).items()}
    return Policy(modules, device="NVIDIA H100", recipe="blockwise", emulated=False, source="fp8_policy.json")


def test_plan_over_a_built_model(megatron_world):
    flavor = _flavor("llama-debug")
    modules = named_gemm_modules([_built(megatron_world, flavor), _built(megatron_world, flavor)])  # two chunks
    assert len(modules) == 2 * 2 * 4 and "1.decoder.layers.1.mlp.linear_fc2" in modules
    policy = _policy_for(flavor, {"self_attention.linear_qkv": 1024, "self_attention.linear_proj": None,
                                  "mlp.linear_fc1": 4096, "mlp.linear_fc2": 2048})
    check_shapes({name: gemm_shape(m) for name, m in modules.items()}, policy)
    plan = plan_fp8(modules, policy, tokens_per_microbatch=2048)
    fp8_kinds = {module_kind(name) for name, fp8 in plan.items() if fp8}
    assert fp8_kinds == {"self_attention.linear_qkv", "mlp.linear_fc2"}
    assert sum(plan.values()) == 2 * 2 * 2  # two kinds x two layers x two chunks
    assert not any(plan_fp8(modules, policy, tokens_per_microbatch=512).values())
    assert sum(plan_fp8(modules, policy, tokens_per_microbatch=1 << 20).values()) == 2 * 2 * 3


def test_plan_scales_tokens_for_routed_experts(megatron_world):
    flavor = _flavor("qwen3-moe-tiny", num_layers=1)
    modules = named_gemm_modules(_built(megatron_world, flavor))
    policy = _policy_for(flavor, dict.fromkeys(module_shapes(flavor), 2048))
    plan = plan_fp8(modules, policy, tokens_per_microbatch=2048)
    # Attention sees all 2048 tokens; each expert about half of them (top-4 of 8).
    assert all(plan[n] for n in plan if "self_attention" in n)
    assert not any(plan[n] for n in plan if ".experts." in n)
    assert all(plan_fp8(modules, policy, tokens_per_microbatch=4096).values())


def test_policy_for_another_model_is_refused(megatron_world):
    modules = named_gemm_modules(_built(megatron_world, _flavor("llama-debug")))
    shapes = {name: gemm_shape(m) for name, m in modules.items()}
    other = _policy_for(_flavor("llama-tiny"), dict.fromkeys(module_shapes(_flavor("llama-tiny")), 1024))
    with pytest.raises(PolicyError, match=r"fp8_policy\.json: modules\.self_attention\.linear_proj was measured at "
                                          r"in_features=256, out_features=256 but decoder\.layers\.0\.self_attention"
                                          r"\.linear_proj is 64 -> 64; re-run"):
        check_shapes(shapes, other)
    moe_policy = _policy_for(_flavor("qwen3-moe-tiny"), dict.fromkeys(module_shapes(_flavor("qwen3-moe-tiny")), 1))
    with pytest.raises(PolicyError, match=r"fp8_policy\.json: no entry modules\.mlp\.linear_fc1"):
        plan_fp8(modules, moe_policy, 1024)


def test_tokens_per_microbatch_from_config():
    from loongforge.config import load_config

    config = load_config(None, ["training.micro_batch_size=4", "data.seq_length=4096", "parallel.cp=2"])
    assert tokens_per_microbatch(config) == 8192


def test_adaptive_fp8_refuses_a_model_built_on_the_cpu(megatron_world, tmp_path):
    from loongforge.config import load_config
    from loongforge.errors import LoongForgeError
    from loongforge_cuda.fp8.optimization import AdaptiveFP8Optimization
    from loongforge_cuda.fp8.policy import save_policy

    flavor = _flavor("llama-debug")
    path = save_policy(_policy_for(flavor, dict.fromkeys(module_shapes(flavor), 1)), tmp_path / "p.json")
    opt = AdaptiveFP8Optimization({"policy": str(path)})
    config = load_config(None, ["model.name=llama-debug", "training.precision=fp8"])
    opt.loongforge_configure(config)
    model = [_built(megatron_world, flavor)]
    with pytest.raises(LoongForgeError, match=r"^adaptive-fp8 needs an NVIDIA GPU with FP8 \(Transformer Engine\); "
                                              r"the model's GEMMs are on cpu$"):
        opt.loongforge_modify_model(model, config)
    assert all("bf16_forward" not in repr(m.forward) for m in named_gemm_modules(model).values())
