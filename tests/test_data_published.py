"""The headline config's six sources in their published layouts (tests/published_rows.py), with the demo
tokenizer's template and a Qwen3.5-family one; template switches; text that spells a special token; the
per-source warning; `dflash-stream data`."""

from __future__ import annotations

import json
import logging

import pytest
from published_rows import HERMES, LAYOUTS, QWEN35_TEMPLATE, QWEN_TOKENS, headline_config

from dflash_stream.config import ConfigError, config_from_dict
from dflash_stream.data.formats import to_messages
from dflash_stream.data.prepare import prepare_samples, prepare_shard
from dflash_stream.data.sources import load_source
from dflash_stream.data.template import ChatEncoder
from dflash_stream.pipeline.common import data_spec_digest


@pytest.fixture(scope="module")
def tokenizer(demo_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def qwen_tokenizer(demo_tokenizer_dir, tmp_path_factory):
    """A copy of the demo tokenizer with Qwen's <think>/<tool_call> added tokens and a Qwen3.5-style template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    tok.add_tokens(QWEN_TOKENS)
    tok.chat_template = QWEN35_TEMPLATE
    out = tmp_path_factory.mktemp("qwen-tokenizer")
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def _runs(tok, ids, mask) -> list[str]:
    runs, current = [], []
    for token, keep in zip(ids.tolist(), mask.tolist(), strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def _cfg(tmp_path, **data):
    return config_from_dict(headline_config(tmp_path, **data))


def _expected_runs(messages, qwen: bool) -> list[str]:
    """What the loss mask must cover: each assistant turn's text (and its tool calls), then <|im_end|>."""
    runs = []
    for m in messages:
        if m["role"] != "assistant":
            continue
        text = m["content"]
        for call in m.get("tool_calls", []):
            fn = call["function"]
            if qwen:
                params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                                 for k, v in fn["arguments"].items())
                sep = "\n\n" if text.strip() else ""
                text += f"{sep}<tool_call>\n<function={fn['name']}>\n{params}</function>\n</tool_call>"
            else:
                text += f"\n<tool_call>\n{json.dumps(fn)}\n</tool_call>"
        runs.append(text.strip("\n") + "<|im_end|>")
    return runs


@pytest.mark.parametrize("family", ["demo", "qwen3.5"])
def test_every_published_layout_is_kept_with_its_assistant_mask(tmp_path, tokenizer, qwen_tokenizer, family):
    tok = qwen_tokenizer if family == "qwen3.5" else tokenizer
    cfg = _cfg(tmp_path, regenerate=False)
    samples, report = prepare_samples(cfg, tok, 0, 1)
    total = sum(len(rows) for _, rows, _ in LAYOUTS.values())
    assert (report.rows, report.kept, dict(report.skipped)) == (total, total, {})
    assert [(s.name, s.rows, s.kept) for s in report.sources] == [
        (name, len(rows), len(rows)) for name, (_, rows, _) in LAYOUTS.items()]
    rows = {s.name: load_source(s, i)[0] for i, s in enumerate(cfg.data.sources)}
    by_origin = {s.origin: s for s in samples}
    for index, source in enumerate(cfg.data.sources):
        for row_index in range(len(rows[source.name])):
            sample = by_origin[f"{source.name}#{row_index}"]
            messages = to_messages(rows[source.name][row_index], source.format)
            assert _runs(tok, sample.input_ids, sample.loss_mask) == _expected_runs(messages, family == "qwen3.5"), \
                (index, row_index)


def test_tools_reach_the_template_as_structured_tools(qwen_tokenizer, tokenizer):
    row = HERMES[0]
    messages = to_messages(row, "sharegpt")
    assert messages.tools[0]["function"]["name"] == "get_exchange_rate"
    assert [m["role"] for m in messages] == ["user", "assistant"]  # the <tools> system turn became `tools`
    assert messages[1]["tool_calls"] == [{"type": "function", "function": {
        "name": "get_exchange_rate", "arguments": {"base": "EUR", "target": "JPY"}}}]
    qwen = ChatEncoder(qwen_tokenizer)
    assert qwen.renders_tools and qwen.renders_tool_calls
    text = qwen.render(messages)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           '{"type": "function", "function": {"name": "get_exchange_rate"')
    assert "<function=get_exchange_rate>\n<parameter=base>\nEUR\n</parameter>" in text
    assert text == qwen_tokenizer.apply_chat_template(list(messages), tools=messages.tools, tokenize=False)
    demo = ChatEncoder(tokenizer)  # SmolLM2's template renders neither: both become text in the turns
    assert not demo.renders_tools and not demo.renders_tool_calls
    assert "<tools>\n" in demo.render(messages) and '"name": "get_exchange_rate"' in demo.render(messages)


