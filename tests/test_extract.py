"""The extractor against the real store, on the tiny target: exactly what the data produced, once per pass,
across restarts, out-of-memory retries and regeneration; NaN refused; the `extract` command."""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from importlib.resources import files
from pathlib import Path

import pytest
import torch
import yaml

from dflash_stream.config import config_from_dict
from dflash_stream.observe.metrics import MetricsWriter, read_metrics
from dflash_stream.pipeline.common import open_store
from dflash_stream.pipeline.extractor import Extractor
from dflash_stream.pipeline.roles import RoleInfo
from dflash_stream.pipeline.state_health import NonFiniteStates
from dflash_stream.target_model import load_target
from dflash_stream.target_model.capture import LayerCapture

DEMO = Path(str(files("dflash_stream") / "demo_data"))
LAYERS = [0, 2, 4]
ROLE = RoleInfo("extractor", 0, 1, 0, 1)


def make_cfg(tmp_path: Path, target_dir: Path, **data) -> dict:
    return {
        "output_dir": str(tmp_path / "out"),
        "target": {"model": str(target_dir), "device": "cpu", "layer_ids": LAYERS},
        "data": {"sources": [{"path": str(DEMO / "sharegpt_chats.jsonl")}, {"path": str(DEMO / "openai_messages.jsonl")}],
                 "max_length": 256, **data},
        "extract": {"batch_tokens": 1024, "queue_size": 2},
        "store": {"path": str(tmp_path / "store"), "budget": "20MB", "segment_bytes": 120_000},
        "drafter": {"block_size": 4},
    }


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from dflash_stream.config import TargetConfig

    return load_target(TargetConfig(model=str(tiny_target_dir), device="cpu"), torch.device("cpu"))


def start(tree: dict, target, store=None) -> tuple[Extractor, object]:
    cfg = config_from_dict(tree)
    store = store or open_store(cfg, LAYERS, 64)
    metrics = MetricsWriter(cfg.output_dir, "extractor", 0)
    return Extractor(cfg, ROLE, store, metrics, torch.device("cpu"), target=target), store


def answering(tmp_path: Path, target_dir: Path, prompts: int, **data) -> dict:
    """A config whose extractor regenerates the answers to the first `prompts` bundled prompts (batches of 4)."""
    tree = make_cfg(tmp_path, target_dir, regenerate=True, generation={"max_new_tokens": 12, "batch_size": 4}, **data)
    tree["data"]["sources"] = [{"path": str(DEMO / "prompts_only.jsonl"), "limit": prompts}]
    return tree


def drain(store, consumer_id: str = "check") -> list:
    """Claim, read and release every ready segment (a trainer, minus the training)."""
    consumer = store.consumer(consumer_id)
    out = []
    while (claim := consumer.claim(timeout=0)) is not None:
        out.extend((claim.pass_index, s) for s in consumer.read(claim))
        consumer.release([claim])
    return out


def test_every_pass_stores_every_kept_sample_once(tmp_path, tiny_target_dir, tiny):
    tree = make_cfg(tmp_path, tiny_target_dir)
    tree["train"] = {"epochs": 2, "epoch_source": "reextract"}
    extractor, store = start(tree, tiny)
    store.set_expected_writers(1)
    assert extractor.run() is True and store.end_of_data
    expected = json.loads((tmp_path / "out" / "data" / "report-0.json").read_text())["sample_ids"]
    stored = drain(store)
    per_pass = Counter(p for p, _ in stored)
    assert per_pass == {0: len(expected), 1: len(expected)}
    assert Counter(s.sample_id for _, s in stored) == Counter({i: 2 for i in expected})
    assert extractor.samples_written == 2 * len(expected)
    assert extractor.tokens_written == sum(len(s.input_ids) for _, s in stored)

    # What the store holds is the target's output for that sample alone, with its ids and mask.
    prepared = {s.sample_id: s for s in extractor.samples}
    capture = LayerCapture(tiny[0], LAYERS)
    for _, sample in stored[:3]:
        source = prepared[sample.sample_id]
        assert sample.input_ids.tolist() == source.input_ids.tolist()
        assert sample.loss_mask.tolist() == source.loss_mask.tolist()
        ids = torch.from_numpy(source.input_ids).long()[None]
        alone = capture(ids, torch.ones_like(ids))[0]
        torch.testing.assert_close(sample.hidden_states, alone, atol=2e-2, rtol=2e-2)

    events = [e for e in read_metrics(tmp_path / "out") if e["event"] == "extract"]
    assert events[-1]["samples"] == events[-1]["samples_total"] == 2 * len(expected)
    assert {"tokens", "tok_s", "backpressure_s"} <= set(events[-1])


