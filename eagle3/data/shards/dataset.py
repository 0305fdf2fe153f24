"""Reading shards: ShardDataset, the records of a finished capture as offline training reads
them (lazily memory-mapped, each record checked on its first read)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from eagle3.data.shards.format import (
    FORMAT_VERSION,
    INDEX,
    META,
    fp8_scales,
    read_index,
    read_index_file,
    read_meta,
)
from eagle3.data.shards.integrity import (
    ShardProblem,
    by_shard,
    damage_text,
    record_xxh3,
    shard_problem,
)
from eagle3.errors import Eagle3Error


class ShardDataset(torch.utils.data.Dataset):
    """Records of a capture directory: ``ds[i]`` -> {"id", "input_ids" long [T], "loss_mask"
    long [T], "aux_hidden" [T, 3H], "last_hidden" [T, H]} with hidden states in `dtype`
    (float32 by default; fp8 tensors are de-scaled). Shards are memory-mapped lazily.

    `max_length` cuts longer records to their first `max_length` tokens (``truncated`` counts
    them), as online training cuts its token records. Raises Eagle3Error for a directory that
    is not a finished capture (``allow_incomplete`` reads what an interrupted one has so far),
    and for a damaged or missing shard: sizes at construction, each record's xxh3 when it is
    read (see Integrity in eagle3.data.shards).
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        allow_incomplete: bool = False,
        max_length: int | None = None,
    ):
        self.dir = Path(out_dir)
        self.dtype = dtype
        meta = read_meta(self.dir)
        if meta is None:
            raise Eagle3Error(
                f"{self.dir} is not a hidden-state capture (no {META}); "
                "create one with `python -m datagen.capture`"
            )
        if not meta.get("complete") and not allow_incomplete:
            raise Eagle3Error(
                f"the capture in {self.dir} did not finish; re-run `python -m datagen.capture` "
                "with the same arguments to complete it"
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise Eagle3Error(
                f"{self.dir} has shard format {meta.get('format_version')}, this code reads "
                f"{FORMAT_VERSION}; capture again"
            )
        self.meta = meta
        # the fp8 tensors and their scales; a capture from before meta recorded them: its dtype's
        self.fp8_scales = meta.get("fp8_scales", fp8_scales(meta.get("dtype", "bf16")))
        self.index = read_index(self.dir) if allow_incomplete else read_index_file(self.dir / INDEX)
        shards = by_shard(self.index)
        self._records = {name: n for name, (_, n) in shards.items()}  # per shard, for errors
        problems = [
            ShardProblem(name, why, n)
            for name, (entry, n) in shards.items()
            if (why := shard_problem(self.dir, name, entry, checksum=False))
        ]
        if problems:
            raise Eagle3Error(damage_text(self.dir, meta, problems))
        self.truncated = 0
        if max_length is not None:  # every reader of the index sees the cut length
            self.truncated = sum(int(e["length"]) > max_length for e in self.index)
            self.index = [
                {**e, "length": max_length, "stored_length": e["length"]}
                if e["length"] > max_length
                else e
                for e in self.index
            ]
        self.lengths = [int(e["length"]) for e in self.index]
        self._files: dict[str, Any] = {}
        self._checked: set[tuple[str, int]] = set()  # (shard, offset) whose xxh3 matched here

    @property
    def ids(self) -> list[str]:
        return [str(e["id"]) for e in self.index]

    def __len__(self) -> int:
        return len(self.index)

    def subset(self, keep: list[int]) -> ShardDataset:
        """The same capture restricted to records `keep` (in that order); nothing is read."""
        part = copy.copy(self)
        part.index = [self.index[i] for i in keep]
        part.lengths = [self.lengths[i] for i in keep]
        part._files = {}
        return part

    def __getstate__(self) -> dict:  # open shard handles do not pickle (DataLoader workers)
        return {**self.__dict__, "_files": {}}

    def _damaged(self, name: str, problem: str) -> Eagle3Error:
        return Eagle3Error(
            damage_text(self.dir, self.meta, [ShardProblem(name, problem, self._records[name])])
        )

    def open_shard(self, name: str):
        """safe_open of shard `name`; a header that does not parse is the shard's Eagle3Error."""
        try:
            return safe_open(str(self.dir / name), framework="pt")
        except (SafetensorError, OSError) as err:
            raise self._damaged(name, f"unreadable ({err})") from err

    def _file(self, name: str):
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = self.open_shard(name)
        return f

    def _read(self, e: dict) -> dict[str, torch.Tensor]:
        """Record `e`'s rows of every tensor of its shard, checked against its xxh3 (all of
        them, also past a max_length cut, as the hash covers them; then cut)."""
        f = self._file(e["shard"])
        a = e["offset"]
        b = a + e.get("stored_length", e["length"])
        try:
            rows = {key: f.get_slice(key)[a:b] for key in f.keys()}
        except (SafetensorError, KeyError, ValueError, RuntimeError) as err:
            raise self._damaged(e["shard"], f"unreadable ({err})") from err
        want, key = e.get("xxh3"), (e["shard"], a)
        if want is not None and key not in self._checked:  # once per record and process
            if (got := record_xxh3(rows, 0, b - a)) != want:
                why = f"damaged (record {e['id']} reads with xxh3 {got}, {want} when written)"
                raise self._damaged(e["shard"], why)
            self._checked.add(key)
        if "stored_length" in e:
            rows = {k: v[: e["length"]] for k, v in rows.items()}
        return rows

    def __getitem__(self, i: int) -> dict:
        e = self.index[i]
        rows = self._read(e)
        hidden = {}
        for name in ("aux_hidden", "last_hidden"):
            x = rows[name]
            if name in self.fp8_scales:  # one scale per token and layer: (T, 3) or (T, 1)
                t, scale = x.shape[0], rows[self.fp8_scales[name]]
                x = (x.float().view(t, scale.shape[1], -1) * scale[..., None]).view(t, -1)
            hidden[name] = x.to(self.dtype)
        return {
            "id": e["id"],
            "input_ids": rows["input_ids"].long(),
            "loss_mask": rows["loss_mask"].long(),
            **hidden,
        }
