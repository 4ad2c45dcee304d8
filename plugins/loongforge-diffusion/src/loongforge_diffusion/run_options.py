"""Plumbing shared by the diffusion tasks that ``loongforge train`` runs (Wan video, Qwen-Image): ``task.ema`` and
``task.init`` from a LoongForge checkpoint (the options are typed in :mod:`loongforge_diffusion.options` and checked
by core; per-sample seeds are core's, :mod:`loongforge.tasks`, shared with every task kind).

Each family keeps only what differs (model, data, the model call); these pieces must behave identically across
families, so that a config option means the same thing whichever model it trains.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import ConfigError

from loongforge_diffusion.ema import EMA
from loongforge_diffusion.options import EMAOptions

#: Added to ``task.data_seed`` for the generated held-out captions: the samples after training and the validation
#: split (``evaluation:``) come from a data seed the training set never uses.
HELD_OUT_SEED_OFFSET = 7919


def no_held_out_data(source: str) -> ConfigError:
    """The one-line refusal of evaluation for a run on written data without ``evaluation.data``."""
    return ConfigError(f"{source}: evaluation: task.data is a written dataset, which has no held-out split; name "
                       "one of the same kind in evaluation.data (or set evaluation.interval: 0)")


class EMAOption:
    """``task.ema``: an average of the trained weights, made at the first step, kept in the task's checkpoint
    state and swapped in while sampling. ``options`` is the typed ``task.ema`` or ``None`` (off)."""

    def __init__(self, options: EMAOptions | None) -> None:
        self.options = options
        self.ema: EMA | None = None
        self._saved: dict[str, Any] | None = None

    def after_step(self, model: torch.nn.Module) -> None:
        """Fold the weights after an optimizer step into the average (no-op when off)."""
        if self.options is None:
            return
        module = getattr(model, "module", model)
        if any(hasattr(p, "full_tensor") for p in module.parameters()):
            raise ConfigError("task.ema with parallel.strategy fsdp2/hsdp (sharded parameters) is not supported yet; "
                              "use ddp or zero1")
        if self.ema is None:
            self.ema = EMA(module, decay=self.options.decay, warmup=self.options.warmup)
            if self._saved is not None:
                self.ema.load_state_dict(self._saved)
        self.ema.update(module)

    def state_dict(self) -> dict[str, Any]:
        """``{"ema": ...}`` once the average exists, else ``{}``: merge it into the task's state."""
        return {} if self.ema is None else {"ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from the task's state (the average is rebuilt lazily, on the model, at the next step)."""
        self._saved = state.get("ema")
        if self.ema is not None and self._saved is not None:
            self.ema.load_state_dict(self._saved)

    def copy_average_to(self, model: torch.nn.Module) -> bool:
        """Write the average into ``model``'s weights (``convert --ema``, after the task's state was restored from a
        checkpoint); ``False`` when the run kept none."""
        if self.ema is None and self._saved is not None and self.options is not None:
            self.ema = EMA(model, decay=self.options.decay, warmup=self.options.warmup)
            self.ema.load_state_dict(self._saved)
        if self.ema is None:
            return False
        self.ema.copy_to(model)
        return True

    def sampling_weights(self, model: torch.nn.Module) -> Any:
        """A context in which ``model`` holds the averaged weights (or its own, when there is no average)."""
        return self.ema.swap(model) if self.ema is not None else contextlib.nullcontext()


class ExpertEMA:
    """``task.ema`` of a two-expert model (:class:`~loongforge_diffusion.wan.experts.WanExperts`): one average per
    expert, folded in only after the steps that trained it -- an expert's weights do not move on the other's steps,
    and averaging them then would pull its average towards stale weights at the other's pace."""

    def __init__(self, options: EMAOptions | None, experts: tuple[str, ...]) -> None:
        self.parts = {name: EMAOption(options) for name in experts}

    def after_step(self, model: torch.nn.Module, expert: str) -> None:
        self.parts[expert].after_step(getattr(model, "module", model).expert(expert))

    def shadows(self, expert: str) -> dict[str, torch.Tensor] | None:
        """``expert``'s averaged weights by name (the dict itself, whose values a one-resident run moves between the
        device and host memory with the expert), or ``None`` before its first average."""
        ema = self.parts[expert].ema
        return None if ema is None else ema.shadow

    def state_dict(self) -> dict[str, Any]:
        averages = {name: state["ema"] for name, part in self.parts.items() if (state := part.state_dict())}
        return {"ema_experts": averages} if averages else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("ema_experts", {})
        for name, part in self.parts.items():
            part.load_state_dict({"ema": saved[name]} if name in saved else {})

    def copy_average_to(self, model: torch.nn.Module) -> bool:
        """Each expert's average into it (an expert the run never trained keeps its weights); ``False`` when the
        run kept no average at all."""
        copied = [part.copy_average_to(model.expert(name)) for name, part in self.parts.items()]
        return any(copied)

    @contextlib.contextmanager
    def sampling_weights(self, model: torch.nn.Module) -> Any:
        with contextlib.ExitStack() as stack:
            for name, part in self.parts.items():
                stack.enter_context(part.sampling_weights(model.expert(name)))
            yield model


def checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor] | None:
    """The model weights of a LoongForge task checkpoint directory (manifest verified first), or ``None`` when
    ``path`` is not one (the caller may then try a released model's layout)."""
    from loongforge.checkpoint.manifest import MANIFEST, verify_manifest
    from safetensors.torch import load_file

    directory = Path(path).expanduser()
    if not (directory / MANIFEST).is_file():
        return None
    verify_manifest(directory)
    return load_file(str(directory / "model.safetensors"))


def load_init(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: str, flavor_name: str) -> None:
    """Load ``task.init``'s ``weights`` into ``model``; names that do not fit the flavor are a config error."""
    own = model.state_dict()
    wrong = next((name for name, tensor in weights.items() if name in own and tensor.shape != own[name].shape), None)
    if wrong is not None:
        raise ConfigError(f"task.init {path}: '{wrong}' has shape {list(weights[wrong].shape)}; the flavor "
                          f"'{flavor_name}' needs {list(own[wrong].shape)} (model.overrides)")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ConfigError(f"task.init {path}: weights do not fit the flavor '{flavor_name}': missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
