"""Paths a user gets wrong, each answered in one line and never a traceback; `--version`; `report --out`;
`plan` for every shipped config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_stream.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def read_only(tmp_path):
    """A folder nobody may write to: a read-only tmpfs when running as root (root ignores file modes), else a
    folder without write permission."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                              capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs: {done.stderr.decode().strip()}")
        yield folder
        subprocess.run(["umount", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == "dflash-stream 0.1.0"


def test_read_only_output_dir_is_one_line_before_anything_is_written(read_only, tmp_path, capsys):
    store = tmp_path / "store"
    for command in ("run", "extract", "train"):
        code = main([command, "--config", str(ROOT / "configs/demo.yaml"), f"--output_dir={read_only / 'run'}",
                     f"--store.path={store}", "--data.sources.0.path=" + str(ROOT / "dflash_stream/demo_data/"
                                                                            "sharegpt_chats.jsonl")])
        assert code == 2
        line = one_error_line(capsys)
        assert "output_dir" in line and "not writable" in line
        assert "Read-only file system" in line or "Permission denied" in line
    assert not store.exists()


def test_missing_data_and_model_paths_are_named_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["run", "--config", str(ROOT / "configs/demo.yaml"), f"--output_dir={out}", f"--store.path={out}/store"]
    assert main([*base, "--data.sources.1.path=missing/chats.jsonl"]) == 2
    assert one_error_line(capsys).endswith("data.sources[1].path: 'missing/chats.jsonl' not found (no such file "
                                           "or folder)")
    assert main([*base, f"--target.model={tmp_path}/no-such-model", "--target.gguf_file=null"]) == 2
    assert f"target.model: local folder '{tmp_path}/no-such-model' does not exist" in one_error_line(capsys)
    assert not out.exists()


def test_export_to_unwritable_out(read_only, tmp_path, capsys):
    from dflash_stream.drafter import DFlashDrafter, DrafterSpec, save_checkpoint_drafter

    spec = DrafterSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6, vocab_size=50,
                       block_size=4, mask_token_id=0, target_layer_ids=[0], num_target_layers=2)
    ckpt = tmp_path / "step-1"
    ckpt.mkdir()
    save_checkpoint_drafter(DFlashDrafter(spec), spec, ckpt)
    assert main(["export", str(ckpt), "--out", str(read_only / "drafter")]) == 2
    assert "export --out" in one_error_line(capsys)


def test_store_dump_to_unwritable_out(read_only, tmp_path, capsys):
    from dflash_stream.store import Sample, Store

    fp = {"target": "t", "layer_ids": [0], "hidden_size": 8}
    store = Store.open(tmp_path / "store", budget=10**8, codec="lossless", reuse=1, fingerprint=fp,
                       max_segment_raw_bytes=2**16)
    store.writer("w").write([Sample(7, np.arange(5, dtype=np.int32), np.ones(5, dtype=bool),
                                    torch.randn(5, 8).to(torch.bfloat16))])
    dump = ["store", "dump", str(tmp_path / "store"), "--sample-id", "7", "--out"]
    assert main([*dump, str(read_only / "s.safetensors")]) == 2
    assert "store dump --out" in one_error_line(capsys)
    assert main([*dump, str(tmp_path)]) == 2  # a folder, not a file
    assert "is a folder" in one_error_line(capsys)
    assert main([*dump, str(tmp_path / "s.safetensors")]) == 0


def write_metrics(out: Path) -> None:
    from dflash_stream.observe.metrics import MetricsWriter

    metrics = MetricsWriter(out, "trainer", 0)
    metrics.log("start", config={"note": "x" * 200_000})  # more than a pipe holds
    for step in range(1, 4):
        metrics.log("train", step=step, loss=3.0 / step, acc=[0.5, 0.25], tau=1.5, lr=1e-3, tokens=step * 100,
                    tok_s=100.0, data_wait_s=0.0, epoch=0)
    metrics.log("end", summary={})
    metrics.close()


def test_status_json_into_a_closed_pipe_is_quiet(tmp_path):
    """`status --json | head`: the reader leaves early; no traceback, no 'Exception ignored' at exit."""
    write_metrics(tmp_path / "run")
    with open(tmp_path / "big.json", "w") as f:  # a summary larger than any pipe buffer
        json.dump({"padding": "y" * 300_000}, f)
    os.replace(tmp_path / "big.json", tmp_path / "run" / "summary.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_stream", "status", str(tmp_path / "run"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(10)  # like `head -c 10`
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert proc.returncode in (0, 141)


def test_report_out_folder(tmp_path, read_only, capsys):
    write_metrics(tmp_path / "run")
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "plots")]) == 0
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"loss.png", "accuracy.png"}
    assert not (tmp_path / "run" / "report").exists()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run"), "--out", str(read_only / "plots")]) == 2
    assert "report --out" in one_error_line(capsys)


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_plan_works_offline_for_every_shipped_config(config, monkeypatch, capsys):
    """From config values alone: no model download, no dataset download."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--config", str(config), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target"]["num_layers"] and plan["data"]["samples"] and plan["time"]["total_seconds"]
