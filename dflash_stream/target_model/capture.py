"""Capture the selected decoder layers' outputs with forward hooks, and stop the forward after the deepest one.

Only the selected layers are kept (never `output_hidden_states=True` over all of them), and the layers after the
deepest one, the final norm and the LM head never run. Layer id i is the output of decoder layer i, which is
`hidden_states[i + 1]` of transformers' `output_hidden_states` tuple, except for the last layer: transformers
puts the final-normed state there, while this captures the layer's own (pre-norm) output, as vLLM's aux layers
do. That is the verifier's state (`target_model.layers.stored_layer_ids`): with it the forward runs through the
last layer and still stops before the final norm and the LM head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch


class _StopForward(Exception):
    """Raised by the deepest layer's hook: nothing after it is needed."""


def decoder_layers(model) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: cannot find its decoder layers (expected get_decoder().layers)")
    return layers


class LayerCapture:
    """`capture(input_ids, attention_mask)` -> bf16 [B, T, K*D], the K listed layers side by side in the list's
    order (a layer listed twice appears twice).

    The hooks stay registered but act only inside a capture call or `recording()`, so `generate` on the same
    model is otherwise unaffected.
    """

    def __init__(self, model, layer_ids: list[int]) -> None:
        layers = decoder_layers(model)
        if not layer_ids or max(layer_ids) >= len(layers):
            raise ValueError(f"layer ids {layer_ids} do not fit a target with {len(layers)} decoder layers")
        self.base = model.get_decoder()
        self.layer_ids = list(layer_ids)
        self._deepest = max(layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self._active = False
        self._recording: dict[int, list[torch.Tensor]] | None = None
        self._handles = [layers[i].register_forward_hook(partial(self._hook, i)) for i in dict.fromkeys(layer_ids)]

    def _hook(self, layer_id: int, module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if (steps := self._recording) is not None:
            # After the prompt, a forward adds one token: the last position (a target without a KV cache, e.g.
            # use_cache false in its config, runs the whole sequence again at every step).
            steps[layer_id].append((hidden[:, -1:] if steps[layer_id] else hidden).to(torch.bfloat16))
            return
        if not self._active:
            return
        self._captured[layer_id] = hidden.to(torch.bfloat16)
        if layer_id == self._deepest:
            raise _StopForward

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._captured.clear()
        self._active = True
        try:
            self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            self._active = False
        states = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return states

    @contextmanager
    def recording(self) -> Iterator[Callable[[], torch.Tensor]]:
        """Inside, every forward of the model records the layers' outputs and runs to its end (a generation: the
        prompt's forward, then one per decoding step, each adding the last position only); the yielded function
        joins what was recorded along time, bf16 [B, T, K*D] in `capture`'s layout."""
        steps: dict[int, list[torch.Tensor]] = {i: [] for i in self.layer_ids}
        self._recording = steps
        try:
            yield lambda: torch.cat([torch.cat(steps[i], dim=1) for i in self.layer_ids], dim=-1)
        finally:
            self._recording = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
