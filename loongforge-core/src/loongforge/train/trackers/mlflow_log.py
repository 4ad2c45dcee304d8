"""The ``mlflow`` tracker (extra ``loongforge-core[mlflow]``): an MLflow run, through ``MlflowClient`` (no
process-global active run, so two runs in one process stay apart).

Where: ``logging.mlflow_uri``, by default a file store inside the run, ``file:<output_dir>/mlruns`` (MLflow 3 keeps
file stores behind ``MLFLOW_ALLOW_FILE_STORE``; the default store is ours, so it is allowed for it and only for it).
Metrics are ``<group>/<name>`` at their step, the resolved config the run's params (``section.key``), each picture
an artifact ``<tag>/step<step>-<index>.png|gif`` with the captions of a call in ``<tag>/step<step>-captions.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.train.media import gif_bytes
from loongforge.train.trackers import Scalar, Tracker, rgb

if TYPE_CHECKING:
    import numpy as np

    from loongforge.config.schema import LoggingConfig

#: MLflow's limits: entries per ``log_batch`` call and characters of a param value.
_BATCH, _PARAM_CHARS = 100, 6000


class MlflowTracker(Tracker):
    def __init__(self, output_dir: Path, logging: LoggingConfig, *, start_step: int) -> None:
        uri = logging.mlflow_uri
        if uri is None:
            uri = (output_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        self.uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(logging.mlflow_experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(logging.mlflow_experiment))
        self.run_id = self._client.create_run(experiment_id, run_name=output_dir.name).info.run_id
        self.location = f"run {self.run_id} in {uri} (mlflow ui --backend-store-uri {uri})"

    def scalars(self, step: int, values: Mapping[str, float], group: str) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(f"{group}/{name}", float(value), now, step) for name, value in values.items()]
        for start in range(0, len(metrics), _BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start:start + _BATCH])

    def hparams(self, params: Mapping[str, Scalar]) -> None:
        entries = [self._param(key, str(value)[:_PARAM_CHARS]) for key, value in params.items()]
        for start in range(0, len(entries), _BATCH):
            self._client.log_batch(self.run_id, params=entries[start:start + _BATCH])

    def images(self, tag: str, images: Sequence[np.ndarray], captions: Sequence[str], *, step: int) -> None:
        names = {}
        for index, (image, caption) in enumerate(zip(images, captions, strict=True)):
            name = f"step{step:06d}-{index:03d}.png"
            self._client.log_image(self.run_id, rgb(image), artifact_file=f"{tag}/{name}")
            names[name] = caption
        self._client.log_dict(self.run_id, names, f"{tag}/step{step:06d}-captions.json")

    def videos(self, tag: str, videos: Sequence[np.ndarray], captions: Sequence[str], *, step: int,
               fps: int) -> None:
        names = {}
        with tempfile.TemporaryDirectory() as folder:
            for index, (video, caption) in enumerate(zip(videos, captions, strict=True)):
                path = Path(folder) / f"step{step:06d}-{index:03d}.gif"
                path.write_bytes(gif_bytes(video, fps))
                names[path.name] = caption
            Path(folder, f"step{step:06d}-captions.json").write_text(json.dumps(names, indent=1), encoding="utf-8")
            self._client.log_artifacts(self.run_id, folder, artifact_path=tag)

    def table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, step: int) -> None:
        records = [dict(zip(columns, row, strict=True)) for row in rows]
        self._client.log_dict(self.run_id, records, f"{tag}/step{step:06d}.json")

    def flush(self) -> None:
        return None  # every call above has written its files already

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
