"""A batch of sequences passed between the trainer and its workers.

Tensors share the first (batch) dimension; ``meta`` holds per-row python values
(ground truth, data source, ...) as lists of the same length. This is the unit the
single controller splits across workers and gathers back in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {name: t.shape[0] for name, t in self.tensors.items()}
        sizes.update({name: len(v) for name, v in self.meta.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if len(self) and value.shape[0] != len(self):
            raise ValueError(f"{name} has {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.meta

    def update(self, tensors: dict[str, torch.Tensor]) -> Batch:
        for name, value in tensors.items():
            self[name] = value
        return self

    def select(self, rows: torch.Tensor | Sequence[int] | slice) -> Batch:
        """The rows ``rows`` (indices or a slice), in that order."""
        if isinstance(rows, slice):
            idx = list(range(len(self)))[rows]
        else:
            idx = [int(i) for i in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]
        index = torch.tensor(idx, dtype=torch.long)
        return Batch(
            {k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()},
            {k: [v[i] for i in idx] for k, v in self.meta.items()},
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` rows (the last may be shorter)."""
        return [self.select(slice(start, start + size)) for start in range(0, len(self), size)]

    def chunk(self, parts: int) -> list[Batch]:
        """``parts`` consecutive, equal chunks (the batch size must divide evenly)."""
        if len(self) % parts:
            raise ValueError(f"a batch of {len(self)} rows cannot be split evenly into {parts} parts")
        return self.split(len(self) // parts)

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated ``n`` times in place (row i becomes rows i*n .. i*n+n-1)."""
        return Batch(
            {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()},
            {k: [x for x in v for _ in range(n)] for k, v in self.meta.items()},
        )

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta))

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        batches = list(batches)
        if not batches:
            return Batch()
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in batches[0].tensors}
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        return Batch(tensors, meta)