def test_glaive_and_swe_agent_and_magicoder_read_as_published():
    glaive = to_messages(LAYOUTS["glaiveai/glaive-function-calling-v2"][1][0])  # format auto
    assert [m["role"] for m in glaive] == ["system", "user", "assistant", "tool", "assistant"]
    assert glaive.tools[0]["function"]["name"] == "convert_temperature"
    assert glaive[0]["content"] == "You are a helpful assistant with access to the following functions. Use them if required"
    assert glaive[2]["tool_calls"][0]["function"]["arguments"] == {"value": 30, "unit": "F"}
    assert glaive[3] == {"role": "tool", "content": '{"result": 86}', "name": "convert_temperature"}
    assert not glaive[4]["content"].endswith("<|endoftext|>")
    swe = to_messages(LAYOUTS["nebius/SWE-agent-trajectories"][1][0], "messages")
    assert [m["role"] for m in swe] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert swe[0]["content"].startswith("SETTING:")
    magicoder = to_messages(LAYOUTS["ise-uiuc/Magicoder-OSS-Instruct-75K"][1][0], "prompt_response")
    assert magicoder[0]["content"].startswith("Write `parse_config") and "def parse_config" in magicoder[1]["content"]


def test_regeneration_keeps_every_layout_as_a_prompt(tmp_path, qwen_tokenizer):
    samples, report = prepare_samples(_cfg(tmp_path), qwen_tokenizer, 0, 1)  # headline: regenerate: true
    assert report.kept == report.rows and all(s.needs_response for s in samples)
    # Qwen3.5 thinks by default: the prompt opens <think> and the generated reasoning is the response.
    assert all(qwen_tokenizer.decode(s.input_ids).endswith("<|im_start|>assistant\n<think>\n") for s in samples)
    done = samples[0].with_response([5, 6, 7], 4096)
    assert done.loss_mask.tolist()[-3:] == [True] * 3


def test_a_long_trajectory_regenerates_at_the_latest_answer_that_fits(tmp_path, tokenizer):
    row = LAYOUTS["nebius/SWE-agent-trajectories"][1][0]
    cfg = _cfg(tmp_path, max_length=150, min_supervised_tokens=8)
    encoder = ChatEncoder(tokenizer)
    from dflash_stream.data.prepare import _regeneration_prompt

    messages = to_messages(row, "messages")
    prompt, cut = _regeneration_prompt(encoder, messages, cfg.data.max_length - 8)
    assert cut in (2, 4) and len(prompt) <= 142  # not the last answer (6), whose prompt is too long
    assert cut == 4 or len(encoder.encode_prompt(messages[:4])) > 142


@pytest.mark.parametrize("thinking", [False, True])
def test_template_switches_reach_samples_regeneration_and_eval(tmp_path, tokenizer, thinking):
    from dflash_stream.drafter.evaluate import render_prompt

    template_file = tmp_path / "qwen35.jinja"
    template_file.write_text(QWEN35_TEMPLATE)
    cfg = _cfg(tmp_path, chat_template=str(template_file), chat_template_kwargs={"enable_thinking": thinking})
    samples, _ = prepare_samples(cfg, tokenizer, 0, 1)  # the demo tokenizer, its template replaced
    tail = "<think>\n" if thinking else "<think>\n\n</think>\n\n"
    assert all(tokenizer.decode(s.input_ids).endswith("<|im_start|>assistant\n" + tail) for s in samples)
    prompt = render_prompt(tokenizer, {"prompt": "Hi"}, cfg.data)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n" + tail)
    inline = _cfg(tmp_path, chat_template=QWEN35_TEMPLATE, chat_template_kwargs={"enable_thinking": thinking})
    assert [s.input_ids.tolist() for s in prepare_samples(inline, tokenizer, 0, 1)[0]] == \
        [s.input_ids.tolist() for s in samples]


def test_template_keys_are_in_the_data_fingerprint(tmp_path):
    plain = data_spec_digest(_cfg(tmp_path))
    off = data_spec_digest(_cfg(tmp_path, chat_template_kwargs={"enable_thinking": False}))
    on = data_spec_digest(_cfg(tmp_path, chat_template_kwargs={"enable_thinking": True}))
    other = data_spec_digest(_cfg(tmp_path, chat_template=QWEN35_TEMPLATE))
    assert len({plain, off, on, other}) == 4
    with pytest.raises(ConfigError, match="data.chat_template_kwargs"):
        _cfg(tmp_path, chat_template_kwargs={"tools": []})
    with pytest.raises(ConfigError, match="data.chat_template: 'no/such.jinja' is neither"):
        data_spec_digest(_cfg(tmp_path, chat_template="no/such.jinja"))


