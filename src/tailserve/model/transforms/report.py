"""What a model transform did, for the log and for tests: modules swapped, memory added."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransformReport:
    """``swapped``: how many modules of each original type were replaced (by type name);
    ``bytes_added``: memory the transform added (weight copies less weights released)."""

    bytes_added: int = 0
    swapped: dict[str, int] = field(default_factory=dict)

    @property
    def num_swapped(self) -> int:
        return sum(self.swapped.values())
