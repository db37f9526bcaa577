"""vLLM KV connector that writes the hidden states of the requests that ask for them into a spool folder.

Loaded by a vLLM server started with the `extract_hidden_states` speculative method (`dflash-stream
serve-command` prints the flags) through `kv_connector_module_path`; this file imports only vLLM, torch,
safetensors and the standard library, as it runs in vLLM's environment.

It is vLLM's ExampleHiddenStatesConnector (as of vLLM 0.32, whose internals it extends) with three changes:

- Only a request whose `kv_transfer_params` name a spool file (`{"dflash_spool_file": "NAME.safetensors"}`, a
  bare file name) gets a file, in the folder `kv_connector_extra_config.shared_storage_path`. Other requests
  (plain regeneration answers on the same server) write nothing, so they cannot fill the spool.
- A file appears under its name only once it is complete: it is written as NAME.partial and renamed. A reader
  never sees half a file and needs no lock; a server killed mid-write leaves a `.partial` the client removes.
- On a CPU the states are copied out of the cache synchronously (the stock connector needs CUDA streams and
  pinned memory); on CUDA the stock path runs (a side copy stream into pinned host buffers).

A file holds `hidden_states` [tokens, layers, hidden] in the model's dtype and `token_ids` [tokens] (int64).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

SPOOL_FILE_KEY = "dflash_spool_file"
"""The `kv_transfer_params` key naming the file a request's states go to."""
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")


class _Copied:
    """Stands for the CUDA event of a copy that is already done (a CPU copy is synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class DFlashHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Hidden states of the requests that name a spool file, written atomically into the spool folder."""

    @staticmethod
    def _write_tensors(tensors: dict[str, torch.Tensor], event: Any, filename: str, lock_fd: int | None) -> None:
        partial_name = filename + PARTIAL_SUFFIX
        try:
            event.synchronize()
            save_file(tensors, partial_name)
            os.replace(partial_name, filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def build_connector_meta(self, scheduler_output) -> ExampleHiddenStatesConnectorMetadata:
        meta = ExampleHiddenStatesConnectorMetadata()
        meta.pending_saves = list(self._pending_saves.values())
        self._pending_saves.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = new_req.sampling_params.extra_args if new_req.sampling_params else None
            name = ((extra or {}).get("kv_transfer_params") or {}).get(SPOOL_FILE_KEY)
            if name is None:
                continue  # a request that wants no states: no file
            if not isinstance(name, str) or not _NAME.match(name):
                logger.warning("request %s: %s %r is not a bare NAME.safetensors file name; no states written",
                               new_req.req_id, SPOOL_FILE_KEY, name)
                continue
            filename = os.path.join(self._storage_path, name)
            self._request_filenames[new_req.req_id] = filename
            meta.new_req_filenames[new_req.req_id] = filename
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # A request aborted before its prompt was computed has no states worth a file.
        if request.num_computed_tokens < len(request.prompt_token_ids or ()):
            self._request_filenames.pop(request.request_id, None)
            return False, None
        return super().request_finished(request, block_ids)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        # Advanced indexing copies: the cache blocks may be freed as soon as this returns.
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        copied = _Copied()
        future: Future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, None)
        self._req_copy_events[pending.req_id] = copied  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
