"""What a certification proved: one :class:`Check` per comparison, and the :class:`Certificate` that holds them,
written as JSON and shown as a table."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

#: Distributions a certificate records the versions of (what the numbers depend on).
VERSIONED = ("loongforge-core", "torch", "megatron-core")


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison with the CPU reference on one recipe: its largest relative difference against its tolerance,
    and where it parts (or what it compared, when it holds)."""

    recipe: str
    name: str
    passed: bool
    measured: float
    tolerance: float
    detail: str


@dataclasses.dataclass
class Certificate:
    """The checks run on ``device`` in ``precision`` (in order) for each recipe (name -> what it trains), the
    versions they ran with and the device's speed on each recipe relative to the CPU reference (steps per second)."""

    device: str
    precision: str
    recipes: dict[str, str]
    steps: int
    #: The kinds of check this certification ran (``--checks``); a certificate proves those only.
    scope: tuple[str, ...] = ()
    #: Whether ``scope`` is every kind of check there is.
    complete: bool = True
    checks: list[Check] = dataclasses.field(default_factory=list)
    speed_vs_reference: dict[str, float] = dataclasses.field(default_factory=dict)
    #: ``device``: a backend against the CPU reference; ``family``: model families held to the conformance suite.
    kind: str = "device"
    versions: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: a difference that could not be measured (a run that failed, ``inf``/``nan``) as a string."""
        record = {**dataclasses.asdict(self), "passed": self.passed}
        for check in record["checks"]:
            if not math.isfinite(check["measured"]):
                check["measured"] = str(check["measured"])
        return record

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n", encoding="utf-8")

    def render(self) -> str:
        """The table a person reads: one row per check, the verdict last."""
        if self.kind == "family":
            rows = [f"certificate: model famil{'y' if len(self.recipes) == 1 else 'ies'} "
                    f"{', '.join(self.recipes)}, held to the conformance suite (ModelFamilySuite) on {self.device}"]
        else:
            rows = [f"certificate: device {self.device}, {self.precision}, {self.steps} steps of each recipe against "
                    "the CPU reference"]
        rows += [f"  {name}: {description}" for name, description in self.recipes.items()]
        first = max([len("family" if self.kind == "family" else "recipe"), *(len(c.recipe) for c in self.checks)])
        second = max([len("check"), *(len(c.name) for c in self.checks)])
        numbers = self.kind != "family"  # the suite's checks pass or fail; they measure no difference
        rows.append(f"{'family' if not numbers else 'recipe':{first}s} {'check':{second}s} {'result':6s} "
                    + (f"{'max rel diff':>12s} {'tolerance':>10s}  " if numbers else "") + "detail")
        for check in self.checks:
            rows.append(f"{check.recipe:{first}s} {check.name:{second}s} {'pass' if check.passed else 'FAIL':6s} "
                        + (f"{check.measured:12.3g} {check.tolerance:10.3g}  " if numbers else "") + check.detail)
        if self.speed_vs_reference:
            rows.append("speed (steps per second against the CPU reference's): "
                        + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in self.speed_vs_reference.items()))
        rows.append(f"versions: {', '.join(f'{k} {v}' for k, v in self.versions.items())}")
        failed = [f"{check.recipe}: {check.name}" for check in self.checks if not check.passed]
        partial = "" if self.complete else f" for {', '.join(self.scope)} only (a partial certification)"
        rows.append("verdict: " + (f"FAILED ({', '.join(failed)})" if failed else f"certified{partial}"))
        return "\n".join(rows)


def installed_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "(not installed)"
    return found

