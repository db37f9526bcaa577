"""The trainer on a real store: learning, checkpoints, release-after-durable, stop signals and crash recovery
with the exactly-once ledger. Samples are the tiny target's own hidden states over real text."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from dflash_stream.config import Config, config_from_dict
from dflash_stream.drafter.shapes import default_buckets
from dflash_stream.errors import DFlashError
from dflash_stream.observe.metrics import MetricsWriter, read_metrics
from dflash_stream.pipeline import checkpoint as ckpt
from dflash_stream.pipeline.common import open_store
from dflash_stream.pipeline.roles import RoleInfo
from dflash_stream.pipeline.trainer import Trainer
from dflash_stream.rundir import RunDir

LAYER_IDS = [1, 2, 3]
HIDDEN = 64
ONE_TRAINER = RoleInfo("trainer", 0, 1, 0, 1)


def _texts() -> list[str]:
    import json as json_mod
    import pathlib
    import textwrap

    docs = []
    for module in (json_mod, pathlib, textwrap, inspect):
        for name in sorted(dir(module)):
            doc = inspect.getdoc(getattr(module, name, None)) or ""
            if 200 < len(doc) < 800:
                docs.append(doc)
    return docs


@pytest.fixture(scope="module")
def target_dir(tiny_target_dir, tmp_path_factory) -> Path:
    """The tiny target with its (tied) embedding scaled to unit variance: at the 0.02 init scale its LM head
    can hardly express a confident prediction, so a drafter could not show learning in a few steps."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(50.0)
    out = tmp_path_factory.mktemp("scaled-target")
    model.save_pretrained(out)
    for item in tiny_target_dir.iterdir():
        if item.name.startswith("tokenizer") or item.name.endswith(".jinja"):
            shutil.copy(item, out / item.name)
    return out


@pytest.fixture(scope="module")
def samples(target_dir):
    """40 samples of 24..96 tokens: real token ids and the target's states at LAYER_IDS."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_stream.store import Sample

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, text in enumerate(_texts()[:40]):
        length = int(torch.randint(24, 97, (1,), generator=gen))
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
        with torch.no_grad():
            states = model(ids, output_hidden_states=True).hidden_states
        hidden = torch.cat([states[layer + 1][0] for layer in LAYER_IDS], dim=-1).bfloat16()
        mask = np.ones(ids.shape[1], dtype=bool)
        mask[:4] = False  # a short "prompt" the loss ignores
        out.append(Sample(1000 + i, ids[0].numpy().astype(np.int32), mask, hidden))
    return out


def make_config(tmp: Path, target_dir: Path, **train) -> Config:
    return config_from_dict({
        "output_dir": str(tmp / "out"),
        "target": {"model": str(target_dir), "num_capture_layers": 3},
        "data": {"sources": [{"path": str(tmp / "unused.jsonl")}], "max_length": 128},
        "store": {"path": str(tmp / "store"), "budget": "8MiB", "segment_bytes": 60_000},
        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 0},
        "train": {"batch_tokens": 256, "num_anchors": 16, "checkpoint_every": 3, "log_every": 1, "lr": 3e-3,
                  "warmup_ratio": 0.0, **train},
    })


def fill_store(cfg: Config, samples, per_segment: int = 5):
    store = open_store(cfg, LAYER_IDS, HIDDEN)
    writer = store.writer("test-writer")
    for start in range(0, len(samples), per_segment):
        writer.write(samples[start:start + per_segment])
    writer.finish()
    store.set_expected_writers(1)
    return store


def write_data_report(cfg: Config, samples) -> None:
    """What the extractors' data stage writes: the ids it kept (the schedule estimate reads the count)."""
    report = Path(cfg.output_dir) / "data" / "report-0.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    ids = [s.sample_id for s in samples]
    report.write_text(json.dumps({"kept": len(ids), "sample_ids": ids}))


