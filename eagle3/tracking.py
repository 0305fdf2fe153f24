"""Weights & Biases settings shared by training and evaluation."""

from __future__ import annotations

import os


def wandb_mode(requested: str = "auto") -> str:
    """auto -> $WANDB_MODE when set, else online only when an API key is configured, else
    offline (never a login prompt, never a network wait)."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"
