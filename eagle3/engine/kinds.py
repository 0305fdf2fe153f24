"""The serving engines the project drives: what `--engine` and `target.engine.kind` accept.

Its own module so that a config check can name them without importing the managed server
(eagle3.engine.server)."""

ENGINES = ("vllm",)