def test_restart_mid_extraction_writes_nothing_twice_and_misses_nothing(tmp_path, tiny_target_dir, tiny):
    tree = make_cfg(tmp_path, tiny_target_dir)
    tree["store"]["budget"] = "700KB"
    first, store = start(tree, tiny)
    store.set_expected_writers(1)
    assert first.run(until_full=True) is False  # the buffer filled up
    written_before_crash = first.samples_written
    assert 0 < written_before_crash < len(first.samples)
    del first  # a crash: its unwritten batches are gone

    # The restarted extractor alternates with a consumer, as single-process mode does.
    consumed = drain(store)
    second, store = start(tree, tiny, store)
    rounds = 0
    while not second.run(until_full=True):
        consumed += drain(store)
        rounds += 1
    consumed += drain(store)
    assert rounds >= 1
    ids = [s.sample_id for _, s in consumed]
    assert Counter(ids).most_common(1)[0][1] == 1
    assert set(ids) == {s.sample_id for s in second.samples}
    assert second.samples_written == len(second.samples) - written_before_crash


def test_out_of_memory_halves_the_budget_and_loses_no_batch(tmp_path, tiny_target_dir, tiny, caplog):
    extractor, store = start(make_cfg(tmp_path, tiny_target_dir), tiny)
    real = extractor.capture
    seen = []

    def small_device(ids, mask):  # a device that cannot hold more than 300 tokens at once
        if ids.numel() > 300:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        seen.append(ids.shape[0])
        return real(ids, mask)

    extractor.capture = small_device
    # setup_logging (run by any CLI test before this one) stops dflash_stream logs from reaching the root logger.
    logger = logging.getLogger("dflash_stream")
    logger.addHandler(caplog.handler)
    try:
        assert extractor.run() is True
    finally:
        logger.removeHandler(caplog.handler)
    assert extractor.batch_tokens <= 300 and "out of memory" in caplog.text
    assert sum(seen) == len(extractor.samples)
    assert sorted(s.sample_id for _, s in drain(store)) == sorted(s.sample_id for s in extractor.samples)


def test_non_finite_states_are_an_error_naming_the_sample(tmp_path, tiny_target_dir):
    from dflash_stream.config import TargetConfig

    model, tokenizer = load_target(TargetConfig(model=str(tiny_target_dir), device="cpu"), torch.device("cpu"))
    model.model.layers[0].mlp.down_proj.weight.data[0, 0] = float("nan")
    extractor, _ = start(make_cfg(tmp_path, tiny_target_dir), (model, tokenizer))
    with pytest.raises(NonFiniteStates, match=r"sample \d+ \((sharegpt_chats|openai_messages)\.jsonl#\d+\)"):
        extractor.run()


