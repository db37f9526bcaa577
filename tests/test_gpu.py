"""CUDA paths: compiled FlexAttention vs SDPA, bf16 autocast, the extractor's out-of-memory back-off, the trainer's
frozen head on the device, pinned side-stream host copies. `pytest -m gpu` on a GPU machine (scripts/gpu-check);
skipped without CUDA. Targets are random-weight models from the bundled config and tokenizer (no download)."""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_stream.bench.synthetic import DEMO_DATA, build_target, build_tokenizer, save_target, target_config
from dflash_stream.config import config_from_dict
from dflash_stream.drafter import DFlashDrafter, DrafterSpec, TargetHead, dflash_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check on a GPU machine)"),
]
CUDA = torch.device("cuda")
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 12, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192}
LAYERS = [1, 3, 5, 7, 9]  # the DFlash rule over 12 layers


def spec(**kw) -> DrafterSpec:
    base = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_attention_heads=4, num_key_value_heads=1,
                head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, vocab_size=8192, block_size=16, mask_token_id=8191,
                target_layer_ids=[0, 1, 2], num_target_layers=4, max_position_embeddings=4096)
    return DrafterSpec(**{**base, **kw})


def random_batch(s: DrafterSpec, n: int = 3, length: int = 320, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([length, length - 37, length - 90])[:n]
    mask = torch.arange(length)[None] < lengths[:, None]
    loss_mask = mask & (torch.arange(length)[None] >= 40)  # a prompt, then the response
    return {
        "hidden_states": torch.randn(n, length, s.num_context_layers * s.hidden_size, generator=g).to(CUDA),
        "input_ids": torch.randint(0, s.vocab_size - 1, (n, length), generator=g).to(CUDA),
        "loss_mask": loss_mask.to(CUDA), "lengths": lengths.to(CUDA),
    }


def head_for(s: DrafterSpec, dtype=torch.float32) -> TargetHead:
    g = torch.Generator().manual_seed(1)
    return TargetHead((torch.randn(s.vocab_size, s.hidden_size, generator=g) * 0.02).to(CUDA, dtype))


def loss_and_grads(drafter, head, batch, bf16: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    drafter.zero_grad(set_to_none=True)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = dflash_loss(drafter, head, batch, num_anchors=32, gamma=7.0, generator=generator)
    out.loss.backward()
    return out.loss.detach().float(), [p.grad.detach().float().clone() for p in drafter.parameters()]


def test_compiled_flex_equals_sdpa_forward_and_backward():
    """The CUDA default (`auto`: compiled FlexAttention with a BlockMask) gives the dense-mask SDPA loss and
    gradients, in float32."""
    s = spec()
    torch.manual_seed(0)
    flex = DFlashDrafter(s, attention="flex").to(CUDA)
    sdpa = DFlashDrafter(s, attention="sdpa").to(CUDA)
    sdpa.load_state_dict(flex.state_dict())
    head, batch = head_for(s), random_batch(s)
    loss_f, grads_f = loss_and_grads(flex, head, batch, bf16=False)
    loss_s, grads_s = loss_and_grads(sdpa, head, batch, bf16=False)
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-4, atol=1e-5)
    for (name, _), gf, gs in zip(flex.named_parameters(), grads_f, grads_s, strict=True):
        assert (gf - gs).norm() <= 1e-3 * gs.norm() + 1e-9, name


def test_bf16_autocast_step_is_finite_and_close_to_fp32():
    s = spec()
    torch.manual_seed(0)
    # SDPA: no second compile here; bench gpu checks compiled FlexAttention against SDPA in bf16.
    drafter = DFlashDrafter(s, attention="sdpa").to(CUDA)
    batch = random_batch(s, seed=1)
    loss32, grads32 = loss_and_grads(drafter, head_for(s), batch, bf16=False)
    loss16, grads16 = loss_and_grads(drafter, head_for(s, torch.bfloat16), batch, bf16=True)
    assert torch.isfinite(loss16) and all(torch.isfinite(g).all() for g in grads16)
    assert abs(loss16 - loss32) / loss32 < 1e-2
    cosine = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in grads16]),
                                                   torch.cat([g.flatten() for g in grads32]), dim=0)
    assert cosine > 0.99
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


