"""``ModelFamilySuite``: the conformance tests every LoongForge model family passes.

A family author subclasses it in its own test suite with a *tiny* flavor (one that builds and steps in about a
second on a CPU); pytest collects the inherited tests::

    from loongforge.testing.family_suite import ModelFamilySuite
    from acme_models.flavors import FLAVORS

    class TestAcmeTiny(ModelFamilySuite):
        family = FLAVORS["acme-tiny"]
        has_hf_adapter = True           # what family.hf_adapter() must answer

What passing means is what the commands rely on (:class:`loongforge.models.family.ModelFamily`):

* **options** -- every number of a task family's ``task:`` section declares its range
  (:func:`~loongforge.config.sections.ranged`), which ``check`` holds configs to.
* **build** -- a megatron family builds through the one builder (:func:`loongforge.models.chunks.build_standalone`)
  with the layers of the device backend's spec provider, checked on the built modules: every norm and core
  attention is the class the device handed out (a family that bypasses the provider, or asks it once and then uses
  megatron's local layers, fails: it would not run on another device plugin); the same seed draws the same weights
  (layouts and resumes agree);
  a task family's ``make_task(config).build_model()`` is a module, the same under the same seed.
* **training steps** on a tiny batch (three SGD steps): the loss is finite, every trainable parameter gets a
  finite gradient that is not zero in at least one step (none is dead or detached), and the steps change the
  parameters.
* **save / load**: the weights written the way training checkpoints write them (megatron ``dist_checkpointing``,
  or the task engine's safetensors file) load into a model built from another seed and equal the saved ones.
* **Hugging Face round trip**, where the family has an adapter: ``to_hf`` -> ``from_hf`` -> ``to_hf`` is the
  identity bit for bit, and ``from_hf`` gives exactly the model's own tensor names and shapes.
* **Hugging Face reference** (:attr:`hf_reference`): the export of the model, its weights perturbed away from their
  initial values, loads into transformers' class of the architecture ``config_json`` names with no tensor missing
  or left over (beyond :attr:`hf_extra_tensors`) and computes the model's logits (within 1e-4 of their scale) and
  its greedy tokens -- so an adapter that renames nothing, or swaps two projections, fails.
* **generate**, for causal language models: a few greedy tokens, the same twice.

Megatron families run in a one-process CPU world (gloo, TP=PP=1) that the suite sets up per test class; task
families need a config (:attr:`config_overrides` on top of :attr:`config_path`, e.g. the family's tiny
recipe). Override :meth:`make_batch` for a model whose forward takes inputs beside the text
(:attr:`ModelFamily.extra_inputs`).
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from loongforge.devices.cpu import CPUBackend
from loongforge.models.family import ModelFamily


def _marked(base: type) -> type:
    """A subclass of ``base`` that only :class:`RecordingCPUBackend`'s provider hands out."""
    return type(f"Device{base.__name__}", (base,), {"__doc__": f"{base.__name__}, as the device provided it."})


class RecordingCPUBackend(CPUBackend):
    """The CPU backend, counting how often a builder asked it for its layer modules (``spec_provider``) and handing
    out norm and core-attention classes of its own (:attr:`provided`): a model holding any other norm or core
    attention of megatron's or torch's built some layers without the device."""

    def __init__(self) -> None:
        super().__init__()
        self.spec_requests = 0
        provider = super().spec_provider()
        self.provided = {"norm": _marked(provider.layer_norm()), "core attention": _marked(provider.core_attention())}

    def spec_provider(self) -> Any:
        self.spec_requests += 1
        provided = self.provided

        class Recording(type(super().spec_provider())):
            def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
                return provided["norm"]

            def core_attention(self) -> type:
                return provided["core attention"]

        return Recording()