def test_regenerated_responses_are_extracted_and_cached(tmp_path, tiny_target_dir, tiny):
    tree = answering(tmp_path, tiny_target_dir, prompts=6, min_supervised_tokens=4)
    extractor, store = start(tree, tiny)
    assert extractor.run() is True
    stored = {s.sample_id: s for _, s in drain(store)}
    assert len(stored) == 6
    for prompt in extractor.samples:
        sample = stored[prompt.sample_id]
        n = prompt.num_tokens
        assert sample.input_ids[:n].tolist() == prompt.input_ids.tolist()
        assert not sample.loss_mask[:n].any() and sample.loss_mask[n:].all() and len(sample.input_ids) > n
    cache = list((tmp_path / "out" / "data").glob("responses-*.jsonl"))
    assert len(cache) == 1 and len(cache[0].read_text().splitlines()) == 6

    # A later extraction (new store, same output) reuses the responses instead of generating again.
    model, tokenizer = tiny
    tree["store"]["path"] = str(tmp_path / "store2")

    def no_generation(*args, **kwargs):
        raise AssertionError("generate() called although every response is cached")

    again, store2 = start(tree, (model, tokenizer))
    model.generate, real_generate = no_generation, model.generate
    try:
        assert again.run() is True
    finally:
        model.generate = real_generate
    assert {s.sample_id: s.input_ids.tolist() for _, s in drain(store2)} == \
        {i: s.input_ids.tolist() for i, s in stored.items()}


def test_states_recorded_while_generating_are_the_capture_forwards(tmp_path, tiny_target_dir, tiny):
    """In-process regeneration records a sample's states while its answer decodes (when the generation batch's
    states fit extract.batch_tokens), and it skips the capture forward. The store holds what that forward gives
    for prompt + answer, to bf16 rounding: a second extraction, from the cached answers of half the samples by
    forward and the rest generated again (batches that mix both), stores the same states."""
    tree = answering(tmp_path, tiny_target_dir, prompts=8, min_supervised_tokens=2)
    extractor, store = start(tree, tiny)
    assert extractor.run() is True
    first = {s.sample_id: s for _, s in drain(store)}
    assert len(first) == 8 and extractor.summary()["recorded_while_generating"] == 8

    cache = next((tmp_path / "out" / "data").glob("responses-*.jsonl"))
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:4]) + "\n")  # four answers are generated again, four come from the cache
    tree["store"]["path"] = str(tmp_path / "store2")
    again, store2 = start(tree, tiny)
    assert again.run() is True
    assert again.summary()["recorded_while_generating"] == 4
    second = {s.sample_id: s for _, s in drain(store2)}
    assert second.keys() == first.keys()
    for sample_id, sample in second.items():
        assert sample.input_ids.tolist() == first[sample_id].input_ids.tolist()
        torch.testing.assert_close(sample.hidden_states.float(), first[sample_id].hidden_states.float(),
                                   rtol=8e-3, atol=1e-5)  # one bf16 ulp at a rounding edge


