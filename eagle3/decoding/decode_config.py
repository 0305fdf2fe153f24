"""DecodeConfig: how a drafter proposes (chain or tree, their sizes) and how the target verifies
(temperature), checked once where it is built."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.errors import Eagle3Error


@dataclass
class DecodeConfig:
    mode: str = "chain"  # chain | tree
    steps: int = 7  # chain: draft tokens per verification step
    topk: int = 10  # tree: children per expanded node, nodes expanded per depth
    total_tokens: int = 60  # tree: tokens the target verifies per step, root included
    depth: int = 8  # tree: maximum draft depth
    temperature: float = 0.0  # 0 = greedy; > 0 = exact speculative sampling
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in ("chain", "tree"):
            problems.append(f"mode {self.mode!r} is not 'chain' or 'tree'")
        if self.steps < 1 or self.topk < 1 or self.depth < 1:
            problems.append("steps, topk and depth must be >= 1")
        if self.total_tokens < 2:
            problems.append("total_tokens must be >= 2 (the root plus one candidate)")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            problems.append("max_new_tokens must be >= 1")
        if problems:
            raise Eagle3Error("; ".join(problems))

    @property
    def max_depth(self) -> int:
        """Deepest draft position a step can offer (columns alpha_1..alpha_k)."""
        return self.steps if self.mode == "chain" else self.depth
