"""Counting the samples that are left out, so bad data is reported instead of silently trained on (or dropped).

A corrupt image, a sample whose image placeholders do not match its images, a malformed record, or a sample
too long for a row is skipped and counted per reason with the first place it happened; the dataset logs one
summary line. With ``strict=True`` the first one raises a :class:`~loongforge.data.errors.DataError` naming the
file and line (or shard and member) instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.data.errors import DataError

#: reason -> (singular, plural) as printed.
REASONS: dict[str, tuple[str, str]] = {
    "corrupt": ("corrupt image", "corrupt images"),
    "mismatch": ("image-token mismatch", "image-token mismatches"),
    "malformed": ("malformed record", "malformed records"),
    "too_long": ("sample longer than a row", "samples longer than a row"),
}


@dataclass
class SkipReport:
    """Skipped samples per reason, with the first ``where`` and detail of each."""

    strict: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)

    def skip(self, reason: str, where: str, detail: str) -> None:
        """Count one skipped sample; raises instead when strict."""
        if reason not in REASONS:
            raise ValueError(f"unknown skip reason {reason!r}")
        if self.strict:
            raise DataError(f"{where}: {detail} (strict data checking is on; set strict: false to skip such "
                            "samples with a counted warning)")
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, f"{where}: {detail}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self, seen: int) -> str:
        """``skipped 3 of 1000 samples: 2 corrupt images (first: a.tar:x.jpg: ...), 1 ...`` (or ``""``)."""
        if not self.total:
            return ""
        parts = []
        for reason, count in self.counts.items():
            singular, plural = REASONS[reason]
            parts.append(f"{count} {singular if count == 1 else plural} (first: {self.first[reason]})")
        return f"skipped {self.total} of {seen} samples: {', '.join(parts)}"
