"""`bench quality`'s plan of runs and its report: the contract's keys, the budgets, and the parity bar."""

from __future__ import annotations

from dflash_stream.bench.quality import STREAMED_FRACTION, _report, _table, plan_runs


def test_every_variant_and_sweep_point_is_planned_per_seed():
    runs = plan_runs(["offline", "streamed", "reextract", "fp8"], seeds=2, sweep=[0.1, 0.02])
    names = [(r.folder, r.train["epoch_source"], r.store["codec"], r.evaluate) for r in runs]
    assert ("offline", "reextract", "lossless", True) in names and ("fp8-seed1", "reuse", "fp8", True) in names
    assert ("window-0.02-seed1", "reuse", "lossless", False) in names
    assert not any(r.name == "window-0.1" for r in runs)  # the 10 % point is the streamed variant itself
    assert all(r.fraction == STREAMED_FRACTION for r in runs if r.name in ("streamed", "reextract", "fp8"))


def _result(loss: float, tau: float | None, budget: int, dump: int, tau_stderr: float | None = None) -> dict:
    return {"loss": loss, "acc": [0.1, 0.05], "tau": tau, "tau_stderr": tau_stderr, "budget_bytes": budget,
            "dump_bytes": dump,
            "seconds": 1.0, "summary": {"steps": 10, "samples_trained": 30, "samples_extracted": 10}}


def test_report_keeps_the_contract_keys_and_judges_parity():
    results = {
        "offline": [_result(6.0, 1.10, 125, 100), _result(6.1, 1.12, 125, 100)],
        "streamed": [_result(6.05, 1.11, 10, 100), _result(6.08, 1.11, 10, 100)],
        "window-0.02": [_result(7.0, None, 2, 100), _result(7.1, None, 2, 100)],
    }
    report = _report(results, ["offline", "streamed"], [0.1, 0.02], 10, 7.5, {"loss": 30.0}, 2, 10, 4, 0.0, 2.0)
    streamed = report["variants"]["streamed"]
    for key in ("heldout_loss", "heldout_loss_spread", "acc", "tau", "tau_spread", "steps", "budget_bytes",
                "dump_bytes"):
        assert key in streamed
    assert streamed["budget_bytes"] <= 0.1 * streamed["dump_bytes"]
    assert abs(streamed["heldout_loss"] - 6.065) < 1e-9 and abs(streamed["heldout_loss_spread"] - 0.03) < 1e-9
    assert report["parity"]["streamed"]["loss_within"] and report["parity"]["streamed"]["tau_within"]
    sweep = {round(w["budget_fraction"], 2): w for w in report["window_sweep"]}
    assert sweep[0.02]["within_offline"] is False and sweep[0.1]["within_offline"] is True
    # 10 samples, 2 per step: a 2 % window holds 0.2 samples, a tenth of a step
    assert abs(sweep[0.02]["window_samples"] - 0.2) < 1e-9 and abs(sweep[0.02]["window_steps"] - 0.1) < 1e-9
    assert set(report) >= {"variants", "seeds", "minutes", "window_sweep"} and report["seeds"] == [0, 1]


def test_tau_gap_is_also_judged_against_the_eval_noise():
    results = {
        "offline": [_result(6.0, 1.10, 125, 100, 0.01), _result(6.0, 1.10, 125, 100, 0.01)],
        "fp8": [_result(6.0, 1.115, 10, 100, 0.01), _result(6.0, 1.115, 10, 100, 0.01)],
        "window-0.1": [_result(6.0, None, 10, 100), _result(6.0, None, 10, 100)],
    }
    report = _report(results, ["offline", "fp8"], [0.1], 10, 7.5, {"loss": 30.0}, 2, 10, 4, 0.0, 2.0)
    assert report["variants"]["fp8"]["tau_stderr"] == 0.01  # the seeds share the prompts: no averaging down
    verdict = report["parity"]["fp8"]
    assert not verdict["tau_within"]  # the seeds agree exactly, so the spread allows no gap
    assert abs(verdict["tau_noise"] - 2 * 0.01 * 2 ** 0.5) < 1e-12 and verdict["tau_within_noise"] is True


def test_kl_and_dflash2_variants_change_one_thing_of_streamed():
    runs = {r.folder: r for r in plan_runs(["streamed", "streamed+kl", "dflash2"], seeds=2, sweep=[0.1])}
    streamed, kl, dflash2 = runs["streamed-seed1"], runs["streamed+kl-seed1"], runs["dflash2-seed1"]
    assert kl.train == {**streamed.train, "loss": "kl"} and kl.drafter == {} and kl.store == streamed.store
    assert dflash2.drafter == {"kind": "dflash2"} and dflash2.train == streamed.train
    assert kl.fraction == dflash2.fraction == streamed.fraction and kl.evaluate and dflash2.evaluate
    assert "window-0.1" not in {r.name for r in runs.values()}


def test_kl_and_dflash2_are_judged_against_streamed():
    results = {
        "streamed": [_result(6.0, 1.10, 10, 100, 0.01), _result(6.02, 1.12, 10, 100, 0.01)],
        "streamed+kl": [_result(6.5, 1.11, 10, 100, 0.01), _result(6.5, 1.11, 10, 100, 0.01)],
        "dflash2": [_result(6.03, 1.2, 10, 100, 0.01), _result(6.01, 1.2, 10, 100, 0.01)],
    }
    report = _report(results, list(results), [0.1], 10, 7.5, {"loss": 30.0}, 2, 10, 4, 0.0, 2.0)
    assert "parity" not in report  # no offline run: nothing to judge parity with
    kl, dflash2 = report["versus_streamed"]["streamed+kl"], report["versus_streamed"]["dflash2"]
    assert abs(kl["loss_gap"] - 0.49) < 1e-9 and not kl["loss_within"]
    assert dflash2["loss_within"] and abs(dflash2["tau_gap"] - 0.09) < 1e-9 and not dflash2["tau_within_noise"]
    table = "\n".join(_table(report))
    assert "streamed+kl vs streamed: loss gap +0.4900" in table and "0.100/0.050" in table