def trained_ids(output: Path) -> dict[int, Counter]:
    """Ids per epoch from the ledger up to the latest complete checkpoint (what the audit counts)."""
    upto = ckpt.checkpoint_step(ckpt.latest_checkpoint(output))
    per_epoch: dict[int, Counter] = {}
    for part in (output / "ledger").glob("trainer-*/*.jsonl"):
        if int(part.stem) <= upto:
            for line in part.read_text().splitlines():
                entry = json.loads(line)
                per_epoch.setdefault(entry["epoch"], Counter()).update(entry["sample_ids"])
    return per_epoch


def assert_exactly_once(output: Path, samples, epochs: int) -> None:
    per_epoch = trained_ids(output)
    expected = Counter(s.sample_id for s in samples)
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, counts in per_epoch.items():
        assert counts == expected, f"epoch {epoch}: {counts - expected} extra, {expected - counts} missing"


def assert_store_drained(store) -> None:
    """Every segment used `reuse` times and deleted: nothing left ready, claimed or on disk."""
    status = store.status()
    assert status["segments"]["ready"] == status["segments"]["claimed"] == 0
    assert status["samples"] == 0


def new_trainer(cfg: Config) -> Trainer:
    store = open_store(cfg, LAYER_IDS, HIDDEN, create=False)
    return Trainer(cfg, ONE_TRAINER, store, MetricsWriter(cfg.output_dir, "trainer", 0), torch.device("cpu"))


@pytest.mark.parametrize("fixed_shapes", ["auto", "on"])  # on: batches padded to their bucket's shape (as on CUDA)
def test_loss_goes_down_and_every_sample_is_trained_once_per_epoch(tmp_path, target_dir, samples, fixed_shapes):
    cfg = make_config(tmp_path, target_dir, epochs=3, fixed_shapes=fixed_shapes)
    store = fill_store(cfg, samples[:20])
    write_data_report(cfg, samples[:20])
    trainer = new_trainer(cfg)
    assert trainer.run() is True
    trainer.close()
    events = [e for e in read_metrics(cfg.output_dir) if e["event"] == "train"]
    losses = [e["loss"] for e in events]
    assert len(losses) == trainer.steps
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0
    # The schedule length was estimated from the data report: the cosine ends near the last step.
    lrs = [e["lr"] for e in events]
    assert all(lr > 0 for lr in lrs[:-1]) and lrs[-1] < 0.1 * cfg.train.lr
    assert_exactly_once(Path(cfg.output_dir), samples[:20], epochs=3)
    assert_store_drained(store)
    # Nothing is compiled on the CPU (SDPA); the bound is the plan's buckets when shapes are fixed.
    planned = len(default_buckets(cfg.data.max_length)) if fixed_shapes == "on" else 8
    assert all(e["graphs_compiled"] == 0 and e["graphs_planned"] == planned for e in events)
    export = trainer.export(tmp_path / "drafter")
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("moment", ["before_release", "after_release"])
def test_release_happens_only_after_the_checkpoint_is_durable(tmp_path, target_dir, samples, moment, background):
    """A crash right before or right after a checkpoint's release: the resumed trainer neither loses nor
    retrains anything. After the release the reader may already hold the next use of those segments. Written in
    the background, the checkpoint is released at a later step, once durable; the training since is redone."""
    cfg = make_config(tmp_path, target_dir, epochs=2, async_checkpoint=background, release="after_checkpoint")
    fill_store(cfg, samples[:20])
    trainer = new_trainer(cfg)
    real_release = trainer.consumer.release
    seen: list[str] = []

    def crash(claims):
        latest = ckpt.latest_checkpoint(cfg.output_dir)
        assert latest is not None  # durable first
        step = ckpt.checkpoint_step(latest)
        assert step <= trainer.steps if background else step == trainer.steps
        finished = ckpt.load_torch(latest / "trainer-0.pt")["finished"]
        assert {c.segment_id for c in claims} == {r["segment_id"] for r in finished}
        seen.extend(c.segment_id for c in claims)
        if moment == "after_release":
            real_release(claims)
            while trainer.consumer.claim(timeout=0) is not None:
                pass
        raise RuntimeError("simulated crash")

    trainer.consumer.release = crash
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.run()
    trainer.close()
    assert seen

    resumed = new_trainer(cfg)
    assert resumed.steps == ckpt.checkpoint_step(ckpt.latest_checkpoint(cfg.output_dir))
    assert resumed.steps <= trainer.steps if background else resumed.steps == trainer.steps
    assert resumed.run() is True
    resumed.close()
    assert_exactly_once(Path(cfg.output_dir), samples[:20], epochs=2)


