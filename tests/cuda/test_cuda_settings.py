"""Capability answers, FP8 recipe choice and the megatron settings of loongforge-cuda, for any GPU generation.

Pure functions of (compute capability, installed libraries), so every generation is covered on CPU. A FAKE
transformer_engine (tests/fakes/te) stands in for TE where its recipe classes are looked up.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from fake_cuda import FakeCudaModule
from loongforge_cuda.backend import CUDABackend
from loongforge_cuda.capability import choose_fp8_recipe, feature_supported, te_recipe_classes, usable_fp8_recipes
from loongforge_cuda.settings import CUDAMegatronSettings, resolve_settings

ALL_TE = frozenset({"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"})
VOLTA, AMPERE, ADA, HOPPER, BLACKWELL = (7, 0), (8, 0), (8, 9), (9, 0), (10, 0)


@pytest.mark.parametrize(("capability", "bf16", "fp8", "flash"), [
    (VOLTA, False, False, False), (AMPERE, True, False, True), (ADA, True, True, True),
    (HOPPER, True, True, True), (BLACKWELL, True, True, True),
])
def test_features_by_compute_capability(capability, bf16, fp8, flash):
    answers = {f: feature_supported(f, capability, te=True, flash_attn=True) for f in ("bf16", "fp8", "flash_attn")}
    assert answers == {"bf16": bf16, "fp8": fp8, "flash_attn": flash}
    assert all(feature_supported(f, capability, te=True, flash_attn=True)
               for f in ("fp16", "cuda_graphs", "sequence_parallel", "streams"))


def test_fp8_and_flash_need_their_libraries():
    assert not feature_supported("fp8", HOPPER, te=False, flash_attn=True)
    assert not feature_supported("te", HOPPER, te=False, flash_attn=True)
    assert not feature_supported("flash_attn", HOPPER, te=True, flash_attn=False)


@pytest.mark.parametrize(("capability", "te_classes", "expected"), [
    (BLACKWELL, ALL_TE, "mxfp8"),
    (HOPPER, ALL_TE, "tensorwise"),
    (ADA, ALL_TE, "tensorwise"),
    (HOPPER, frozenset({"DelayedScaling"}), "delayed"),  # TE < 2.2 has no current scaling
])
def test_auto_fp8_recipe(capability, te_classes, expected):
    assert choose_fp8_recipe("auto", capability, te_classes) == expected


def test_blockwise_scaling_where_te_offers_it():
    assert usable_fp8_recipes(HOPPER, ALL_TE) == ["delayed", "tensorwise", "blockwise"]
    assert choose_fp8_recipe("blockwise", HOPPER, ALL_TE) == "blockwise"
    with pytest.raises(ValueError, match="needs compute capability 9.0\\+, this GPU is 8.9"):
        choose_fp8_recipe("blockwise", ADA, ALL_TE)
    with pytest.raises(ValueError, match="Float8BlockScaling, which the installed Transformer Engine lacks"):
        choose_fp8_recipe("blockwise", HOPPER, ALL_TE - {"Float8BlockScaling"})


def test_fp8_recipe_errors_name_the_problem():
    with pytest.raises(ValueError, match="'mxfp8' needs compute capability 10.0\\+.*usable: delayed, tensorwise"):
        choose_fp8_recipe("mxfp8", HOPPER, ALL_TE - {"Float8BlockScaling"})
    with pytest.raises(ValueError, match="unknown fp8_recipe 'fp4'"):
        choose_fp8_recipe("fp4", HOPPER, ALL_TE)
    with pytest.raises(ValueError, match="no FP8 recipe usable on sm80"):
        choose_fp8_recipe("auto", AMPERE, ALL_TE)


def _resolve(precision="bf16", capability=HOPPER, te=True, flash=True, **options):
    return resolve_settings(precision, options, capability=capability, te_recipes=ALL_TE if te else frozenset(),
                            te=te, flash_attn=flash)


def test_fp8_settings_fill_megatron_transformer_config():
    from megatron.core.transformer.enums import AttnBackend

    settings = _resolve("fp8", fp8_recipe="blockwise", fp8_param=True, attention="flash")
    assert settings.params_dtype == "bf16"
    assert settings.transformer_config_kwargs() == {
        "attention_backend": AttnBackend.flash, "cuda_graph_impl": "none", "tp_comm_overlap": False,
        "fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_param": True,
    }
    assert _resolve("fp8", capability=BLACKWELL, fp8_format="e4m3").transformer_config_kwargs()["fp8"] == "e4m3"


def test_bf16_settings_build_a_transformer_config_and_ddp_config():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = _resolve("bf16", overlap_grad_reduce=True, overlap_param_gather=True, attention="unfused")
    assert isinstance(settings, CUDAMegatronSettings) and "fp8" not in settings.transformer_config_kwargs()
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, bf16=True,
                               **settings.transformer_config_kwargs())
    assert config.fp8 is None and config.cuda_graph_impl == "none"
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, **settings.ddp_config_kwargs())
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather


def test_cuda_graph_and_overlap_switches():
    assert _resolve(cuda_graphs=True).cuda_graph_impl == "local"
    assert _resolve(cuda_graphs="transformer_engine").cuda_graph_impl == "transformer_engine"
    assert _resolve(tp_comm_overlap=True).transformer_config_kwargs()["tp_comm_overlap"] is True
    with pytest.raises(ValueError, match="cuda_graphs 'transformer_engine' needs Transformer Engine"):
        _resolve(te=False, cuda_graphs="transformer_engine")
    with pytest.raises(ValueError, match="tp_comm_overlap uses userbuffers, which need Transformer Engine"):
        _resolve(te=False, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        _resolve(cuda_graphs="always")


def test_layers_choice():
    assert _resolve().layers == "te" and _resolve(te=False).layers == "local"
    assert _resolve(layers="local").layers == "local" and _resolve(layers="te").layers == "te"
    with pytest.raises(ValueError, match="precision fp8 needs Transformer Engine layers \\(layers: local"):
        _resolve("fp8", layers="local")
    with pytest.raises(ValueError, match="attention 'flash' runs through Transformer Engine layers"):
        _resolve(layers="local", attention="flash")
    with pytest.raises(ValueError, match="layers 'te' needs Transformer Engine: pip install"):
        _resolve(te=False, layers="te")
    with pytest.raises(ValueError, match="layers must be one of auto, te, local"):
        _resolve(layers="apex")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"precision": "fp8", "te": False}, "precision fp8 needs Transformer Engine"),
    ({"precision": "bf16", "fp8_recipe": "delayed"}, "fp8_recipe set but precision is bf16"),
    ({"precision": "bf16", "capability": VOLTA}, "bf16 tensor cores .* this GPU is 7.0"),
    ({"precision": "int4"}, "unknown precision 'int4'"),
    ({"attention": "flash", "flash": False}, "needs flash-attn installed"),
    ({"attention": "flash", "te": False}, "runs through Transformer Engine"),
    ({"attention": "fused", "te": False}, "runs through Transformer Engine"),
    ({"attention": "magic"}, "attention must be one of"),
    ({"fp8_fromat": "e4m3"}, "unknown cuda option\\(s\\) fp8_fromat"),
    ({"precision": "fp8", "fp8_format": "e5m2"}, "fp8_format must be hybrid or e4m3"),
])
def test_conflicting_requests_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _resolve(**kwargs)


@pytest.fixture
def fake_transformer_engine(monkeypatch):
    """Put the FAKE transformer_engine on sys.path for one test and forget it afterwards."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "fakes" / "te"))
    yield sys.modules
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


