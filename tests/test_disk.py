"""The whole disk: the footprint `plan` counts (store + checkpoints + export + data + metrics) is what a run
really writes, `run` refuses at start on a real small filesystem, and the checkpoints honour
train.keep_checkpoints and train.optimizer_state_dtype."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_pipeline import write_run_config

from dflash_stream.cli import main
from dflash_stream.config import load_config
from dflash_stream.drafter import DFlashDrafter, DrafterSpec
from dflash_stream.observe.plan import build_plan
from dflash_stream.pipeline import checkpoint as ckpt
from dflash_stream.sizing.memory import DrafterDims
from dflash_stream.store.budget import du

REPO = Path(__file__).parent.parent
MIB = 2**20


@pytest.fixture
def small_fs(tmp_path):
    """A real 8 MiB filesystem (tmpfs): needs root / CAP_SYS_ADMIN, skipped otherwise."""
    path = tmp_path / "small"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    yield path
    subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("heads, kv, head_dim, inter", [(4, 2, 16, 128), (8, 8, 8, 200), (8, 8, 24, 200), (6, 1, 32, 96)])
def test_drafter_params_count_the_real_model(heads, kv, head_dim, inter):
    spec = DrafterSpec(hidden_size=64, intermediate_size=inter, num_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv, head_dim=head_dim, rope_theta=1e4, rms_norm_eps=1e-6,
                       vocab_size=100, block_size=4, mask_token_id=0, target_layer_ids=[1, 3, 5])
    real = sum(p.numel() for p in DFlashDrafter(spec).parameters())
    dims = DrafterDims(hidden_size=64, intermediate_size=inter, num_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv, head_dim=head_dim, context_layers=3, vocab_size=100, block_size=4)
    assert dims.num_parameters == real


def test_the_disk_and_the_memory_model_count_one_drafter(capsys):
    """Checkpoints and the export hold the drafter the memory model trains: one parameter count, also where the
    config leaves the target's head count to be derived (Qwen3-8B's hints give only its KV heads and head_dim)."""
    plan = _plan_json(REPO / "configs" / "qwen3-8b.yaml", capsys)
    params = plan["disk"]["drafter_params"]
    assert 4 * params == plan["memory"]["trainer"]["parts"]["drafter_parameters"]  # float32 weights


def test_optimizer_state_in_bfloat16_is_smaller_and_resumes_close(tmp_path):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        ckpt.save_torch(ckpt.optimizer_state(opt, dtype), tmp_path / f"{dtype}.pt")
        sizes[dtype] = (tmp_path / f"{dtype}.pt").stat().st_size
    assert sizes["bfloat16"] < 0.55 * sizes["float32"]
    exact = {k: v.clone() for k, v in opt.state[model.weight].items()}
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(ckpt.load_torch(tmp_path / "bfloat16.pt"))
    resumed = fresh.state[model.weight]
    for key in ("exp_avg", "exp_avg_sq"):
        assert resumed[key].dtype == torch.float32  # cast back to the parameters' dtype on load
        rel = ((resumed[key] - exact[key]).abs() / exact[key].abs().clamp_min(1e-30)).max()
        assert 0 < rel <= 2**-8  # rounded to bf16's 8-bit mantissa, nothing worse
    assert resumed["step"] == exact["step"]


def test_keep_checkpoints_and_leftovers_of_interrupted_writes(tmp_path):
    for step in (10, 20):
        ckpt.save_torch({"step": step}, ckpt.begin(tmp_path, step) / "trainer_state.pt")
        ckpt.publish(tmp_path, step, keep=1)
        assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == [f"step-{step}"]
    # A crash while writing step 30, and one between its rename and COMPLETE at step 40.
    ckpt.begin(tmp_path, 30)
    (tmp_path / "checkpoints" / "step-40").mkdir()
    ckpt.begin(tmp_path, 50)  # the next checkpoint after the restart clears both: at most keep + 1 on disk
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".step-50.tmp", "step-20"]


def test_an_old_checkpoint_that_cannot_be_deleted_stops_the_next_run_before_any_work(tiny_target_dir, tmp_path,
                                                                                     capsys, monkeypatch):
    """A checkpoint older than train.keep_checkpoints that an earlier launch failed to delete is deleted before
    the disk check counts the run's own files as free; when it still cannot be, the run stops in one line naming
    it and the bytes it keeps, before the store is touched."""
    config = write_run_config(tmp_path, tiny_target_dir, **{"train.keep_checkpoints": 1})
    output = tmp_path / "out"
    for step in (2, 4):
        ckpt.save_torch({"step": step, "x": torch.zeros(2**18)}, ckpt.begin(output, step) / "trainer_state.pt")
        ckpt.publish(output, step, keep=1, prune=False)
    real_rmtree = ckpt.shutil.rmtree

    def refusing_rmtree(path, *args, **kwargs):
        if Path(path).name == "step-2" and not kwargs.get("ignore_errors"):
            raise OSError(39, "Directory not empty", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", refusing_rmtree)
    assert main(["run", "--config", str(config)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "could not delete the old checkpoint" in err[0] and "/out/checkpoints/step-2 (" in err[0]
    assert "bytes still on disk): OSError: [Errno 39] Directory not empty" in err[0]
    assert not (output / "store").exists()


def _plan_json(config: Path, capsys, *args: str) -> dict:
    assert main(["plan", "--config", str(config), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_refuses_when_the_whole_footprint_exceeds_a_small_filesystem(tiny_target_dir, tmp_path, small_fs,
                                                                          capsys):
    """8 MiB of tmpfs: a 4 MB buffer fits alone, not beside 3 checkpoints of a drafter with a wide MLP."""
    config = write_run_config(tmp_path, tiny_target_dir, **{
        "output_dir": str(small_fs / "out"), "store.path": str(small_fs / "out" / "store"), "store.budget": 4_000_000,
    })
    plan = _plan_json(config, capsys, "--drafter.intermediate_size=4096")
    d = plan["disk"]
    assert set(d["parts"]) >= {"store", "checkpoints", "export", "data", "metrics"}
    assert d["total_bytes"] == sum(d["parts"].values())
    assert d["filesystems"] == {str(small_fs): shutil.disk_usage(small_fs).free}
    assert d["parts"]["store"] == 4_000_000 < d["filesystems"][str(small_fs)] < d["total_bytes"]
    assert d["fits"] is False

    assert main(["run", "--config", str(config), "--drafter.intermediate_size=4096"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("dflash-stream: error: not enough disk")  # one line
    for words in (f"on {small_fs}", "store budget 3.8 MiB", "checkpoints 3 x", "export", "free there"):
        assert words in err[0]
    assert not (small_fs / "out" / "store").exists() and not (small_fs / "out" / "metrics").exists()

    # Store elsewhere: each filesystem is checked on its own, and this one still lacks room for checkpoints.
    other = _plan_json(config, capsys, "--drafter.intermediate_size=4096", f"--store.path={tmp_path / 'store'}")
    assert len(other["disk"]["filesystems"]) == 2 and other["disk"]["fits"] is False
    by_fs = other["disk"]["by_filesystem"][str(small_fs)]
    assert "store" not in by_fs["parts"] and not by_fs["fits"]


def test_a_run_that_fits_stays_within_what_plan_counted(tiny_target_dir, tmp_path, small_fs, capsys):
    """The same small filesystem, a run that fits: it finishes, and every part on disk is within its estimate."""
    config = write_run_config(tmp_path, tiny_target_dir, rows=24, **{
        "output_dir": str(small_fs / "out"), "store.path": str(small_fs / "out" / "store"),
        "train.epochs": 1, "train.checkpoint_every": 2, "train.keep_checkpoints": 1,
        "store.keep_free": 0,  # the writers' disk reserve (1 GiB by default) is larger than this whole filesystem
    })
    d = _plan_json(config, capsys)["disk"]
    assert d["fits"]
    assert main(["run", "--config", str(config)]) == 0
    out = small_fs / "out"
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert len(checkpoints) == 1  # train.keep_checkpoints
    one = d["parts"]["checkpoints"] / 2
    assert 0.7 * one <= du(checkpoints[0]) <= one
    assert du(out / "drafter") <= d["parts"]["export"]
    assert du(out / "data") <= d["parts"]["data"]
    assert du(out) <= d["total_bytes"]


def test_headline_config_fits_its_150_gb_with_checkpoints_counted(capsys):
    plan = _plan_json(REPO / "configs" / "qwen3.6-27b-4gpu.yaml", capsys)
    d = plan["disk"]
    assert d["parts"]["checkpoints"] > 2 * 20e9  # a ~2 B-parameter drafter with AdamW, kept + being written
    assert d["parts"]["store"] == 60e9
    assert d["total_bytes"] <= 150e9
    # Even with the wider MLP some 27B-class targets have.
    wide = _plan_json(REPO / "configs" / "qwen3.6-27b-4gpu.yaml", capsys, "--target.intermediate_size=25600")
    assert wide["disk"]["total_bytes"] <= 150e9
    cfg = load_config(REPO / "configs" / "qwen3.6-27b-4gpu.yaml")
    assert cfg.train.keep_checkpoints == 1
    assert build_plan(cfg)["disk"]["total_bytes"] == d["total_bytes"]