def test_pinned_side_stream_copies_equal_synchronous_ones():
    """The extractor's host copies: pinned, right, and safe from the allocator reusing the device memory while
    the copy runs (the source is freed and overwritten on the forward's stream before the copy is awaited)."""
    from dflash_stream.target_model.host_copy import HostCopier

    copier = HostCopier(CUDA)
    pending, expected, fills = [], [], []
    for i, rows in enumerate((257, 1024, 3000)):
        states = (torch.randn(2, rows, 640, device=CUDA) * (i + 1)).to(torch.bfloat16)
        expected.append(states.cpu())
        with torch.cuda.stream(copier.stream):
            torch.cuda._sleep(50_000_000)  # the copy starts late: the forward stream races ahead meanwhile
        pending.append(copier.copy(states))
        del states
        # Without record_stream the allocator would hand the freed block to this fill before the copy ran.
        fills.append(torch.full((2, rows, 640), float("nan"), device=CUDA, dtype=torch.bfloat16))
    for (host, ready), want in zip(pending, expected, strict=True):
        ready.synchronize()
        assert host.is_pinned() and not host.is_cuda
        assert torch.equal(host.view(torch.int16), want.view(torch.int16))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def demo_cfg(tmp_path, target: str, **sections):
    tree = {
        "output_dir": str(tmp_path / "out"),
        "target": {"model": target, "device": "cuda", "dtype": "bfloat16", "layer_ids": LAYERS},
        "data": {"sources": [{"path": str(DEMO_DATA / "sharegpt_chats.jsonl"), "weight": 4},
                             {"path": str(DEMO_DATA / "openai_messages.jsonl"), "weight": 4}]},
        "store": {"path": str(tmp_path / "store"), "budget": "8GB", "segment_bytes": "16MiB"},
        "drafter": {"num_layers": 1, "attention": "sdpa"},
        "train": {"batch_tokens": 2048, "num_anchors": 16, "max_steps": 2, "checkpoint_every": 2},
    }
    for key, value in sections.items():
        tree[key] = {**tree.get(key, {}), **value}
    return config_from_dict(tree)


def extract(cfg, model, tokenizer):
    from dflash_stream.observe.metrics import MetricsWriter
    from dflash_stream.pipeline.common import open_store
    from dflash_stream.pipeline.extractor import Extractor
    from dflash_stream.pipeline.roles import RoleInfo

    store = open_store(cfg, LAYERS, model.config.hidden_size)
    metrics = MetricsWriter(cfg.output_dir, "extractor", 0)
    extractor = Extractor(cfg, RoleInfo("extractor", 0, 1, 0, 1), store, metrics, CUDA, target=(model, tokenizer))
    extractor.run()
    metrics.close()
    return extractor, store


def test_extractor_out_of_memory_back_off_recovers(tmp_path, tokenizer, caplog):
    """With the device filled to near-full, a forward budget far too large runs out of memory; the extractor
    halves its budget until batches fit, and every sample reaches the store with the states a roomy device
    gives (the forward is per sample, so batch composition changes nothing beyond bf16 rounding)."""
    from dflash_stream.target_model.capture import LayerCapture

    config = target_config(**{**SMALL, "hidden_size": 1024, "intermediate_size": 8192, "head_dim": 128})
    model = build_target(config, CUDA, torch.bfloat16)
    cfg = demo_cfg(tmp_path, "synthetic", extract={"batch_tokens": 2**18})
    capture = LayerCapture(model, LAYERS)
    probe = torch.randint(0, 5000, (4, 256), device=CUDA)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    capture(probe, torch.ones_like(probe))  # also creates the cuBLAS handle and workspace before memory runs out
    per_1k = torch.cuda.max_memory_allocated() - base  # the forward's peak at 1024 tokens
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    headroom = 8 * per_1k  # room for about 8k tokens: the first, whole-data batch cannot fit
    filler = torch.empty(max(0, free - headroom), dtype=torch.uint8, device=CUDA)
    try:
        with caplog.at_level(logging.WARNING, logger="dflash_stream"):
            extractor, store = extract(cfg, model, tokenizer)
    finally:
        del filler
        torch.cuda.empty_cache()
    assert "out of memory" in caplog.text
    assert extractor.batch_tokens < 2**18
    assert store.status()["samples"] == len(extractor.samples) > 0
    consumer = store.consumer("check")
    claim = consumer.claim(timeout=0)
    stored = consumer.read(claim)[0]
    ids = stored.input_ids[None].to(CUDA)
    alone = capture(ids, torch.ones_like(ids))[0].cpu()
    torch.testing.assert_close(stored.hidden_states.float(), alone.float(), rtol=2e-2, atol=2e-2)


