"""The serving engine (vLLM, in a virtualenv of its own) from the project's side.

kinds: the engines there are (ENGINES, what --engine and target.engine.kind accept). venv:
which python runs the engine. choice: the dtype and attention backend it serves with. server: a
managed vLLM server (VLLMServer, vllm_server, the CLIs' engine flags). sizing: the context a
server is told to hold for given prompts (engine_context). client: the HTTP interface of any
server (EngineClient). metrics: its spec-decode counters. capture: the hidden-state capture
protocol, with the engine-side plugin in plugin/. served_target: a target whose forwards run in
the engine (ServedTarget). Nothing here imports vLLM.
"""