def _run_until_idle(extractor, store, outcome: list, timeout: float):
    """The extractor runs in a thread (its result into `outcome`) until its writer says it is idle, it ends, or
    `timeout` passes; returns the thread and the deadline."""
    import threading
    import time

    thread = threading.Thread(target=lambda: outcome.append(extractor.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not store.writers_idle() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return thread, deadline


def test_in_process_regeneration_decodes_whole_generation_batches_from_the_first(tmp_path, tiny_target_dir, tiny):
    """Every window holds a whole data.generation.batch_size of prompts, the first included (each also at least
    the bytes of WINDOW_SEGMENTS segments), and is generated in batches that size: a smaller first batch would
    take most of a whole one's time and leave the trainers waiting for the next."""
    tree = make_cfg(tmp_path, tiny_target_dir, regenerate=True, min_supervised_tokens=2,
                    generation={"max_new_tokens": 6, "batch_size": 8})
    tree["data"]["sources"] = [{"path": str(DEMO / "prompts_only.jsonl"), "limit": 40}]
    tree["store"]["segment_bytes"] = 12_000  # 4 segments are a few prompts: the batch size sets the windows
    extractor, store = start(tree, tiny)
    samples = len(extractor.samples)
    sizes = [len(w) for w in extractor._windows(extractor.samples)]
    assert set(sizes[:-1]) == {8} and 0 < sizes[-1] <= 8 and sum(sizes) == samples > 30

    model, _ = tiny
    batches: list[int] = []
    real_generate = model.generate

    def recorded(*args, **kwargs):
        batches.append(kwargs["input_ids"].shape[0])
        return real_generate(*args, **kwargs)

    model.generate = recorded
    try:
        assert extractor.run() is True
    finally:
        model.generate = real_generate
    assert batches == sizes
    assert sorted(s.sample_id for _, s in drain(store)) == sorted(s.sample_id for s in extractor.samples)


def test_a_blocked_extractor_generates_the_coming_answers_then_says_it_is_idle(tmp_path, tiny_target_dir, tiny):
    """While the full buffer holds the forward loop back, in-process regeneration goes on: the answers of the rest
    of the shard are generated meanwhile (regeneration runs beside training instead of after it), then the writer
    says it is idle (its cores go to the trainers). Once room comes every sample is stored, with those answers."""
    import time

    tree = make_cfg(tmp_path, tiny_target_dir, regenerate=True, min_supervised_tokens=2,
                    generation={"max_new_tokens": 8, "batch_size": 3})
    tree["data"]["sources"] = [{"path": str(DEMO / "prompts_only.jsonl"), "limit": 15}]
    tree["data"]["max_length"] = 64
    # Room for a couple of one-sample segments, one-sample forward batches, windows of 3 samples: the forward loop
    # is held back after a handful of samples, long before the last window.
    tree["store"].update(budget=505_000, segment_bytes=12_000)
    tree["extract"].update(batch_tokens=64, queue_size=1)
    extractor, store = start(tree, tiny)
    store.set_expected_writers(1)
    assert [len(w) for w in extractor._windows(extractor.samples)] == [3, 3, 3, 3, 3]
    outcome: list[object] = []
    thread, deadline = _run_until_idle(extractor, store, outcome, 120)
    assert store.writers_idle(), "the blocked extractor never said it is idle"
    assert all(s.sample_id in extractor.cache for s in extractor.samples)  # every answer, not only the 1st window
    assert extractor.ahead_seconds > 0 and store.status()["segments"]["ready"] > 0
    stored: dict[int, object] = {}
    while thread.is_alive() and time.monotonic() < deadline:
        stored.update((s.sample_id, s) for _, s in drain(store))
        time.sleep(0.05)
    thread.join(timeout=1)
    stored.update((s.sample_id, s) for _, s in drain(store))
    assert outcome == [True] and not list((store.path / "writers").glob("*.idle"))  # finished, no longer idle
    assert sorted(stored) == sorted(s.sample_id for s in extractor.samples)
    for prompt in extractor.samples:
        n = prompt.num_tokens
        assert stored[prompt.sample_id].input_ids[n:].tolist() == extractor.cache.get(prompt.sample_id)[
            : len(stored[prompt.sample_id].input_ids) - n]


def test_an_extractor_whose_forward_is_done_is_idle_while_its_last_segments_wait_for_room(tmp_path, tiny_target_dir,
                                                                                         tiny):
    """The forward loop ends long before the sink has written its last batches into a full buffer: the writer says
    it is idle meanwhile (its cores go to the trainers), and no longer once it is done."""
    import time

    tree = make_cfg(tmp_path, tiny_target_dir)
    tree["data"].update(max_length=128)
    for source in tree["data"]["sources"]:
        source["limit"] = 8
    tree["store"].update(budget=700_000, segment_bytes=12_000)
    tree["extract"].update(batch_tokens=128, queue_size=64)  # the whole shard fits the queue: put never waits
    extractor, store = start(tree, tiny)
    store.set_expected_writers(1)
    outcome: list[object] = []
    thread, deadline = _run_until_idle(extractor, store, outcome, 60)
    assert store.writers_idle() and not store.end_of_data, "the draining extractor never said it is idle"
    stored = []
    while thread.is_alive() and time.monotonic() < deadline:
        stored += drain(store)
        time.sleep(0.05)
    thread.join(timeout=1)
    stored += drain(store)
    assert outcome == [True] and not list((store.path / "writers").glob("*.idle"))
    assert sorted(s.sample_id for _, s in stored) == sorted(s.sample_id for s in extractor.samples)


def test_a_cpu_extractor_weighs_the_cores_at_every_decoding_step(tmp_path, tiny_target_dir, tiny, monkeypatch):
    """A generation batch decodes for a while, and the trainers get nothing new until its window is extracted: the
    extractor looks at the store at every decoding step, so the cores a starved trainer leaves idle come to it in
    the middle of the batch, not at the next one."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: there is nothing to lend")
    tree = make_cfg(tmp_path, tiny_target_dir, regenerate=True, generation={"max_new_tokens": 8, "batch_size": 4})
    tree["data"]["sources"] = [{"path": str(DEMO / "prompts_only.jsonl"), "limit": 4}]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a process of `accelerate launch` (OMP_NUM_THREADS=1)
    try:
        extractor, store = start(tree, tiny)
        looks = iter([True, True, True])  # the trainer has data for three looks, then runs dry
        monkeypatch.setattr(store, "work_for_consumers", lambda: next(looks, False))
        asked: list[bool] = []
        use = extractor._cores.use
        monkeypatch.setattr(extractor._cores, "use", lambda all_of_them: (asked.append(all_of_them), use(all_of_them)))
        extractor._generate(extractor.samples)
        assert asked[:3] == [False, False, False] and len(asked) > 4 and all(asked[3:])
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))  # took the idle cores mid-batch
        assert all(s.sample_id in extractor.cache for s in extractor.samples)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_extract_command(tmp_path, tiny_target_dir):
    from dflash_stream.cli import main

    config = tmp_path / "extract.yaml"
    config.write_text(yaml.safe_dump(make_cfg(tmp_path, tiny_target_dir)))
    assert main(["extract", "--config", str(config), "--extract.batch_tokens=512"]) == 0
    out = tmp_path / "out"
    expected = json.loads((out / "data" / "report-0.json").read_text())["sample_ids"]
    cfg = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    assert cfg.extract.batch_tokens == 512
    store = open_store(cfg, LAYERS, 64, create=False)
    assert store.end_of_data
    assert sorted(s.sample_id for _, s in drain(store)) == sorted(expected)
    end = [e for e in read_metrics(out) if e["event"] == "end"]
    assert end and end[0]["summary"]["samples"] == len(expected)


def test_progress_reaches_100_percent_when_regeneration_drops_samples(tmp_path, tiny_target_dir, tiny,
                                                                        monkeypatch):
    """Samples whose regenerated response is too short leave the denominator: a finished shard reads 100 %;
    regeneration has its own bar with the generated tokens/s."""
    from dflash_stream.pipeline import extractor as extractor_module

    real, real_with_states = extractor_module.generate_responses, extractor_module.generate_with_states
    answered = itertools.count()

    def every_third_short(model, tokenizer, prompts, gen, budget, **hooks):
        responses = real(model, tokenizer, prompts, gen, budget, **hooks)
        return [r[:1] if next(answered) % 3 == 0 else r for r in responses]

    def every_third_short_with_states(model, tokenizer, prompts, gen, budget, capture, **hooks):
        answers = real_with_states(model, tokenizer, prompts, gen, budget, capture, **hooks)
        return [(r[:1], states) if next(answered) % 3 == 0 else (r, states) for r, states in answers]

    monkeypatch.setattr(extractor_module, "generate_responses", every_third_short)
    monkeypatch.setattr(extractor_module, "generate_with_states", every_third_short_with_states)
    tree = make_cfg(tmp_path, tiny_target_dir, regenerate=True, min_supervised_tokens=4,
                    generation={"max_new_tokens": 8, "batch_size": 3})
    tree["data"]["sources"] = [{"path": str(DEMO / "prompts_only.jsonl"), "limit": 9}]
    extractor, store = start(tree, tiny)
    assert extractor.run() is True
    extractor.metrics.close()
    last = [e for e in read_metrics(tmp_path / "out") if e["event"] == "extract"][-1]
    assert last["samples"] == last["samples_total"] == 6  # 9 prompts, 3 dropped as short_response
    assert extractor.report.skipped["short_response"] == 3
    assert extractor._regen_bar.n == extractor._regen_bar.total == 9
    assert "tok/s generated" in extractor._regen_bar.postfix
    assert extractor._recorded == {}  # the dropped samples' recorded states went with them