def test_trainer_puts_its_frozen_head_on_the_device(tmp_path, tokenizer):
    """The trainer's embedding and LM head: read from the target's safetensors onto CUDA in bf16 (autocast is on
    there), frozen; two training steps leave them untouched while the drafter moves."""
    from dflash_stream.observe.metrics import MetricsWriter
    from dflash_stream.pipeline.roles import RoleInfo
    from dflash_stream.pipeline.trainer import Trainer
    from dflash_stream.target_model import load_target

    folder = save_target(tmp_path / "target", target_config(**SMALL), tokenizer, CUDA)
    cfg = demo_cfg(tmp_path, str(folder))
    model, tokenizer = load_target(cfg.target, CUDA)
    _, store = extract(cfg, model, tokenizer)
    metrics = MetricsWriter(cfg.output_dir, "trainer", 0)
    trainer = Trainer(cfg, RoleInfo("trainer", 0, 1, 0, 1), store, metrics, CUDA)
    try:
        head = trainer.head
        assert head.embed_weight.device.type == "cuda" and head.embed_weight.dtype == torch.bfloat16
        assert not head.embed_weight.requires_grad and head.lm_head_weight is head.embed_weight  # tied
        assert all(p.device.type == "cuda" for p in trainer.drafter.parameters())
        torch.testing.assert_close(head.embed_weight, model.get_input_embeddings().weight, rtol=0, atol=0)
        before_head = head.embed_weight.clone()
        before_fc = trainer.drafter.fc.weight.detach().clone()
        assert trainer.run()
        assert trainer.steps == 2
        assert head.embed_weight.grad is None and torch.equal(head.embed_weight, before_head)
        assert not torch.equal(trainer.drafter.fc.weight, before_fc)
    finally:
        trainer.close()
        metrics.close()


def test_states_recorded_while_generating_on_cuda_are_the_capture_forwards(tokenizer):
    """In-process regeneration on CUDA in bf16: the states recorded as the answers decode (left padding, the KV
    cache, the recorded steps copied to the host at the end) are the capture forward's over prompt + answer, to
    bf16 kernels' rounding."""
    import numpy as np

    from dflash_stream.config import GenerationConfig
    from dflash_stream.target_model.capture import LayerCapture
    from dflash_stream.target_model.generate import generate_with_states

    model = build_target(target_config(**SMALL), CUDA, torch.bfloat16)
    capture = LayerCapture(model, LAYERS)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 5000, (n,), generator=gen).numpy().astype(np.int32) for n in (40, 17, 29)]
    recorded = generate_with_states(model, tokenizer, prompts, GenerationConfig(), 24, capture)
    for prompt, (answer, states) in zip(prompts, recorded, strict=True):
        assert states.device.type == "cpu" and states.shape == (len(prompt) + len(answer), len(LAYERS) * 256)
        ids = torch.from_numpy(np.concatenate([prompt, np.asarray(answer, dtype=np.int32)]).astype(np.int64))
        alone = capture(ids[None].to(CUDA), torch.ones(1, len(ids), dtype=torch.long, device=CUDA))[0].cpu()
        torch.testing.assert_close(states.float(), alone.float(), rtol=2e-2, atol=2e-2)
