"""AcceptanceStats: what speculative decoding counts per verification step (tau, alpha_i, and
each step's context for the by-context tables)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    """tau = mean over verification steps of (accepted draft tokens + 1); alpha_i = accepted at
    depth i / steps that offered a depth-i candidate after accepting depths 1..i-1."""

    steps: int = 0
    accepted_total: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i-1]: steps with >= i accepted
    offered_at: list[int] = field(default_factory=list)  # [i-1]: steps offering depth i
    # (context, accepted, offered) of every step recorded with its context: the tokens before
    # the step's first drafted token (prompt + generated so far); eagle3.evaluation.statistics buckets them
    step_log: list[tuple[int, int, int]] = field(default_factory=list)

    def record(self, accepted: int, offered: int, context: int | None = None) -> None:
        """offered: deepest depth d such that depths 1..d were on offer along the path;
        context: tokens before the first drafted token (None: not known, not logged)."""
        if context is not None:
            self.step_log.append((context, accepted, offered))
        self.steps += 1
        self.accepted_total += accepted
        need = max(accepted, offered)
        for arr in (self.accepted_at, self.offered_at):
            arr.extend([0] * (need - len(arr)))
        for i in range(accepted):
            self.accepted_at[i] += 1
        for i in range(offered):
            self.offered_at[i] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.steps += other.steps
        self.accepted_total += other.accepted_total
        self.step_log.extend(other.step_log)
        for name in ("accepted_at", "offered_at"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def tau(self) -> float:
        return (self.accepted_total + self.steps) / self.steps if self.steps else 0.0

    def alpha(self, k: int | None = None) -> list[float | None]:
        k = len(self.offered_at) if k is None else k
        out: list[float | None] = []
        for i in range(k):
            offered = self.offered_at[i] if i < len(self.offered_at) else 0
            out.append(self.accepted_at[i] / offered if offered else None)
        return out
