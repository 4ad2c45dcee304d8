"""A plugin family crosses from and to Hugging Face through its own reader and adapter, with no table in core.

The plugin below is written as an outside author would: its checkpoints are a Llama whose tensors live under
``backbone.`` instead of ``model.`` and whose ``config.json`` says ``RenamedLlamaForCausalLM``. Core has no entry
for that architecture; the plugin registers a reader for it (``loongforge_register_hf_architectures``) and its
flavors' ``hf_adapter()`` renames the tensors. ``convert hf-to-mcore`` must then read the directory through them
(logits equal to transformers' own model), ``convert mcore-to-hf`` must give back the same tensors bit for bit, and
``loongforge check`` / ``model.load: hf:`` must name the plugin's model. Without the plugin the same directory is
refused in one line; a plugin claiming an architecture core reads fails naming both providers.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import HF_TINY_COMMON, checkpoint_logits, make_hf_model
from loongforge import hookimpl
from loongforge.cli import main
from loongforge.models import DecoderFlavor, DecoderHFAdapter
from loongforge.registry import DuplicateComponentError
from safetensors.torch import load_file

ARCH = "RenamedLlamaForCausalLM"


def _renamed(tensors: dict, old: str, new: str) -> dict:
    return {(new + name[len(old):] if name.startswith(old) else name): t for name, t in tensors.items()}


@dataclasses.dataclass(frozen=True)
class RenamedAdapter:
    """Core's Llama adapter under other tensor names and another architecture name."""

    flavor: DecoderFlavor

    @property
    def _llama(self) -> DecoderHFAdapter:
        return DecoderHFAdapter(dataclasses.replace(self.flavor, family="llama", hf_architecture="LlamaForCausalLM"))

    def config_json(self, dtype, base=None):
        return {**self._llama.config_json(dtype, base), "architectures": [ARCH], "model_type": "renamed_llama"}

    def to_hf(self, state):
        return _renamed(self._llama.to_hf(state), "model.", "backbone.")

    def from_hf(self, tensors, *, padded_vocab_size=None):
        return self._llama.from_hf(_renamed(tensors, "backbone.", "model."), padded_vocab_size=padded_vocab_size)

    def tensor_shapes(self, stored):
        shapes = self._llama.tensor_shapes(list(_renamed(dict.fromkeys(stored), "backbone.", "model.")))
        return _renamed(shapes, "model.", "backbone.")


@dataclasses.dataclass(frozen=True)
class RenamedLlama(DecoderFlavor):
    def hf_adapter(self):
        return RenamedAdapter(self)


class RenamedReader:
    def read_config(self, raw, path):
        from loongforge.models.hf_config import DecoderHFReader  # the plugin reuses core's Llama key reading

        flavor = DecoderHFReader("llama").read_config({**raw, "architectures": ["LlamaForCausalLM"]}, path)
        fields = {f.name: getattr(flavor, f.name) for f in dataclasses.fields(flavor)}
        return RenamedLlama(**{**fields, "family": "renamed-llama", "hf_architecture": ARCH})


class RenamedPlugin:
    @hookimpl
    def loongforge_register_models(self, registry):
        settings = dict(HF_TINY_COMMON)
        registry.register("renamed-tiny", RenamedLlama(
            family="renamed-llama", hf_architecture=ARCH, num_layers=settings["num_hidden_layers"],
            hidden_size=settings["hidden_size"], ffn_hidden_size=settings["intermediate_size"],
            num_attention_heads=settings["num_attention_heads"], num_query_groups=settings["num_key_value_heads"],
            vocab_size=settings["vocab_size"], max_position_embeddings=settings["max_position_embeddings"],
            norm_eps=settings["rms_norm_eps"]))

    @hookimpl
    def loongforge_register_hf_architectures(self, registry):
        registry.register(ARCH, RenamedReader(), aliases=("renamed_llama",), description="renamed Llama")


class GreedyPlugin:
    @hookimpl
    def loongforge_register_hf_architectures(self, registry):
        registry.register("LlamaForCausalLM", RenamedReader())


