"""``Trainer``: the one object lifecycle hooks receive as ``trainer``, whichever step engine trains the model.

Why one type: a plugin's ``on_step_end`` or ``on_checkpoint_save`` must not care whether a decoder (megatron's
schedules) or a diffusion DiT / robot policy (a plain torch module) is training. The loop
(:mod:`loongforge.train.loop`) advances ``step`` and reads ``should_stop``; the step engine
(:mod:`loongforge.train.engines`) owns the model, optimizer and batches, which this class shows under common
names. Torch-free, so hookspecs and docs can name it without importing a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.train.media import MediaLog, NoMediaLog

if TYPE_CHECKING:
    from loongforge.checkpoint.layout import CheckpointDir
    from loongforge.config.schema import LoongForgeConfig
    from loongforge.devices.base import DeviceBackend
    from loongforge.plugins import PluginHost
    from loongforge.train.engines.base import StepEngine


class Trainer:
    """A training run's state as plugins see it.

    Attributes (read them in any lifecycle hook):

    * ``config`` -- the resolved :class:`~loongforge.config.schema.LoongForgeConfig`;
    * ``host`` -- the :class:`~loongforge.plugins.PluginHost` calling the hooks;
    * ``backend`` -- the :class:`~loongforge.devices.base.DeviceBackend` of the run;
    * ``engine`` -- the step engine (:class:`~loongforge.train.engines.base.StepEngine`); ``engine.name`` is
      ``"megatron"`` or ``"task"`` (:data:`loongforge.models.family.ENGINES`);
    * ``model`` -- megatron engine: this rank's model chunks, a list of megatron-DDP-wrapped modules (one per
      virtual pipeline stage); task engine: the ``torch.nn.Module`` the task built, wrapped by the torch-native
      strategy (DDP, FSDP2 ...) when several processes train;
    * ``optimizer`` -- megatron engine: megatron's optimizer; task engine: ``torch.optim.AdamW`` (or ZeRO-1's
      wrapper); either way ``optimizer.param_groups`` holds each group's current ``lr``;
    * ``scheduler`` -- the learning-rate schedule (megatron-core's ``OptimizerParamScheduler``, for both engines);
    * ``data`` -- where batches come from: the megatron engine's batch iterator (resumable, ``state_dict``), the
      task engine's dataset;
    * ``step`` -- optimizer steps completed (during ``on_step_end``, the step just taken; a step whose update was
      left out, ``training.on_nonfinite: skip_step``, counts too; ``rewind`` sets it back to the checkpoint's);
    * ``rank`` -- this process's global rank (0 in a single-process run);
    * ``output_dir`` -- ``run.output_dir`` as a ``Path``; ``checkpoints`` -- the run's checkpoint directory;
    * ``last_checkpoint`` -- the newest checkpoint this run saved or resumed from (``None`` before one);
      ``healthy_checkpoint`` -- the newest of those saved when no collapse was under way (:mod:`.health`), the one
      ``training.on_nonfinite: rewind`` goes back to;
    * ``expert_tokens`` -- MoE models (megatron engine): the last step's tokens routed to each expert,
      ``[layer][expert]`` over all ranks; ``None`` otherwise.

    Plugins may write two attributes: ``should_stop = True`` ends training after the current step (the final
    checkpoint and summary follow as usual), and ``step_metrics`` -- emptied when a step starts -- collects numbers
    added during the step, recorded with that step's metrics (JSONL, TensorBoard, ``on_step_end``).
    """

    def __init__(self, *, config: LoongForgeConfig, host: PluginHost, backend: DeviceBackend, engine: StepEngine,
                 scheduler: Any, checkpoints: CheckpointDir, rank: int = 0) -> None:
        self.config = config
        self.host = host
        self.backend = backend
        self.engine = engine
        self.scheduler = scheduler
        self.checkpoints = checkpoints
        self.step = 0
        self.rank = rank
        self.output_dir = Path(config.run.output_dir)
        self.last_checkpoint: Path | None = None
        self.healthy_checkpoint: Path | None = None
        #: Whether the save in flight was made when no collapse was under way (set by the loop's saves).
        self.saving_healthy = True
        self.should_stop = False
        self.step_metrics: dict[str, Any] = {}
        #: Where the run's pictures go (the trackers of ``logging.trackers``); set by the run before training.
        self.media: MediaLog = NoMediaLog()

    @property
    def model(self) -> Any:
        return self.engine.model

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def data(self) -> Any:
        return self.engine.data

    @property
    def expert_tokens(self) -> list[list[int]] | None:
        return self.engine.expert_tokens