@pytest.mark.parametrize("moment, background", [("before_store_release", True), ("after_store_release", False)],
                         ids=["before_store_release-async", "after_store_release-sync"])
def test_a_crash_after_a_release_on_use_extracts_exactly_the_released_samples_again(tmp_path, target_dir, samples,
                                                                                  moment, background):
    """train.release on_use: a crash right after a release that came after the latest durable checkpoint (its
    journal line written; the store's release done or not). The resumed trainer asks for exactly the samples of
    the uses released since that checkpoint, less those it records as trained, to be extracted again, for
    exactly those uses; once a writer has written them (as an extractor does for its redo requests) training
    ends with every sample once per epoch in the final weights, the redone ones marked in the ledger."""
    from dflash_stream.pipeline.audit import audit_run
    from dflash_stream.pipeline.common import save_resolved_config

    cfg = make_config(tmp_path, target_dir, epochs=2, checkpoint_every=2, async_checkpoint=background)
    assert cfg.train.release == "on_use"  # the default
    store = fill_store(cfg, samples[:20])
    write_data_report(cfg, samples[:20])
    save_resolved_config(cfg)  # where the audit finds the store
    output = Path(cfg.output_dir)
    trainer = new_trainer(cfg)
    real_release = trainer.consumer.release
    released: list[tuple[int, object]] = []  # (step of the update holding it, claim)

    def release(claims):
        latest = ckpt.latest_checkpoint(output)
        step = trainer.steps
        # The journal holds the use before the store lets it go.
        journal = [json.loads(line) for line in (output / "ledger" / "released-trainer-0.jsonl").read_text().splitlines()]
        assert [(j["step"], j["claim"]["segment_id"]) for j in journal[-len(claims):]] == [(step, c.segment_id) for c in claims]
        if latest is not None and ckpt.checkpoint_step(latest) < step and len(released) >= 3:
            if moment == "after_store_release":
                real_release(claims)
            released.extend((step, c) for c in claims)
            raise RuntimeError("simulated crash")
        real_release(claims)
        released.extend((step, c) for c in claims)

    trainer.consumer.release = release
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.run()
    trainer.close()

    latest = ckpt.latest_checkpoint(output)
    durable = ckpt.checkpoint_step(latest)
    trained_at = {(r["claim"]["segment_id"], r["claim"]["use_index"]): set(r["trained"])
                  for r in ckpt.load_torch(latest / "trainer-0.pt")["partial"]}
    lost = [c for step, c in released if step > durable]
    assert lost and len(lost) < len(released)  # some released before the checkpoint: those stay trained
    expected = {(c.segment_id, c.use_index, i) for c in lost for i in c.sample_ids
                if i not in trained_at.get((c.segment_id, c.use_index), set())}

    resumed = new_trainer(cfg)
    assert resumed.steps == durable
    asked = {(p["segment_id"], use, i) for p in resumed.position.rolled_back
             for use in range(p["first_use"], p["last_use"] + 1) for i in p["sample_ids"]}
    assert asked == expected
    waiting = store.redo_waiting()
    assert {w["why"] for w in waiting} == {"rolled back"}
    assert {(w["segment_id"], w["first_use"]) for w in waiting} == {(p["segment_id"], p["first_use"])
                                                                     for p in resumed.position.rolled_back}
    # A second crash before the next checkpoint: the next resume, from the same checkpoint, knows the same uses
    # as lost (else it would read their half-trained records from segments already gone, and quarantine them into
    # a second redo of the same samples) and asks nothing new.
    resumed.close()
    resumed = new_trainer(cfg)
    assert resumed.steps == durable
    assert {(p["segment_id"], use, i) for p in resumed.position.rolled_back
            for use in range(p["first_use"], p["last_use"] + 1) for i in p["sample_ids"]} == expected
    assert store.redo_waiting() == waiting and not store.quarantined()

    # What an extractor does with its redo requests: the same samples, as replacement segments.
    writer = store.writer("test-writer")
    by_id = {s.sample_id: s for s in samples}
    for tag, part in store.redo_requests("test-writer"):
        info = writer.write([by_id[i] for i in part["sample_ids"]], pass_index=part["pass_index"],
                            first_use=part["first_use"], replaces=tag)
        assert (info.first_use, info.last_use) == (part["first_use"], part["last_use"])
    assert not store.redo_pending()
    writer.finish()

    assert resumed.run() is True
    resumed.close()
    assert_exactly_once(output, samples[:20], epochs=2)
    assert_store_drained(store)
    redone = [(e["redo"], e["epoch"], i) for _, f in RunDir(output).ledger_files(0) for line in f.read_text().splitlines()
              if "redo" in (e := json.loads(line)) for i in e["sample_ids"]]
    assert len(redone) == len(set(redone)) == len(expected)  # each lost sample use again once, marked as redone
    report = audit_run(output)
    assert report["ok"] and sum(p["redone"] for p in report["passes"]) == len(expected)
    assert [r["samples"] for r in report["rolled_back"]] and all(r["redone"] for r in report["rolled_back"])


