"""`extract.from_store`: a kept store replayed into a run's store gives the very same states, every pass, with the
exactly-once audit intact; a store from another config, or one a trainer already freed, is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from dflash_stream.cli import main
from dflash_stream.config import load_config
from dflash_stream.pipeline.common import open_store, pass_order, store_layout
from dflash_stream.pipeline.replay import StoreReplay
from dflash_stream.pipeline.roles import RoleInfo
from dflash_stream.store import Store
from dflash_stream.store.segment import read_segment
from tests.test_pipeline import assert_exactly_once, write_run_config


def test_pass_order_keeps_the_first_pass_and_reshuffles_the_others():
    items = list(range(50))
    assert pass_order(items, seed=0, pass_index=0) == items
    first, again = pass_order(items, 0, 1), pass_order(items, 0, 1)
    assert first == again and sorted(first) == items and first != items
    assert pass_order(items, 0, 2) != first and pass_order(items, 1, 1) != first


@pytest.fixture
def kept(tiny_target_dir, tmp_path) -> tuple[Path, Path]:
    """(config, kept store): the data extracted once into a store whose budget holds all of it."""
    (tmp_path / "kept").mkdir()
    config = write_run_config(tmp_path / "kept", tiny_target_dir, rows=24, **{"store.budget": 50_000_000, "train.epochs": 1})
    assert main(["extract", "--config", str(config)]) == 0
    return config, tmp_path / "kept" / "out" / "store"


def _stored(store: Path, pass_index: int) -> dict[int, torch.Tensor]:
    st = Store.attach(store)
    infos = sorted((i for i in st.published() if i.pass_index == pass_index), key=lambda i: i.segment_id)
    return {s.sample_id: s.hidden_states.clone() for i in infos
            for s in read_segment(i.segment_id, store / "segments" / i.segment_id)}


def _replay_config(config: Path, tmp: Path, kept_store: Path, **overrides: object) -> Path:
    tree = yaml.safe_load(config.read_text())
    tree["output_dir"] = str(tmp / "replay")
    tree["store"]["path"] = str(tmp / "replay" / "store")
    tree.setdefault("extract", {})["from_store"] = str(kept_store)
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        tree.setdefault(section, {})[key] = value
    path = tmp / "replay.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_replay_writes_the_kept_states_bit_exact_and_reshuffles_later_passes(kept, tmp_path):
    config, kept_store = kept
    path = _replay_config(config, tmp_path, kept_store, **{"train.epoch_source": "reextract", "train.epochs": 2,
                                                            "store.budget": 50_000_000})
    cfg = load_config(path)
    store = open_store(cfg, *store_layout(cfg))
    store.set_expected_writers(1)
    replay = StoreReplay(cfg, RoleInfo("extractor", 0, 1, 0, 1), store, _NoMetrics())
    assert replay.run() is True
    original = _stored(kept_store, 0)
    for pass_index in (0, 1):
        replayed = _stored(store.path, pass_index)
        assert replayed.keys() == original.keys()
        assert all(torch.equal(replayed[i].view(torch.int16), original[i].view(torch.int16)) for i in original)
    order = [[i for info in sorted(Store.attach(store.path).published(), key=lambda x: x.segment_id)
              if info.pass_index == p for i in info.sample_ids] for p in (0, 1)]
    assert order[0] == [i for s in sorted(Store.attach(kept_store).published(), key=lambda x: x.segment_id)
                        for i in s.sample_ids]
    assert sorted(order[1]) == sorted(order[0]) and order[1] != order[0]
    report = json.loads((tmp_path / "replay" / "data" / "report-0.json").read_text())
    assert sorted(report["sample_ids"]) == sorted(original)

    # A use a trainer released and a crash rolled back (train.release on_use) is replayed again, bit-exact, for
    # exactly that use: the replay serves the generic redo path as the target's extractor does.
    consumer = store.consumer("trainer-0")
    claim = consumer.claim(timeout=1)
    consumer.release([claim])
    part = {"segment_id": claim.segment_id, "pass_index": claim.pass_index, "first_use": claim.use_index,
            "last_use": claim.use_index, "sample_ids": list(claim.sample_ids[:2])}
    [tag] = store.request_redo([part], "test")
    assert replay.redo_quarantined() == 1 and not store.redo_pending()
    [again] = [i for i in Store.attach(store.path).published() if i.replaces == tag]
    assert (again.first_use, again.last_use, again.pass_index, again.sample_ids) == (
        claim.use_index, claim.use_index, claim.pass_index, claim.sample_ids[:2])
    redone = {s.sample_id: s.hidden_states for s in read_segment(again.segment_id, store.path / "segments" / again.segment_id)}
    assert all(torch.equal(redone[i].view(torch.int16), original[i].view(torch.int16)) for i in redone)


@pytest.mark.slow
def test_a_replayed_run_in_a_smaller_fp8_store_trains_every_sample_once_per_epoch(kept, tmp_path):
    config, kept_store = kept
    path = _replay_config(config, tmp_path, kept_store, **{"store.codec": "fp8", "train.epochs": 2})
    assert main(["run", "--config", str(path)]) == 0
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert summary["samples_trained"] == 2 * summary["samples_extracted"] == 2 * len(_stored(kept_store, 0))
    assert summary["peak_store_bytes"] <= summary["budget_bytes"]
    assert_exactly_once(tmp_path / "replay", epochs=2)
    assert len(_stored(kept_store, 0)) == summary["samples_extracted"]  # the kept store is only read


def test_a_kept_store_of_another_config_or_partly_freed_is_refused(kept, tmp_path, capsys):
    config, kept_store = kept
    other = _replay_config(config, tmp_path, kept_store, **{"data.max_length": 80})
    assert main(["run", "--config", str(other)]) == 2
    err = capsys.readouterr().err
    assert "extract.from_store" in err and "maximum lengths" in err
    same = _replay_config(config, tmp_path, kept_store, **{"store.path": str(kept_store)})
    assert main(["run", "--config", str(same)]) == 2
    assert "another store than store.path" in capsys.readouterr().err
    # A trainer consumed the kept store: part of it is gone, and a replay would miss samples.
    assert main(["train", "--config", str(config), "--train.max_steps=2", "--wait-timeout=30"]) == 0
    freed = _replay_config(config, tmp_path, kept_store)
    assert main(["run", "--config", str(freed)]) == 2
    assert "no longer holds" in capsys.readouterr().err


class _NoMetrics:
    def log(self, *args: object, **fields: object) -> None:
        pass
