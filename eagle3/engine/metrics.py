"""vLLM's spec-decode counters from GET /metrics (Prometheus text) and windows between scrapes.

before = server.spec_decode_metrics()
...                                    # requests through the server
window = server.spec_decode_metrics() - before
print(window.tau, window.per_position_acceptance)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_PREFIX = "vllm:spec_decode_"


@dataclasses.dataclass(frozen=True)
class SpecDecodeMetrics:
    """vLLM's spec-decode counters (summed over engines/models), or a window between two
    scrapes (`later - earlier`)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = ()

    @property
    def tau(self) -> float:
        """Tokens per verification step: 1 + accepted / drafts (nan without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (nan without drafts)."""
        if not self.num_draft_tokens:
            return math.nan
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft token i accepted) per position = accepted at i / drafts."""
        if not self.num_drafts:
            return [math.nan] * len(self.accepted_per_position)
        return [a / self.num_drafts for a in self.accepted_per_position]

    def __sub__(self, other: SpecDecodeMetrics) -> SpecDecodeMetrics:
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = list(self.accepted_per_position) + [0.0] * (n - len(self.accepted_per_position))
        theirs = list(other.accepted_per_position) + [0.0] * (n - len(other.accepted_per_position))
        return SpecDecodeMetrics(
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted_tokens - other.num_accepted_tokens,
            tuple(a - b for a, b in zip(mine, theirs)),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
        }


def parse_spec_decode_metrics(text: str) -> SpecDecodeMetrics:
    """Prometheus text from GET /metrics -> SpecDecodeMetrics (zeros when spec decode is off)."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith(_PREFIX):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if not name.endswith("_total"):
            continue  # *_created timestamps and anything else
        key = name[len(_PREFIX) : -len("_total")]
        try:
            number = float(value)
        except ValueError:
            continue
        if key in totals:
            totals[key] += number
        elif key == "num_accepted_tokens_per_pos":
            pos = dict(_LABEL.findall(labels)).get("position")
            if pos is not None and pos.isdigit():
                per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + number
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecDecodeMetrics(accepted_per_position=positions, **totals)


def parse_requests_served(text: str) -> int:
    """Prometheus text from GET /metrics -> the requests the server finished
    (vllm:request_success_total, summed over engines and finish reasons but abort)."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != "vllm:request_success_total":
            continue
        if dict(_LABEL.findall(m.group(2) or "")).get("finished_reason") != "abort":
            total += float(m.group(3))  # an aborted request (client gone) was not served
    return int(total)