@pytest.mark.parametrize("family", ["demo", "qwen3.5"])
def test_text_that_spells_a_special_token_stays_text(tokenizer, qwen_tokenizer, family):
    tok = qwen_tokenizer if family == "qwen3.5" else tokenizer
    encoder = ChatEncoder(tok)
    messages = [{"role": "user", "content": "What do <|im_start|> and <|im_end|> mean?"},
                {"role": "assistant", "content": "<|im_start|> opens a turn; <|im_end|> closes it. <|endoftext|>"}]
    ids, mask = encoder.encode(messages)
    assert encoder.special_text_count == 5
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    plain = [{"role": "user", "content": "What do X and Y mean?"}, {"role": "assistant", "content": "Z"}]
    ref = encoder.encode(plain)[0].tolist()
    # Only the template's own markers are control tokens; the row's are text and decode back to the same string.
    assert ids.tolist().count(im_start) == ref.count(im_start) and ids.tolist().count(im_end) == ref.count(im_end)
    assert tok.decode(ids) == encoder.render(messages)
    assert _runs(tok, ids, mask) == ["<|im_start|> opens a turn; <|im_end|> closes it. <|endoftext|><|im_end|>"]
    assert encoder.special_text_count == 0  # the last encode (`plain`) had none
    prompt = encoder.encode_prompt(messages[:1]).tolist()
    assert prompt.count(im_start) == 2 + (family == "demo")  # (system +) user + assistant header


def test_special_token_text_is_counted_in_the_report(tmp_path, tokenizer):
    _, report = prepare_samples(_cfg(tmp_path, regenerate=False), tokenizer, 0, 1)
    assert report.special_text == 1  # OpenOrca's ChatML question
    assert report.to_dict()["special_token_text"] == 1


def _capture(caplog, fn):
    logger = logging.getLogger("dflash_stream")
    logger.addHandler(caplog.handler)  # setup_logging (run by other tests) stops propagation to the root
    try:
        return fn()
    finally:
        logger.removeHandler(caplog.handler)


def test_a_source_keeping_under_half_its_rows_warns_with_its_main_reason(tmp_path, tokenizer, caplog):
    tree = headline_config(tmp_path, regenerate=False)
    tree["data"]["sources"][3]["format"] = "alpaca"  # SWE-agent read with the wrong format
    tree["data"]["sources"][2]["format"] = "sharegpt"
    _, report = _capture(caplog, lambda: prepare_shard(config_from_dict(tree), tokenizer, 0, 1))
    warnings = list(dict.fromkeys(r.getMessage() for r in caplog.records if r.levelname == "WARNING"))
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("data source ise-uiuc/Magicoder-OSS-Instruct-75K (format sharegpt) keeps 0 of its "
                                  "2 rows in shard 0: mostly missing_column (2), e.g. "
                                  "ise-uiuc/Magicoder-OSS-Instruct-75K#")
    assert ("no `conversations` column; keys are index, lang, openai_fingerprint, problem, raw_index, seed, solution; "
            "check data.sources[2].format") in warnings[0]
    assert "nebius/SWE-agent-trajectories (format alpaca) keeps 0 of its 1 rows" in warnings[1]
    assert "no `instruction` column; keys are eval_logs" in warnings[1]
    written = json.loads((tmp_path / "out" / "data" / "report-0.json").read_text())
    swe = written["sources"][3]
    assert (swe["rows"], swe["kept"], swe["skipped"]) == (1, 0, {"missing_column": 1})


def test_a_shard_that_keeps_all_its_rows_does_not_warn(tmp_path, tokenizer, caplog):
    _capture(caplog, lambda: prepare_shard(_cfg(tmp_path, regenerate=False), tokenizer, 0, 1))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    from dflash_stream.data.report import DataReport

    report = DataReport(0, 1, rows=12, sample_ids=list(range(12)))
    assert report.warn_if_few() is None  # 12 of 12 kept: nothing lost, not tiny
    tiny = DataReport(0, 1, rows=3, sample_ids=[1, 2, 3])
    assert tiny.warn_if_few() == ("data shard 0 has only 3 samples to train on (3 of 3 rows kept, none skipped): "
                                  "the data sources are that small")


def test_data_command_prints_counts_and_marked_samples(tmp_path, demo_tokenizer_dir, capsys):
    import yaml

    from dflash_stream.cli import main

    tree = headline_config(tmp_path, regenerate=False)
    tree["target"] = {"model": str(demo_tokenizer_dir)}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tree))
    assert main(["data", "--config", str(tmp_path / "c.yaml"), "--json", "--show", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["rows"], out["kept"]) == (11, 11)
    assert [{k: s[k] for k in ("name", "rows", "kept", "skipped")} for s in out["sources"]] == [
        {"name": name, "rows": len(rows), "kept": len(rows), "skipped": {}} for name, (_, rows, _) in LAYOUTS.items()]
    assert "⟦" in out["samples"][0]["text"]
    summary = json.loads((tmp_path / "out" / "data" / "summary.json").read_text())
    assert summary["samples"] == 11 and summary["mean_tokens"] == out["tokens"]["mean"]
    assert main(["data", "--config", str(tmp_path / "c.yaml")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("data: 11 rows, 11 kept, 0 skipped") and "nebius/SWE-agent-trajectories" in text