@pytest.fixture(scope="module")
def renamed_dir(tmp_path_factory):
    """A tiny perturbed Llama saved by transformers, then renamed into the plugin's format; and the model."""
    from safetensors.torch import save_file

    model = make_hf_model("LlamaConfig", "LlamaForCausalLM", dict(HF_TINY_COMMON))
    directory = tmp_path_factory.mktemp("renamed") / "hf"
    model.save_pretrained(directory)
    tensors = _renamed(load_file(directory / "model.safetensors"), "model.", "backbone.")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "architectures": [ARCH], "model_type": "renamed_llama"}))
    return directory, model


def _error(capsys, args) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_core_has_no_entry_for_the_plugin_architecture_and_refuses_it_alone(renamed_dir, tmp_path, capsys):
    from loongforge.models.hf_layouts import FAMILIES

    assert ARCH not in {row.architecture for row in FAMILIES.values()}
    err = _error(capsys, ["convert", "hf-to-mcore", str(renamed_dir[0]), str(tmp_path / "out")])
    assert "no registered handler claims" in err
    from loongforge.errors import InteropError
    from loongforge.models.hf_format import read_hf_model

    with pytest.raises(InteropError, match=f"architecture '{ARCH}' is not supported; supported: .*LlamaForCausalLM"):
        read_hf_model(renamed_dir[0])


def test_plugin_reader_and_adapter_serve_both_directions(register_plugin, renamed_dir, tmp_path, capsys):
    register_plugin(RenamedPlugin(), "renamed")
    directory, reference = renamed_dir
    out, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf-to-mcore", str(directory), str(out)]) == 0
    assert "as model 'renamed-tiny'" in capsys.readouterr().out
    tokens = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(tokens).logits
    ours = checkpoint_logits(out, tokens)[..., :384]
    assert (ours - expected).abs().max().item() <= 1e-5

    assert main(["convert", "mcore-to-hf", str(out), str(back)]) == 0
    source, exported = load_file(directory / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(exported) == sorted(source) and all(name.startswith(("backbone.", "lm_head.")) for name in exported)
    assert all(torch.equal(exported[name], source[name]) for name in source)
    assert json.loads((back / "config.json").read_text())["architectures"] == [ARCH]


def test_plugin_model_is_what_an_hf_load_config_names(register_plugin, renamed_dir, tmp_path):
    from loongforge import load_config
    from loongforge.models.hf_adopt import adopt_hf_model
    from loongforge.resolve import resolve_model_flavor

    register_plugin(RenamedPlugin(), "renamed")
    config = load_config(None, [f"model.load=hf:{renamed_dir[0]}"])
    adopt_hf_model(config)
    assert config.model.name == "renamed-tiny" and config.model.overrides == {}
    assert isinstance(resolve_model_flavor(config), RenamedLlama)


def test_misshapen_plugin_tensor_is_named_before_any_weight_is_read(register_plugin, renamed_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    register_plugin(RenamedPlugin(), "renamed")
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(renamed_dir[0] / "model.safetensors")
    tensors["backbone.norm.weight"] = torch.ones(3)
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_text((renamed_dir[0] / "config.json").read_text())
    err = _error(capsys, ["convert", "hf-to-mcore", str(broken), str(tmp_path / "out")])
    assert "tensor backbone.norm.weight has shape [3], config.json implies [64]" in err


def test_claiming_an_architecture_core_reads_fails_naming_both_providers(register_plugin):
    from loongforge.plugins import get_host

    register_plugin(GreedyPlugin(), "greedy")
    with pytest.raises(Exception) as info:
        get_host().registry("hf_architecture")
    cause = info.value if isinstance(info.value, DuplicateComponentError) else info.value.__cause__
    assert isinstance(cause, DuplicateComponentError)
    assert "'llamaforcausallm' registered twice: by loongforge-core and by <in-process>" in str(cause)
    assert "greedy" in str(info.value)  # the plugin whose registration broke is named too
