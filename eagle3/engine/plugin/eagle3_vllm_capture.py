"""A vLLM KV connector that writes captured target hidden states, on CPU and GPU.

Loaded by vLLM (inside the ENGINE virtualenv, never the project's) by module path, together
with the `extract_hidden_states` speculative method. It sits alone in this directory, which is
the only one of the project on the engine's PYTHONPATH (the package's parent would be the
project's site-packages once installed as a wheel: its torch and transformers would shadow the
engine's); hence a top-level module name of its own::

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}}'
    --kv-transfer-config '{"kv_connector": "HiddenStatesConnector",
        "kv_connector_module_path": "eagle3_vllm_capture", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'

(`eagle3.engine.capture.capture_engine_args` builds both, and reads the files.) Each finished request writes
`DIR/<request id>.safetensors` with `hidden_states` [tokens, len(ids), hidden] in the model
dtype and `token_ids` [tokens] (the prompt; with `kv_transfer_params.include_output_tokens`
the prompt plus all output tokens but the last). The response's
`kv_transfer_params.hidden_states_path` names the file; `.lock` beside it is held until the
file is complete (`load_hidden_states` waits on it).

IDs are vLLM's: id k = the residual stream after k decoder layers = HF `hidden_states[k]`
(id 0 = embeddings; id L = after the last layer, BEFORE the final norm). The project's aux id
k (output of decoder layer k) is vLLM id k + 1.

vLLM's own ExampleHiddenStatesConnector copies through a CUDA stream into pinned memory, which
kills the CPU engine ("pin_memory=True requires a CUDA or other accelerator backend"). This
subclass keeps that path on CUDA and, anywhere else, gathers the rows from the KV tensor and
writes the file synchronously. It imports only vllm, torch and safetensors: the engine venv's
transformers is older than the project's, so nothing else of eagle3 may be imported here.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    cleanup_hidden_states,
    extract_from_kv_cache,
    load_hidden_states,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["HiddenStatesConnector", "load_hidden_states", "cleanup_hidden_states"]


class _Done:
    """Stands in for the CUDA event the base class polls in get_finished: already complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Flat KV slots of a request's blocks, in token order."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector without CUDA-only copies off CUDA (see module docstring)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)  # async DtoH through pinned memory
            return
        num_tokens = int(pending.token_ids.shape[0])
        slots = slot_mapping(pending.block_ids, self._block_size)
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens)
        tensors = {
            "hidden_states": hidden.contiguous().clone(),  # own the rows: blocks get reused
            "token_ids": pending.token_ids.clone(),
        }
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(
                pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            tmp = pending.filename + ".tmp"
            save_file(tensors, tmp)
            os.replace(tmp, pending.filename)  # readers never see a half-written file
        except Exception as err:  # keep the engine alive; the client sees no file
            logger.error("hidden-states write failed for %s: %r", pending.req_id, err)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX
        self._req_copy_events[pending.req_id] = _Done()  # reported done in get_finished
