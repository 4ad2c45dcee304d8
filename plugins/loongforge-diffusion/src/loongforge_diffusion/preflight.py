"""The diffusion families' pre-flight (``ModelFamily.check_task``): what ``loongforge check`` and ``train`` open
before anything is built, so that a data set or an option training would trip over is one line naming the key.

The task is made as training makes it (its options, geometry, LoRA and EMA settings), its data set opened the way
training opens it and its first sample read -- a truncated, empty or text ``.pt``, a ``.jsonl`` of what is not a
video, a latent cache with a missing file fail here -- and the sample is held to the model: its channels and caption
width to the model's, its frames and side to the patch size (a video whose frames or side the patch does not divide
cannot be cut into tokens). The data must fill a training batch, and, when the run evaluates, the validation data is
opened the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from loongforge.config.sections import origin_of
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.train.task_sizes import check_data_sizes


def check_video_task(flavor: Any, config: Any, options: Any) -> list[str]:
    """One summary line for a Wan task's data; a :class:`ConfigError` naming ``task.data`` (or the option) when
    training could not read, patch or batch it."""
    task = flavor.make_task(config)
    if options.lora is not None:
        from loongforge_diffusion.wan.lora import selected_targets

        _keyed(config, "task.lora.targets", lambda: selected_targets(options.lora.targets))
    from loongforge.parallel.torch_native import check_static_graph

    check_static_graph(config.parallel, task.sparse_parameters)
    if config.parallel.tp > 1:
        _check_tensor_parallel(config, options, task.flavor)
    where = _data_where(config, options.data)
    train = _opened(config, where, task.build_dataset, options.data)
    video = _fits(task.flavor, train[0], where)
    validation = None
    if config.evaluation.interval:
        paths = list(config.evaluation.data)
        origin = f"evaluation.data {paths[0]}" if paths else "the held-out moving squares"
        valid = _opened(config, f"{config.source}: {origin}",
                        lambda: task.validation_dataset(paths, _evaluated(config)), paths[0] if paths else None)
        _fits(task.flavor, valid[0], f"{config.source}: {origin}")
        validation = (len(valid), origin)
    check_data_sizes(config, (len(train), where if options.data else _samples_where(config)), validation)
    frames, height, width = video.shape[1:]
    from loongforge_diffusion.wan.checkpoint import checkpoint_shapes
    from loongforge_diffusion.wan.experts import expert_state_dict

    released = (lambda path: expert_state_dict(path, checkpoint_shapes)) if task.experts else checkpoint_shapes
    return [f"task.data: {len(train)} sample(s) of {frames} x {height} x {width}",
            *_init_lines(config, options, task.bare_model, released)]


def _check_tensor_parallel(config: Any, options: Any, flavor: Any) -> None:
    """``parallel.tp > 1`` for a Wan DiT: heads and FFN columns must split, and what is not split yet is one line."""
    from loongforge_diffusion.wan.tensor_parallel import check_tensor_parallel

    tp, where = config.parallel.tp, config.source
    check_tensor_parallel(flavor, tp, config.parallel.cp, where)
    if options.lora is not None:
        raise ConfigError(f"{origin_of(where, 'task.lora')}: task.lora with parallel.tp={tp} is not supported yet "
                          "(the adapters wrap the projections tensor parallelism splits); use tp 1")
    if config.training.compile:
        raise ConfigError(f"{origin_of(where, 'training.compile')}: training.compile with parallel.tp={tp} is not "
                          "supported yet; leave it off")


def check_image_task(flavor: Any, config: Any, options: Any) -> list[str]:
    """One summary line for a Qwen-Image task's generated still squares; a :class:`ConfigError` naming the option
    (channels and ``task.side`` against the patch, a side no square fits, ``evaluation.data``, too few samples)."""
    task = flavor.make_task(config)
    train = _keyed(config, "task.side", task.build_dataset)
    image = train[0]["image"]
    validation = None
    if config.evaluation.interval:
        valid = task.validation_dataset(list(config.evaluation.data), _evaluated(config))
        validation = (len(valid), "the held-out still squares")
    check_data_sizes(config, (len(train), _samples_where(config)), validation)
    from loongforge_diffusion.qwen_image.model import QwenImageModel
    from loongforge_diffusion.qwen_image.run_task import released_shapes

    return [f"task: {len(train)} still square(s) of {image.shape[-2]} x {image.shape[-1]} generated per epoch",
            *_init_lines(config, options, lambda: QwenImageModel(task.flavor),
                         lambda path: released_shapes(path, task.flavor))]


def _init_lines(config: Any, options: Any, build: Callable[[], Any], released: Callable[[str], Any]) -> list[str]:
    """``task.init``, when set, held to the module ``build`` makes (:mod:`loongforge_diffusion.init_check`)."""
    if not options.init:
        return []
    from loongforge_diffusion.init_check import check_init, model_shapes

    return [check_init(config, options.init, model_shapes(build), released)]


def _data_where(config: Any, data: str | None) -> str:
    """How messages name the training data: the file, or the options that generate it."""
    return (f"{config.source}: task.data {data}" if data
            else f"{origin_of(config.source, 'task')}: the generated moving squares")


def _samples_where(config: Any) -> str:
    return f"{origin_of(config.source, 'task.samples')}: task.samples"


def _evaluated(config: Any) -> int:
    """The validation samples the task engine asks a task for: ``evaluation.steps`` batches (of one rank's)."""
    return config.evaluation.steps * config.training.micro_batch_size


def _keyed(config: Any, key: str, run: Callable[[], Any]) -> Any:
    """``run()``, its one-line errors (``ValueError`` too: the geometry's) prefixed by the origin of ``key``."""
    try:
        return run()
    except (LoongForgeError, ValueError) as exc:
        raise ConfigError(f"{origin_of(config.source, key)}: {key}: {exc}") from None


def _opened(config: Any, where: str, build: Callable[[], Any], path: str | None = None) -> Any:
    """The data set ``build`` opens (from ``path``, when it reads one), holding at least one sample; any failure is
    one line after ``where`` (the task's own refusals, which name the config already, as they are)."""
    try:
        dataset = build()
        if len(dataset) == 0:
            raise ConfigError("holds no sample")
        dataset[0]  # read as training reads it: a shard's values, a rendered video
    except LoongForgeError as exc:
        said = str(exc)
        if said.startswith(config.source):
            raise
        if path is not None:  # where names the file already
            said = said.removeprefix(f"{path}: ").removeprefix(f"{Path(path).expanduser()}: ")
        raise ConfigError(f"{where}: {said}") from None
    except Exception as exc:  # noqa: BLE001 -- whatever a damaged file raises, it is the data's problem, in one line
        said = (str(exc).strip().splitlines() or ["empty, or cut short"])[0]
        raise ConfigError(f"{where}: cannot be read as training reads it ({type(exc).__name__}: {said})") from None
    return dataset


def _fits(flavor: Any, sample: dict[str, Any], where: str) -> Any:
    """The sample's video, held to what ``flavor`` takes: (channels, frames, height, width) with the model's input
    and output channels, frames and sides its patch divides (and, for per-token timesteps, a frame after the clean
    first one), and caption states of the model's text width."""
    video, context = sample.get("video"), sample.get("context")
    if video is None or video.dim() != 4:
        raise ConfigError(f"{where}: a sample must hold a video (channels, frames, height, width), got "
                          f"{None if video is None else list(video.shape)}")
    channels, frames, height, width = video.shape
    condition = sample["condition"].shape[0] if "condition" in sample else 0
    if channels != flavor.out_channels or channels + condition != flavor.in_channels:
        given = f" and an I2V condition of {condition}" if condition else " and no I2V condition"
        hint = ("; an I2V flavor's conditioning channels come from a latent cache written with --i2v"
                if flavor.in_channels != flavor.out_channels else "")
        raise ConfigError(f"{where}: videos of {channels} channels{given}; the model takes in_channels "
                          f"{flavor.in_channels} and out_channels {flavor.out_channels} (model.overrides{hint})")
    patch = flavor.patch_size
    if frames % patch[0] or height % patch[1] or width % patch[2]:
        raise ConfigError(f"{where}: videos of {frames} x {height} x {width} (frames x height x width) do not divide "
                          f"into the model's {'x'.join(map(str, patch))} patches (task.frames, task.side, "
                          "model.overrides.patch_size)")
    if flavor.per_token_timesteps and frames // patch[0] < 2:
        raise ConfigError(f"{where}: {frames} frame(s) are one latent frame of {patch[0]}; a model that "
                          "keeps the first frame clean (per-token timesteps) needs at least one more to learn")
    if context is None or context.dim() != 2 or context.shape[1] != flavor.text_dim:
        raise ConfigError(f"{where}: caption states of shape {None if context is None else list(context.shape)}; "
                          f"the model takes (tokens, {flavor.text_dim}) (model.overrides.text_dim)")
    return video