def test_te_recipe_classes_are_read_from_transformer_engine(fake_transformer_engine, monkeypatch):
    assert te_recipe_classes() == ALL_TE
    monkeypatch.delattr(fake_transformer_engine["transformer_engine.common.recipe"], "Float8BlockScaling")
    assert te_recipe_classes() == ALL_TE - {"Float8BlockScaling"}


def test_backend_resolves_settings_from_its_device_and_libraries(fake_transformer_engine):
    class Hopper(CUDABackend):
        def device_module(self):
            return FakeCudaModule(capability=HOPPER)

    settings = Hopper().megatron_settings("fp8", fp8_recipe="auto")
    assert (settings.fp8, settings.fp8_recipe, settings.params_dtype) == ("hybrid", "tensorwise", "bf16")
    assert Hopper().supports("fp8") and Hopper().supports("te")


def test_layers_local_builds_local_layers_even_with_transformer_engine(fake_transformer_engine, capsys):
    from loongforge.devices.sdpa_attention import SDPAttention
    from megatron.core.models.backends import LocalSpecProvider

    class Hopper(CUDABackend):
        def device_module(self):
            return FakeCudaModule(capability=HOPPER)

    backend = Hopper()
    assert backend.megatron_settings("bf16", layers="local").layers == "local"
    assert isinstance(backend.spec_provider(), LocalSpecProvider)
    assert backend.spec_provider().core_attention() is SDPAttention  # flash kernels, MLA widths, soft-capping
    assert "loongforge-cuda:" not in capsys.readouterr().err  # asked for, so no notice


def test_without_transformer_engine_layers_are_local_with_one_notice(capsys):
    from loongforge.devices.sdpa_attention import SDPAttention
    from loongforge_cuda import backend as backend_module
    from megatron.core.models.backends import LocalSpecProvider

    backend_module._local_layers_notice.cache_clear()
    assert isinstance(CUDABackend().spec_provider(), LocalSpecProvider)
    assert CUDABackend().spec_provider().core_attention() is SDPAttention
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("loongforge-cuda:")]
    assert len(notices) == 1 and "pip install 'loongforge-cuda[te]'" in notices[0]


def test_configure_env_sets_megatron_gpu_defaults_without_overriding(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")  # recorded, so the default set below is undone after
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    CUDABackend().configure_env()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