def _write_yaml(cfg: Config, tmp: Path) -> Path:
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _launch_train(config: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_stream", "train", "--config", str(config)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _events(output: Path, name: str) -> list[dict]:
    return [e for e in read_metrics(output) if e["event"] == name]


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"trainer exited early (rc {proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, "timed out waiting for the trainer"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_exits(tmp_path, target_dir, samples):
    cfg = make_config(tmp_path, target_dir, epochs=2, checkpoint_every=1000)
    fill_store(cfg, samples)
    output = Path(cfg.output_dir)
    proc = _launch_train(_write_yaml(cfg, tmp_path))
    _wait_for(lambda: len(_events(output, "train")) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    log_text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, log_text[-3000:]
    last_step = _events(output, "train")[-1]["step"]
    latest = ckpt.latest_checkpoint(output)
    assert ckpt.checkpoint_step(latest) == last_step
    assert _events(output, "checkpoint")[-1]["step"] == last_step
    assert "stop requested by SIGTERM" in log_text
    assert sum(sum(c.values()) for c in trained_ids(output).values()) > 0


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_trains_every_sample_exactly_once(tmp_path, target_dir, samples):
    cfg = make_config(tmp_path, target_dir, epochs=2, checkpoint_every=3)
    store = fill_store(cfg, samples[:30])
    output = Path(cfg.output_dir)
    proc = _launch_train(_write_yaml(cfg, tmp_path))

    def trained_past_a_checkpoint() -> bool:
        checkpoints = _events(output, "checkpoint")
        return bool(checkpoints) and _events(output, "train")[-1]["step"] > checkpoints[-1]["step"]

    _wait_for(trained_past_a_checkpoint, proc)
    proc.kill()
    proc.wait()
    durable = ckpt.checkpoint_step(ckpt.latest_checkpoint(output))
    assert _events(output, "train")[-1]["step"] > durable  # some training is lost and must be redone

    resumed = new_trainer(cfg)
    assert resumed.steps == durable
    assert resumed.run() is True
    resumed.close()
    assert_exactly_once(output, samples[:30], epochs=2)
    assert_store_drained(store)


def test_a_run_with_nothing_to_train_stops_before_training_naming_why(tmp_path, target_dir):
    """Every sample dropped before extraction (here: the servers answered none): the trainer reaches the end of
    the data at step 0 and stops with one line naming the skips, instead of exporting an untrained drafter."""
    cfg = make_config(tmp_path, target_dir)
    fill_store(cfg, [])
    report = Path(cfg.output_dir) / "data" / "report-0.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps({"kept": 0, "sample_ids": [], "skipped": {"no_answer": 40, "too_long": 2}}))
    trainer = new_trainer(cfg)
    with pytest.raises(DFlashError) as stopped:
        trainer.run()
    trainer.close()
    line = str(stopped.value)
    assert line.startswith("nothing to train: the extractors stored no sample (skipped: no_answer 40, too_long 2)")
    assert "no drafter is exported" in line and "no_answer: the servers gave none" in line
    assert ckpt.latest_checkpoint(cfg.output_dir) is None


def check_until_idle(tmp_path, target_dir, samples, rule):
    """Single-process mode: extraction and training alternate, so training must stop (not block) when the
    ready segments are used up, with everything trained so far released (after_checkpoint: and checkpointed;
    on_use: no checkpoint is due before checkpoint_every)."""
    cfg = make_config(tmp_path, target_dir, epochs=1, release=rule, checkpoint_every=1000)
    store = open_store(cfg, LAYER_IDS, HIDDEN)
    store.set_expected_writers(1)
    writer = store.writer("test-writer")
    for start in (0, 5):
        writer.write(samples[start:start + 5])
    trainer = new_trainer(cfg)
    assert trainer.run(until_idle=True) is False
    status = store.status()
    assert status["segments"]["released"] == 2 and status["segments"]["claimed"] == 0
    latest = ckpt.latest_checkpoint(cfg.output_dir)
    assert trainer.steps > 0 and (latest is None if rule == "on_use" else ckpt.checkpoint_step(latest) == trainer.steps)
    assert trainer.writer.pending is None
    for start in (10, 15):
        writer.write(samples[start:start + 5])
    writer.finish()
    assert trainer.run() is True
    trainer.close()
    assert_exactly_once(Path(cfg.output_dir), samples[:20], epochs=1)
    assert_store_drained(store)
    # No data report: the length was unknown while the store held a part of the data; it never hit zero.
    assert all(e["lr"] > 0 for e in read_metrics(cfg.output_dir) if e["event"] == "train")


def test_until_idle_trains_what_is_ready_releases_it_and_returns(tmp_path, target_dir, samples):
    check_until_idle(tmp_path, target_dir, samples, rule="after_checkpoint")


def test_until_idle_trains_what_is_ready_releases_it_on_use_and_returns(tmp_path, target_dir, samples):
    check_until_idle(tmp_path, target_dir, samples, rule="on_use")


def test_segments_smaller_than_a_batch_still_make_full_batches(tmp_path, target_dir, samples):
    """One sample per segment: the trainer waits for the segments being decoded instead of cutting a batch of
    whatever happens to be decoded already, so it takes about as many steps as the batcher cuts from all the
    samples at once (not one per segment or two)."""
    from dflash_stream.drafter.batches import TokenBatcher
    from dflash_stream.drafter.shapes import ShapePlan

    cfg = make_config(tmp_path, target_dir, epochs=1, batch_tokens=1024)  # a batch wants many segments
    fill_store(cfg, samples[:24], per_segment=1)
    write_data_report(cfg, samples[:24])
    batcher = TokenBatcher(ShapePlan.from_config(cfg))
    batcher.add("all", samples[:24])
    fewest = 0
    while batcher.next_batch():
        fewest += 1
    trainer = new_trainer(cfg)
    assert trainer.run() is True
    trainer.close()
    assert trainer.samples_trained == 24
    assert trainer.steps <= fewest + 2 < 8


def test_training_goes_on_while_a_checkpoint_is_written_and_its_release_waits_until_it_is_durable(
        tmp_path, target_dir, samples, monkeypatch):
    """train.async_checkpoint: each rank's part is written by a thread that here holds the first checkpoint's
    write back until training took two more steps (a slow disk; 60 s at most); every release comes after the
    checkpoint recording it is COMPLETE, and only the uses that checkpoint records as finished are released.
    Written synchronously, no step could be taken while a write is pending."""
    cfg = make_config(tmp_path, target_dir, epochs=2, checkpoint_every=3, release="after_checkpoint")
    store = fill_store(cfg, samples[:30])
    trainer = new_trainer(cfg)
    real_write_part, real_release = ckpt.write_part, trainer.consumer.release
    writes: list[tuple[int, int]] = []  # (checkpoint step, trainer step when its write went ahead)
    releases: list[tuple[int, int]] = []  # (latest complete checkpoint, trainer step) at each release

    def slow_write_part(output_dir, step, rank, **parts):
        deadline = time.monotonic() + 60
        while not writes and trainer.steps < step + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        writes.append((step, trainer.steps))
        return real_write_part(output_dir, step, rank, **parts)

    def release(claims):
        latest = ckpt.latest_checkpoint(cfg.output_dir)
        assert latest is not None and (latest / ckpt.COMPLETE).is_file()
        finished = {r["segment_id"] for r in ckpt.load_torch(latest / "trainer-0.pt")["finished"]}
        assert {c.segment_id for c in claims} == finished
        releases.append((ckpt.checkpoint_step(latest), trainer.steps))
        real_release(claims)

    monkeypatch.setattr(ckpt, "write_part", slow_write_part)
    trainer.consumer.release = release
    assert trainer.run() is True
    trainer.close()
    assert any(went_ahead >= step + 2 for step, went_ahead in writes), writes  # training went on meanwhile
    assert releases and any(at > step for step, at in releases), releases  # released at a later step
    assert trainer.checkpoints == len(writes)
    assert_exactly_once(Path(cfg.output_dir), samples[:30], epochs=2)
    assert_store_drained(store)


def check_blocked_extractor(tmp_path, target_dir, samples, rule):
    """A buffer too small for the data: the writer blocks on the budget, and the trainer, which still has
    segments to train, must release the finished ones rather than wait for its next scheduled checkpoint (which
    never comes here): otherwise both sides wait forever. after_checkpoint: it checkpoints to release them;
    on_use: they leave as they finish, with no checkpoint before the end."""
    import threading

    cfg = make_config(tmp_path, target_dir, epochs=1, checkpoint_every=1000, grad_accum=2, release=rule)
    cfg.store.budget = 600_000
    store = open_store(cfg, LAYER_IDS, HIDDEN)
    store.set_expected_writers(1)
    writer = store.writer("test-writer")

    failed: list[BaseException] = []

    def extract() -> None:
        try:
            for start in range(0, 40, 4):
                writer.write(samples[start:start + 4])
            writer.finish()
        except BaseException as err:  # the trainer would wait for this writer forever: stop it, and say why
            failed.append(err)
            os.kill(os.getpid(), signal.SIGTERM)

    extractor = threading.Thread(target=extract)
    extractor.start()
    trainer = new_trainer(cfg)
    finished = trainer.run()
    trainer.close()
    extractor.join(timeout=60)
    assert not failed, failed
    assert finished is True
    assert writer.waited_seconds > 0
    reasons = [e["reason"] for e in read_metrics(cfg.output_dir) if e["event"] == "checkpoint"]
    if rule == "after_checkpoint":
        assert "extractors are blocked on the full buffer" in reasons
    else:
        assert reasons == ["end of data"]
    assert_exactly_once(Path(cfg.output_dir), samples, epochs=1)


def test_a_blocked_extractor_makes_the_trainer_checkpoint_and_release(tmp_path, target_dir, samples):
    check_blocked_extractor(tmp_path, target_dir, samples, rule="after_checkpoint")


def test_a_blocked_extractor_makes_the_trainer_release_on_use(tmp_path, target_dir, samples):
    check_blocked_extractor(tmp_path, target_dir, samples, rule="on_use")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_trainers_stay_in_lockstep_and_share_the_data_exactly_once(tmp_path, target_dir, samples):
    """Two data-parallel trainers claim different segments and run out at different times; every step they
    agree on the loss (one all-reduce), and together they train every sample once per epoch."""
    cfg = make_config(tmp_path, target_dir, epochs=2, checkpoint_every=2)
    store = fill_store(cfg, samples[:24], per_segment=3)
    config = _write_yaml(cfg, tmp_path)
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "dflash_stream", "train", "--config", str(config)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    output = Path(cfg.output_dir)
    assert_exactly_once(output, samples[:24], epochs=2)
    assert_store_drained(store)
    assert sorted(p.name for p in ckpt.latest_checkpoint(output).glob("trainer-*.pt")) == ["trainer-0.pt", "trainer-1.pt"]
    per_rank = [[(e["step"], round(e["loss"], 6)) for e in read_metrics(output) if e["event"] == "train" and e["rank"] == r]
                for r in (0, 1)]
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) > 4
    ledgers = [sum(len(json.loads(line)["sample_ids"]) for f in ckpt.ledger_dir(output, r).glob("*.jsonl")
                   for line in f.read_text().splitlines()) for r in (0, 1)]
    assert min(ledgers) > 0  # both ranks trained
    assert (output / "drafter" / "config.json").is_file()


FAIL_RANK_1_WRITE = """
import errno, sys
from dflash_stream.pipeline import checkpoint as ckpt
real, parts = ckpt.save_torch, []
def save_torch(obj, path):
    if path.name == "trainer-1.pt":
        parts.append(path)
        if len(parts) == 2:  # rank 1's part of the second checkpoint: the disk answers EIO
            raise OSError(errno.EIO, "Input/output error")
    return real(obj, path)
ckpt.save_torch = save_torch
from dflash_stream.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _launch_two_trainers(config: Path, rank_1_code: str | None = None) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        start = ["-c", rank_1_code] if rank == 1 and rank_1_code else ["-m", "dflash_stream"]
        procs.append(subprocess.Popen([sys.executable, *start, "train", "--config", str(config)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.slow
def test_a_background_write_that_fails_on_one_rank_is_never_published(tmp_path, target_dir, samples):
    """Two trainers, background checkpoints; rank 1's part of the second checkpoint fails with EIO. No rank
    publishes it: both stop with the same one line naming rank 1, its file and the error; every complete
    checkpoint holds both parts; the next launch resumes from the first one and trains every sample once.
    after_checkpoint: trainers launched without an extractor, whose resume has no uses to extract again."""
    cfg = make_config(tmp_path, target_dir, epochs=2, checkpoint_every=2, async_checkpoint=True,
                      release="after_checkpoint")
    store = fill_store(cfg, samples[:24], per_segment=3)
    config = _write_yaml(cfg, tmp_path)
    output = Path(cfg.output_dir)
    procs = _launch_two_trainers(config, FAIL_RANK_1_WRITE)
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], logs[0][-2000:] + logs[1][-2000:]
    lines = [[line for line in log.splitlines() if line.startswith("dflash-stream: error:")] for log in logs]
    assert len(lines[0]) == len(lines[1]) == 1 and lines[0] == lines[1], lines
    line = lines[0][0]
    assert "was not published: trainer rank 1: could not write" in line and "trainer-1.pt" in line, line
    assert "OSError: [Errno 5] Input/output error" in line and "resumes from step-2" in line, line
    assert "Traceback" not in logs[0] + logs[1]
    for checkpoint in ckpt.complete_checkpoints(output):
        assert sorted(p.name for p in checkpoint.glob("trainer-*.pt")) == ["trainer-0.pt", "trainer-1.pt"]
    assert ckpt.checkpoint_step(ckpt.latest_checkpoint(output)) == 2

    procs = _launch_two_trainers(config)
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "resumed from" in logs[0] and "step-2" in logs[0]
    assert_exactly_once(output, samples[:24], epochs=2)
    assert_store_drained(store)


def test_an_old_checkpoint_that_cannot_be_deleted_stops_training_in_one_line(tmp_path, target_dir, samples,
                                                                             monkeypatch):
    """The deletion of older checkpoints after a background publish fails (an NFS server refusing an rmtree):
    training stops at the next checkpoint with one line naming the folder, the bytes it keeps and the error,
    instead of a thread's traceback that leaves the folder filling the disk. after_checkpoint: a trainer resumed
    without an extractor, with no uses to extract again."""
    cfg = make_config(tmp_path, target_dir, epochs=2, checkpoint_every=2, keep_checkpoints=1, async_checkpoint=True,
                      release="after_checkpoint")
    fill_store(cfg, samples[:12], per_segment=3)
    real_rmtree = ckpt.shutil.rmtree

    def refusing_rmtree(path, *args, **kwargs):
        if Path(path).name == "step-2" and Path(path).is_dir() and not kwargs.get("ignore_errors"):
            raise OSError(16, "Device or resource busy", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", refusing_rmtree)
    trainer = new_trainer(cfg)
    with pytest.raises(DFlashError) as failed:
        trainer.run()
    trainer.close()
    line = str(failed.value)
    assert "\n" not in line and "trainer rank 0: could not delete the old checkpoint" in line, line
    assert "/checkpoints/step-2 (" in line and "bytes still on disk): OSError: [Errno 16] Device or resource busy" in line
    assert (Path(cfg.output_dir) / "checkpoints" / "step-2").is_dir()
    # The next launch deletes it first, or stops before any work naming it.
    monkeypatch.undo()
    resumed = new_trainer(cfg)
    assert resumed.run() is True
    resumed.close()
    assert [p.name for p in ckpt.complete_checkpoints(cfg.output_dir)] == [f"step-{resumed.steps}"]


@pytest.mark.slow
def test_train_refuses_a_store_made_by_another_config_in_one_line(tmp_path, target_dir, samples):
    cfg = make_config(tmp_path, target_dir)
    fill_store(cfg, samples[:5])
    cfg.data.max_length = 64  # part of the store's fingerprint
    proc = _launch_train(_write_yaml(cfg, tmp_path))
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2, out[-2000:]
    errors = [line for line in out.splitlines() if line.startswith("dflash-stream: error:")]
    assert len(errors) == 1 and "max_length" in errors[0] and "Traceback" not in out


def test_no_waiting_for_data_line_while_a_segment_is_ready_or_decoding(tmp_path, target_dir, samples, caplog):
    import logging

    cfg = make_config(tmp_path, target_dir, epochs=1)
    store = open_store(cfg, LAYER_IDS, HIDDEN)
    store.set_expected_writers(1)
    store.writer("test-writer").write(samples[:5])
    trainer = new_trainer(cfg)
    logger = logging.getLogger("dflash_stream")
    logger.addHandler(caplog.handler)  # setup_logging (run by other tests) stops propagation to the root
    caplog.set_level(logging.INFO, logger="dflash_stream")
    try:
        trainer._wait_for_data()  # the segment is READY, or claimed by the reader and decoding: data on its way
        assert not [r for r in caplog.records if "waiting for data" in r.getMessage()]
        assert len(trainer.position) == 1
        trainer._wait_for_data()  # now the store has nothing for us: that is a wait, said once
        trainer._wait_for_data()
    finally:
        logger.removeHandler(caplog.handler)
        trainer.close()
    waits = {r.getMessage() for r in caplog.records if "waiting for data" in r.getMessage()}
    assert len(waits) == 1 and "no segment ready in the store" in waits.pop()