def _layer_kinds() -> dict[str, tuple[type, ...]]:
    """The norm and core-attention classes a layer could hold instead of the device's: torch's, megatron's local
    ones and the CPU backend's own (Transformer Engine's where it is installed)."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from loongforge.devices.norm import SPNorm
    from loongforge.devices.sdpa_attention import SDPAttention

    # megatron's local and Transformer Engine norm "classes" are factories of torch's (or TE's) norm modules
    norms: tuple[type, ...] = (torch.nn.LayerNorm, torch.nn.RMSNorm, SPNorm)
    attentions: tuple[type, ...] = (DotProductAttention, SDPAttention)
    try:
        import transformer_engine.pytorch as te
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        norms, attentions = (*norms, te.LayerNorm, te.RMSNorm), (*attentions, TEDotProductAttention)
    except ImportError:  # no Transformer Engine: its classes cannot be in the model either
        pass
    return {"norm": norms, "core attention": attentions}


class ModelFamilySuite:
    """Subclass as ``TestSomething`` and set :attr:`family` (and :attr:`has_hf_adapter`, :attr:`causal_lm`)."""

    #: The tiny flavor under test (a registered object or one built for the test).
    family: ClassVar[ModelFamily | None] = None
    #: Whether ``family.hf_adapter()`` returns an adapter (the suite checks the answer, then the round trip).
    has_hf_adapter: ClassVar[bool] = False
    #: Whether the model is a causal language model that ``loongforge generate`` can continue text with.
    causal_lm: ClassVar[bool] = True
    #: Task families: the run config their ``make_task`` gets (a recipe path and ``key=value`` overrides).
    config_path: ClassVar[str | None] = None
    config_overrides: ClassVar[tuple[str, ...]] = ()
    #: The tiny batch of a megatron family: samples and tokens per sample.
    batch_size: ClassVar[int] = 2
    seq_length: ClassVar[int] = 16
    seed: ClassVar[int] = 1234
    #: SGD steps on the tiny batch and their learning rate. Three, because zero-initialised layers (a DiT's output
    #: projection and adaLN-zero gates) pass no gradient to the layers before them until they have stepped.
    training_steps: ClassVar[int] = 3
    lr: ClassVar[float] = 1e-2
    #: ``fnmatch`` patterns of parameters the architecture never uses for the loss (the discarded text stream of an
    #: MMDiT's last block); they must be exactly the ones the steps leave without a gradient, so the declaration
    #: cannot hide a parameter that should train.
    never_trained: ClassVar[tuple[str, ...]] = ()
    #: ``fnmatch`` patterns of modules the family builds from torch itself by design rather than from the device's
    #: spec provider (a VLM's vision encoder, which is plain torch), so their norms and attention are not the
    #: device's; the declaration must match such modules, and every other norm and attention is held to the device.
    own_modules: ClassVar[tuple[str, ...]] = ()
    #: Whether transformers has the class ``hf_adapter().config_json()`` names, to hold the export to (a family whose
    #: Hugging Face format transformers does not implement sets False and is held to its round trip only).
    hf_reference: ClassVar[bool] = True
    #: ``fnmatch`` patterns of exported tensors the reference class does not load (DeepSeek's multi-token-prediction
    #: layers, which transformers' model skips); any other left-over tensor fails.
    hf_extra_tensors: ClassVar[tuple[str, ...]] = ()

    # -- hooks a family author may override --------------------------------------------------------------

    @classmethod
    def the_family(cls) -> ModelFamily:
        """:attr:`family`, checked to be a :class:`ModelFamily`."""
        assert isinstance(cls.family, ModelFamily), (
            f"{cls.__name__}.family must be a loongforge.models.family.ModelFamily, got {cls.family!r}")
        return cls.family

    def make_config(self) -> Any:
        """The run config a task family's ``make_task`` receives."""
        from loongforge.config import load_config

        return load_config(self.config_path, list(self.config_overrides))

    def make_batch(self, family: ModelFamily, generator: Any) -> dict[str, Any]:
        """Megatron families: ``tokens``, ``position_ids``, ``labels`` (and any :attr:`~ModelFamily.extra_inputs`)."""
        import torch

        vocab = family.decoder.vocab_size
        tokens = torch.randint(0, vocab, (self.batch_size, self.seq_length + 1), generator=generator)
        positions = torch.arange(self.seq_length).expand(self.batch_size, -1)
        return {"tokens": tokens[:, :-1], "position_ids": positions, "labels": tokens[:, 1:]}

    def vacuous(self) -> dict[str, str]:
        """The tests that check nothing for this family, and why (``loongforge certify --family`` reports them as
        not applicable rather than as proven)."""
        family = self.the_family()
        adapter = family.hf_adapter()
        reasons = {}
        if type(family).task_options is None:
            reasons["test_task_options_declare_their_ranges"] = "no task: section"
        if adapter is None:
            reasons["test_hf_round_trip_is_bitwise"] = "no Hugging Face adapter"
        if adapter is None or not self.hf_reference or family.engine != "megatron":
            reasons["test_hf_export_computes_what_the_model_computes"] = (
                "no Hugging Face adapter" if adapter is None else "no transformers class to hold the export to")
        if not self.causal_lm or family.engine != "megatron":
            reasons["test_greedy_generation_is_deterministic"] = "not a causal language model"
        return reasons

    # -- fixtures ----------------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def world(cls) -> Iterator[Any]:
        """A :class:`RecordingCPUBackend` in a one-process megatron world (megatron families; ``None`` for task
        families)."""
        from loongforge.interop.world import standalone_world

        if cls.the_family().engine != "megatron":
            yield None
            return
        with standalone_world(RecordingCPUBackend()) as backend:
            yield backend

    # -- building ----------------------------------------------------------------------------------------

    def build(self, world: Any, seed: int) -> Any:
        """A freshly built model of :attr:`family`, its weights drawn from ``seed``."""
        import torch

        family = self.the_family()
        if family.engine == "megatron":
            from loongforge.models.chunks import build_standalone

            return build_standalone(family, world, seed=seed)
        torch.manual_seed(seed)
        return family.make_task(self.make_config()).build_model()

    def test_contract_is_declared(self) -> None:
        from loongforge.models.family import check_family

        family = check_family(self.the_family(), type(self).__name__, "ModelFamilySuite")
        assert (family.decoder is not None) == (family.engine == "megatron"), (
            "a megatron family names its decoder (ModelFamily.decoder); a task family has none")
        assert (family.hf_adapter() is not None) == self.has_hf_adapter, (
            f"hf_adapter() returned {family.hf_adapter()!r}; the suite was told has_hf_adapter={self.has_hf_adapter}")

    def test_task_options_declare_their_ranges(self) -> None:
        """Every number of the family's ``task:`` section carries a range (``loongforge.config.sections.ranged``),
        so ``check`` refuses what the family cannot train (``task.sample.steps: 0``) before anything is built."""
        from loongforge.config.numbers import unranged_numbers

        options = type(self.the_family()).task_options
        missing = unranged_numbers(options) if options is not None else []
        assert not missing, f"task options without a declared range (use loongforge.config.sections.ranged): {missing}"

    def test_builds_through_the_one_builder_deterministically(self, world: Any) -> None:
        import torch

        before = world.spec_requests if world is not None else 0
        first, again, other = (self.build(world, s) for s in (self.seed, self.seed, self.seed + 1))
        assert isinstance(first, torch.nn.Module)
        if world is not None:
            assert world.spec_requests > before, (
                "build_chunk never asked the device backend for its spec provider: the layers would not be the "
                "device's (build through ChunkBuild.decoder_chunk or pass build.backend.spec_provider())")
        if world is not None:
            self._assert_device_layers(first, world)
        a, b, c = (m.state_dict() for m in (first, again, other))
        assert a.keys() == b.keys() and a, "the model has no state"
        tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        assert all(torch.equal(a[k], b[k]) for k in tensors), "the same seed must draw the same weights"
        assert any(not torch.equal(a[k], c[k]) for k in tensors), "another seed drew the same weights"

    def _assert_device_layers(self, model: Any, world: Any) -> None:
        """Every norm and core attention in ``model`` is the class the device's provider handed out."""
        own = set()
        for kind, classes in _layer_kinds().items():
            found = {name: module for name, module in model.named_modules()
                     if isinstance(module, classes) and not isinstance(module, world.provided[kind])}
            own |= {name for name in found if any(fnmatch.fnmatchcase(name, p) for p in self.own_modules)}
            foreign = sorted(f"{name} ({type(found[name]).__name__})" for name in found if name not in own)
            assert not foreign, (
                f"{len(foreign)} {kind} module(s) not built from the device's spec provider, e.g. {foreign[0]}: "
                "build every layer from build.backend.spec_provider() (ChunkBuild.decoder_chunk does)")
        assert not self.own_modules or own, f"own_modules {self.own_modules} matches no norm or attention module"

    # -- training steps ---------------------------------------------------------------------------------

    def loss_of(self, model: Any, batch: dict[str, Any], task: Any = None) -> Any:
        """The scalar training loss of ``batch`` (a megatron chunk returns per-token losses)."""
        if task is not None:
            return task.training_step(model, batch)
        family = self.the_family()
        extra = {key: batch[key] for key in family.extra_inputs if key in batch}
        return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **extra).float().mean()

    def _batch_and_task(self, model: Any) -> tuple[dict[str, Any], Any]:
        import torch

        family = self.the_family()
        if family.engine == "megatron":
            return self.make_batch(family, torch.Generator().manual_seed(self.seed)), None
        task = family.make_task(self.make_config())
        dataset = task.build_dataset()
        samples = [dataset[i] for i in range(min(2, len(dataset)))]
        batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        batch["index"] = torch.arange(len(samples))
        return batch, task

    def test_training_steps_reach_every_parameter(self, world: Any) -> None:
        import torch

        model = self.build(world, self.seed)
        model.train()
        batch, task = self._batch_and_task(model)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        before = {n: p.detach().clone() for n, p in trainable}
        optimizer = torch.optim.SGD([p for _, p in trainable], lr=self.lr)
        reached: set[str] = set()
        for step in range(self.training_steps):
            optimizer.zero_grad(set_to_none=True)
            loss = self.loss_of(model, batch, task)
            assert loss.dim() == 0 and math.isfinite(loss.item()), f"step {step + 1}: loss {loss} is not finite"
            loss.backward()
            missing = [n for n, p in trainable if p.grad is None]
            assert not missing, f"no gradient reached {missing[:5]} (override make_batch to feed every input)"
            bad = [n for n, p in trainable if not torch.isfinite(p.grad).all()]
            assert not bad, f"non-finite gradients in {bad[:5]}"
            reached |= {n for n, p in trainable if bool(p.grad.ne(0).any())}
            optimizer.step()
        declared = sorted(n for n, _ in trainable if any(fnmatch.fnmatchcase(n, p) for p in self.never_trained))
        dead = sorted(n for n, _ in trainable if n not in reached and n not in declared)
        assert not dead, f"{len(dead)} parameter(s) got only zero gradients in {self.training_steps} steps: {dead[:3]}"
        trained = sorted(set(declared) & reached)
        assert not trained, f"never_trained names parameters that do train: {trained[:3]}"
        assert not self.never_trained or declared, f"never_trained {self.never_trained} matches no parameter"
        assert any(not torch.equal(before[n], p.detach()) for n, p in trainable), "the steps changed no parameter"

    # -- save / load ------------------------------------------------------------------------------------

    def test_save_load_round_trip(self, world: Any, tmp_path: Path) -> None:
        import torch

        saved, restored = self.build(world, self.seed), self.build(world, self.seed + 1)
        if world is not None:
            _save_and_load_megatron(saved, restored, tmp_path)
        else:
            from safetensors.torch import load_file, save_file

            save_file({k: v.contiguous() for k, v in saved.state_dict().items()}, str(tmp_path / "model.safetensors"))
            restored.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
        a, b = saved.state_dict(), restored.state_dict()
        tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
        assert tensors and all(torch.equal(a[k], b[k]) for k in tensors), "loaded weights differ from the saved"

    # -- Hugging Face round trip ------------------------------------------------------------------------

    def test_hf_round_trip_is_bitwise(self, world: Any) -> None:
        import torch

        adapter = self.the_family().hf_adapter()
        if "test_hf_round_trip_is_bitwise" in self.vacuous():  # test_contract_is_declared holds has_hf_adapter
            assert not self.has_hf_adapter
            return
        from loongforge.interop.sharding import gather_full_state

        full = gather_full_state([self.build(world, self.seed)])
        hf = adapter.to_hf(full)
        back = adapter.from_hf(hf)
        assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in full.items()}, (
            "from_hf must give exactly the model's tensor names and shapes")
        again = adapter.to_hf(back)
        assert hf.keys() == again.keys() and all(torch.equal(hf[k], again[k]) for k in hf), (
            "to_hf(from_hf(to_hf(model))) differs from to_hf(model)")
        config = adapter.config_json("fp32")
        assert isinstance(config, dict) and config.get("architectures"), "config_json must name the architecture"

    def test_hf_export_computes_what_the_model_computes(self, world: Any, tmp_path: Path) -> None:
        family = self.the_family()
        adapter = family.hf_adapter()
        if "test_hf_export_computes_what_the_model_computes" in self.vacuous():
            return
        import torch

        try:
            import transformers
        except ImportError:
            pytest.fail("the Hugging Face reference check needs transformers (pip install 'loongforge-core[hf]'); "
                        "a family whose format transformers does not implement sets hf_reference = False")
        from loongforge.interop.sharding import gather_full_state
        from loongforge.models.generate import generate_ids

        model = self.build(world, self.seed)
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():  # away from init: norms off 1, biases off 0, so a mis-mapped tensor shows
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.05)
        config = dict(adapter.config_json("fp32"))
        architecture = config["architectures"][0]
        reference_class = getattr(transformers, architecture, None)
        assert reference_class is not None, (
            f"transformers has no {architecture}; set hf_reference = False for a format it does not implement")
        # as a user would: the files written, then transformers' own loading (its renames and stacked experts)
        from safetensors.torch import save_file

        directory = Path(tmp_path) / "hf"
        directory.mkdir()
        exported = adapter.to_hf(gather_full_state([model]))
        save_file({k: v.contiguous() for k, v in exported.items()}, str(directory / "model.safetensors"),
                  {"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config))
        reference, info = reference_class.from_pretrained(directory, output_loading_info=True,
                                                          attn_implementation="eager", dtype=torch.float32)
        reference.eval()
        extra = [k for k in info["unexpected_keys"]
                 if not any(fnmatch.fnmatchcase(k, p) for p in self.hf_extra_tensors)]
        missing, mismatched = list(info["missing_keys"]), list(info["mismatched_keys"])
        assert not missing and not extra and not mismatched, (
            f"the export does not load into transformers' {architecture}: missing {missing[:3]}, left over "
            f"{extra[:3]}, other shapes {mismatched[:3]} (an adapter must write the names and layout it reads)")

        batch = self.make_batch(family, torch.Generator().manual_seed(self.seed))
        vocab = family.decoder.vocab_size
        model.eval()
        with torch.no_grad():
            ours = model(batch["tokens"], batch["position_ids"], None)[..., :vocab]
            theirs = reference(batch["tokens"]).logits[..., :vocab]
        gap, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
        assert gap <= 1e-4 * max(scale, 1.0), (
            f"transformers' {architecture} with the exported weights computes other logits: max abs difference "
            f"{gap:.3g} (logits up to {scale:.3g})")
        if self.causal_lm:
            prompt = batch["tokens"][0, :5].tolist()
            ours_ids = generate_ids(model, prompt, 8, vocab_size=vocab,
                                    max_positions=family.decoder.max_position_embeddings)
            reference.generation_config.eos_token_id = None
            with torch.no_grad():
                theirs_ids = reference.generate(torch.tensor([prompt]),
                                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                                max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):]
            assert ours_ids == theirs_ids.tolist(), (
                f"greedy tokens differ from transformers': {ours_ids} vs {theirs_ids.tolist()}")

    # -- generate ---------------------------------------------------------------------------------------

    def test_greedy_generation_is_deterministic(self, world: Any) -> None:
        family = self.the_family()
        if "test_greedy_generation_is_deterministic" in self.vacuous():
            assert not self.causal_lm or family.engine == "megatron", "a causal LM is a megatron family"
            return
        from loongforge.models.generate import generate_ids

        model = self.build(world, self.seed)
        decoder = family.decoder
        prompt = [1, 2, 3]
        runs = [generate_ids(model, prompt, 4, vocab_size=decoder.vocab_size,
                             max_positions=decoder.max_position_embeddings) for _ in range(2)]
        assert runs[0] == runs[1], f"greedy generation differs between two runs: {runs}"
        assert len(runs[0]) == 4 and all(0 <= t < decoder.vocab_size for t in runs[0])


def _save_and_load_megatron(saved: Any, restored: Any, directory: Path) -> None:
    """Write ``saved`` as a training checkpoint writes its model (``dist_checkpointing``) and read it into
    ``restored`` the way every command reads one (:func:`loongforge.interop.mcore_checkpoint.load_model_weights`)."""
    from megatron.core import dist_checkpointing

    from loongforge.checkpoint.saver import MODEL_OPTIM
    from loongforge.checkpoint.torch_dist import InProcessTorchDistSaveStrategy
    from loongforge.interop.mcore_checkpoint import load_model_weights

    (directory / MODEL_OPTIM).mkdir()
    dist_checkpointing.save({"model0": saved.sharded_state_dict()}, str(directory / MODEL_OPTIM),
                            sharded_strategy=InProcessTorchDistSaveStrategy())
    load_model_weights(directory, [restored])
