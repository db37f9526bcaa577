"""The memory model's parts, the launch and its split into roles, and plan's memory/roles/regeneration output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from dflash_stream.cli import main
from dflash_stream.config import ConfigError, load_config
from dflash_stream.errors import DFlashError
from dflash_stream.observe.plan import TargetShape, build_plan, read_launch, render_plan
from dflash_stream.sizing.memory import (
    DrafterDims,
    startup_check,
    target_dims,
    train_batch,
    trainer_memory,
    worst_train_batch,
)
from dflash_stream.sizing.work import best_split, split_alternatives

ROOT = Path(__file__).parent.parent
HEADLINE = ROOT / "configs" / "qwen3.6-27b-4gpu.yaml"
GB = 10**9


def _config(tmp_path: Path, **sections) -> Path:
    tree = {
        "output_dir": str(tmp_path / "out"),
        "target": {"model": "org/m", "num_layers": 36, "hidden_size": 4096, "vocab_size": 151936,
                   "intermediate_size": 12288, "num_key_value_heads": 8, "head_dim": 128},
        "data": {"sources": [{"path": "org/data", "limit": 100_000}], "max_length": 2048},
        "store": {"path": str(tmp_path / "store"), "budget": "10GiB"},
        "train": {"epochs": 3, "batch_tokens": 2048},
    }
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


# ------------------------------------------------------------------------------------------- model parts


def test_drafter_and_target_parameter_counts_match_the_real_modules():
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_stream.drafter import DFlashDrafter, DrafterSpec

    dims = DrafterDims(hidden_size=64, intermediate_size=96, num_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, context_layers=5, vocab_size=300, block_size=8)
    spec = DrafterSpec(hidden_size=64, intermediate_size=96, num_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, rope_theta=1e4, rms_norm_eps=1e-6, vocab_size=300,
                       block_size=8, mask_token_id=299, target_layer_ids=[0, 1, 2, 3, 4], num_target_layers=6)
    drafter = DFlashDrafter(spec)
    assert dims.num_parameters == sum(p.numel() for p in drafter.parameters())
    linear = sum(m.weight.numel() for m in drafter.modules() if isinstance(m, torch.nn.Linear))
    assert dims.linear_parameters == linear

    for tied in (True, False):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=tied))
        shape = TargetShape("llama", 2, 64, 300, 96, "test", 4, 2, 16, tie_word_embeddings=tied)
        assert target_dims(shape).num_parameters == sum(p.numel() for p in model.parameters())
        assert not target_dims(shape).assumed


def test_dflash2_parameter_count_matches_the_real_module():
    from dflash_stream.drafter import DFlash2Drafter, DrafterSpec

    shape = dict(hidden_size=64, intermediate_size=96, num_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=24, vocab_size=300, block_size=8)
    kw = dict(kind="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=12, selector_top_k=5)
    dims = DrafterDims(**shape, context_layers=5, **kw)
    drafter = DFlash2Drafter(DrafterSpec(**shape, **kw, rope_theta=1e4, rms_norm_eps=1e-6, mask_token_id=299,
                                         target_layer_ids=[0, 1, 2, 3, 4], num_target_layers=6))
    assert dims.num_parameters == sum(p.numel() for p in drafter.parameters())
    assert dims.linear_parameters == sum(m.weight.numel() for m in drafter.modules() if isinstance(m, torch.nn.Linear))


def test_unknown_target_widths_are_assumed_and_named():
    dims = target_dims(TargetShape("llama", 64, 5120, None, None, "hints"))
    assert dims.vocab_size == 151_936 and dims.intermediate_size == 8 * 5120 // 3
    assert any("target.vocab_size" in a for a in dims.assumed)
    assert any("target.intermediate_size" in a for a in dims.assumed)
    assert any("target.num_key_value_heads" in a for a in dims.assumed)
    assert target_dims(TargetShape("llama", 64, 5120, None, None, "hints", num_parameters=27e9)).num_parameters == 27e9


def test_worst_train_batch_is_the_batchers_largest():
    """Brute force over every row length the token batcher could cut: the most block tokens."""
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    worst = worst_train_batch(cfg)
    t, b = cfg.train, cfg.drafter.block_size
    best = max(max(1, t.batch_tokens // n) * max(1, min(t.num_anchors, n - 1)) * b
               for n in range(cfg.min_supervised_tokens, cfg.data.max_length + 1))
    assert worst.block_tokens == best
    assert worst.rows == worst.sequences * worst.anchors * (b - 1)


def _trainer(batch, kind="dflash", **kw):
    dims = DrafterDims(hidden_size=256, intermediate_size=768, num_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, context_layers=3, vocab_size=16384, block_size=16,
                       kind=kind)
    args = {"bf16": False, "flex": False, "chunk_rows": 1024, "tied_head": False, "foreach": False, **kw}
    return dims, trainer_memory(dims, batch, **args)


def test_trainer_parts():
    batch = train_batch(2, 256, 64, 16)
    dims, est = _trainer(batch)
    p = dims.num_parameters
    parts = est.parts
    assert (parts["drafter_parameters"], parts["gradients"], parts["optimizer_states"]) == (4 * p, 4 * p, 8 * p)
    assert parts["target_embedding_lm_head"] == 2 * 16384 * 256 * 4 and parts["autocast_weight_copies"] == 0
    assert parts["loss_working_set"] == 1024 * 16384 * 4 + 4 * batch.rows * 256
    assert est.total == max(est.phases.values()) == est.phases["backward"]
    # bf16 autocast: bf16 head, bf16 copies of the linear weights; flex drops the dense mask from the batch.
    _, bf16 = _trainer(batch, bf16=True, flex=True, tied_head=True, foreach=True)
    assert bf16.parts["target_embedding_lm_head"] == 16384 * 256 * 2
    assert bf16.parts["autocast_weight_copies"] == 2 * dims.linear_parameters
    assert bf16.parts["loss_working_set"] == 1024 * 16384 * 6 + 4 * batch.rows * 256
    assert bf16.parts["batch"] < parts["batch"] and bf16.parts["optimizer_step_buffers"] == 12 * p
    # The chunked loss's working set does not grow with rows; the unchunked one does, per row and vocab entry.
    big = train_batch(8, 512, 128, 16)
    assert _trainer(big)[1].parts["loss_working_set"] - parts["loss_working_set"] == 4 * (big.rows - batch.rows) * 256
    unchunked = _trainer(big, chunk_rows=None)[1].parts["loss_working_set"]
    assert unchunked >= big.rows * 16384 * 8


def check_saved_activations(kind):
    """The per-layer byte counts are what the real drafter saves for backward (float32, SDPA), counted with
    saved-tensor hooks, within 5 %; a DFlash2 drafter's convolutions included."""
    from dflash_stream.bench.memory import DRAFTER, _drafter_parts
    from dflash_stream.drafter import DFlash2Drafter, DrafterSpec

    batch = train_batch(2, 128, 32, DRAFTER["block_size"])
    dims, est = _trainer(batch, chunk_rows=256, kind=kind)
    drafter, head, _, _ = _drafter_parts(DRAFTER, torch.device("cpu"))
    if kind == "dflash2":
        torch.manual_seed(0)
        drafter = DFlash2Drafter(DrafterSpec(**{**vars(drafter.spec), "kind": kind}), attention="sdpa")
    params = {p.untyped_storage().data_ptr() for p in [*drafter.parameters(), *head.parameters()]}
    from dflash_stream.drafter import dflash_loss

    g = torch.Generator().manual_seed(0)
    data = {"hidden_states": torch.randn(2, 128, 3 * 256, generator=g).to(torch.bfloat16),
            "input_ids": torch.randint(0, 16384, (2, 128), generator=g),
            "loss_mask": torch.ones(2, 128, dtype=torch.bool), "lengths": torch.full((2,), 128)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dflash_loss(drafter, head, data, num_anchors=32, gamma=7.0, chunk_rows=256)
    assert est.parts["activations"] == pytest.approx(sum(saved.values()), rel=0.05)


def test_saved_activations_match_what_autograd_keeps():
    check_saved_activations(kind="dflash")


def test_saved_activations_match_what_autograd_keeps_in_dflash2():
    check_saved_activations(kind="dflash2")


# ------------------------------------------------------------------------------------------- launch, split


def test_launch_files_are_read():
    assert read_launch(str(ROOT / "launch" / "4gpu.yaml"), None)["num_processes"] == 4
    two_nodes = read_launch(str(ROOT / "launch" / "2node-node0.yaml"), None)
    assert (two_nodes["num_processes"], two_nodes["num_machines"], two_nodes["processes_per_machine"]) == (16, 2, 8)
    assert read_launch(None, 3)["num_processes"] == 3 and read_launch(None, None)["num_processes"] == 1
    assert "one process" in read_launch(None, None)["source"]


def test_bad_launch_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--launch"):
        read_launch(str(tmp_path / "missing.yaml"), None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_processes: 3\nnum_machines: 2\n")
    with pytest.raises(ConfigError, match="multiple of num_machines"):
        read_launch(str(bad), None)


def test_split_rule():
    """The slower role sets the pace; each role's work divides over its processes; ties take fewer trainers."""
    alts = split_alternatives(4, extract_seconds=300.0, train_seconds=600.0)
    assert [(a["extractors"], a["trainers"]) for a in alts] == [(3, 1), (2, 2), (1, 3)]
    assert [a["wall_seconds"] for a in alts] == [600.0, 300.0, 300.0]
    assert best_split(alts)["trainers"] == 2
    assert best_split(split_alternatives(8, 100.0, 700.0))["trainers"] == 7
    assert best_split(split_alternatives(8, 700.0, 100.0))["trainers"] == 1
    # Every split is no faster than the one chosen.
    for extract, train in ((1.0, 9.0), (5.0, 5.0), (9.0, 1.0), (3.0, 7.0)):
        alts = split_alternatives(6, extract, train)
        assert best_split(alts)["wall_seconds"] == min(a["wall_seconds"] for a in alts)


def test_plan_auto_split_and_a_fixed_one(tmp_path):
    auto = build_plan(load_config(_config(tmp_path, roles={"trainers": "auto"})), launch_file=str(ROOT / "launch" / "8gpu.yaml"))
    roles = auto["roles"]
    assert auto["launch"]["num_processes"] == 8 and len(roles["alternatives"]) == 7
    assert roles["wall_seconds"] == min(a["wall_seconds"] for a in roles["alternatives"])
    assert roles["extractors"] + roles["trainers"] == 8 and "auto" in roles["chosen_by"]
    assert auto["time"]["total_seconds"] == pytest.approx(roles["wall_seconds"])
    worst = max(roles["alternatives"], key=lambda a: a["wall_seconds"])
    fixed = build_plan(load_config(_config(tmp_path, roles={"trainers": worst["trainers"]})), processes=8)
    assert fixed["roles"]["trainers"] == worst["trainers"]
    assert any("would be faster" in w and "roles.trainers: auto" in w for w in fixed["warnings"])
    with pytest.raises(ConfigError, match="leaves no extractor"):
        build_plan(load_config(_config(tmp_path, roles={"trainers": 8})), processes=8)


def test_resolve_trainers(tmp_path, monkeypatch):
    from dflash_stream.pipeline.roles import resolve_launch, resolve_trainers
    from dflash_stream.rundir import RunDir

    cfg = load_config(_config(tmp_path, roles={"trainers": "auto"}))
    assert resolve_trainers(cfg, 2)[0] == 1
    planned = build_plan(cfg, processes=4)["roles"]["trainers"]
    trainers, why = resolve_trainers(cfg, 4)
    assert trainers == planned and "shortest estimated wall time" in why
    # A resumed run keeps the trainer count its checkpoint was written with.
    step = RunDir(cfg.output_dir).checkpoint(10)
    step.mkdir(parents=True)
    for name in ("trainer-0.pt", "trainer-1.pt", "trainer-2.pt", "COMPLETE"):
        (step / name).write_text("")
    assert resolve_trainers(cfg, 4) == (3, "roles.trainers: auto; resuming step-10, which 3 trainer(s) wrote")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "resuming" in resolve_launch(cfg) and cfg.roles.trainers == 3 and cfg.roles.split(4) == (1, 3)


# ------------------------------------------------------------------------------------------- plan output


def test_plan_json_contract_for_the_headline_job(capsys):
    """configs/qwen3.6-27b-4gpu.yaml on launch/4gpu.yaml at 96 GB: both roles fit, the chosen split is the
    fastest, regeneration is estimated."""
    args = ["plan", "--config", str(HEADLINE), "--launch", str(ROOT / "launch" / "4gpu.yaml"),
            "--gpu-memory", "96GB", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["launch"]["num_processes"] == 4
    mem = plan["memory"]
    assert mem["device_bytes"] == 96 * GB
    for role in ("extractor", "trainer"):
        assert mem[role]["fits"] is True and 0 < mem[role]["total_bytes"] <= mem["usable_bytes"]
        assert all(isinstance(v, int) for v in mem[role]["parts"].values())
    assert {"drafter_parameters", "optimizer_states", "activations", "loss_working_set",
            "target_embedding_lm_head"} <= set(mem["trainer"]["parts"])
    assert {"target_weights", "forward_activations", "captured_states", "regeneration_kv_cache"} <= set(
        mem["extractor"]["parts"])
    assert mem["extractor"]["parts"]["target_weights"] == 54 * GB
    roles = plan["roles"]
    assert roles["extractors"] + roles["trainers"] == 4
    assert [(a["extractors"], a["trainers"]) for a in roles["alternatives"]] == [(3, 1), (2, 2), (1, 3)]
    assert roles["wall_seconds"] == min(a["wall_seconds"] for a in roles["alternatives"])
    assert plan["time"]["regenerate_seconds"] > 0
    assert plan["time"]["total_seconds"] == pytest.approx(roles["wall_seconds"])


def test_kl_loss_counts_the_verifier_and_fits_the_headline_plan(capsys):
    """train.loss kl on the headline job: one more layer per token on disk and in the batch, the forward to the
    last layer, the teacher's distribution beside the logits in the loss's chunk; still within a 96 GB GPU."""
    base = ["plan", "--config", str(HEADLINE), "--launch", str(ROOT / "launch" / "4gpu.yaml"), "--gpu-memory", "96GB",
            "--samples", "914000", "--json"]
    assert main(base) == 0
    ce = json.loads(capsys.readouterr().out)
    assert main([*base, "--train.loss=kl"]) == 0
    kl = json.loads(capsys.readouterr().out)
    assert ce["target"]["verifier_layer"] is None and kl["target"]["verifier_layer"] == 63
    assert kl["volume"]["raw_bytes_per_token"] == ce["volume"]["raw_bytes_per_token"] * 6 // 5  # 6 layers, not 5
    trainer, before = kl["memory"]["trainer"], ce["memory"]["trainer"]
    chunk, vocab, rows, dim = 2048, 248_320, trainer["worst_batch"]["supervised_rows"], 5120
    assert trainer["parts"]["loss_working_set"] - before["parts"]["loss_working_set"] == chunk * vocab * 6 + rows * dim * 4
    assert trainer["fits"] is True
    assert kl["time"]["phases"]["extract"]["tok_s_per_process"] < ce["time"]["phases"]["extract"]["tok_s_per_process"]
    assert kl["time"]["phases"]["train"]["tok_s_per_process"] < ce["time"]["phases"]["train"]["tok_s_per_process"]
    assert "and the verifier's layer 63" in render_plan(kl)


def test_overrides_change_the_trainers_memory_and_a_misfit_names_its_knob(capsys):
    base = ["plan", "--config", str(HEADLINE), "--launch", str(ROOT / "launch" / "4gpu.yaml"), "--gpu-memory", "96GB",
            "--samples", "914000"]
    assert main([*base, "--json"]) == 0
    small = json.loads(capsys.readouterr().out)["memory"]["trainer"]
    assert main([*base, "--json", "--train.batch_tokens=49152"]) == 0
    big = json.loads(capsys.readouterr().out)["memory"]["trainer"]
    assert big["total_bytes"] > 10 * small["total_bytes"] and big["fits"] is False
    assert big["parts"]["drafter_parameters"] == small["parts"]["drafter_parameters"]
    assert "train.batch_tokens" in big["knob"]
    assert main([*base, "--train.batch_tokens=49152"]) == 0
    page = capsys.readouterr().out
    assert "DOES NOT FIT: lower train.batch_tokens (fits at <= " in page
    assert main([*base, "--json", "--data.generation.batch_size=64"]) == 0
    extractor = json.loads(capsys.readouterr().out)["memory"]["extractor"]
    assert extractor["fits"] is False and "data.generation.batch_size" in extractor["knob"]


def test_plan_text_shows_memory_roles_and_regeneration(capsys):
    assert main(["plan", "--config", str(HEADLINE), "--launch", str(ROOT / "launch" / "4gpu.yaml"),
                 "--samples", "914000"]) == 0
    page = capsys.readouterr().out
    assert "device 89.4 GiB [roles.device_memory]" in page  # the config's 96GB
    assert "(shortest)" in page and "->" in page and "regeneration on the extractors" in page
    assert "prompt/response split" in page and "TB/s" in page


def test_default_device_is_80gb_class(tmp_path):
    plan = build_plan(load_config(_config(tmp_path)), processes=2)
    assert plan["memory"]["device_bytes"] == 80 * 2**30 and "80 GB-class" in plan["memory"]["device_source"]


def test_run_startup_check_refuses_or_warns(tmp_path):
    cfg = load_config(_config(tmp_path, train={"batch_tokens": 2048}))
    # On a device smaller than the trainer's estimate: refused, naming the knob.
    with pytest.raises(DFlashError, match="train.batch_tokens"):
        startup_check(cfg, "trainer", 50 * GB)
    trainer = build_plan(cfg, processes=2, gpu_memory=1000 * GB)["memory"]["trainer"]["total_bytes"]
    # Between the usable share and the whole device: a warning line with the knob.
    warning = startup_check(cfg, "trainer", int(trainer / 0.95))
    assert warning and "train.batch_tokens" in warning
    assert startup_check(cfg, "trainer", 4 * trainer) is None


def test_gpu_memory_flag_is_validated(capsys):
    assert main(["plan", "--config", str(HEADLINE), "--gpu-memory", "lots"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err


def _family_shape(model_type: str, **fields):
    from transformers import AutoConfig

    from dflash_stream.target_model.shape import shape_from_config

    return shape_from_config(AutoConfig.for_model(model_type, **fields), "test")


def test_generation_cache_follows_the_layer_types():
    """K/V only on attention layers (a sliding one at most its window), MLA's latent, a GDN state per sequence."""
    dense = target_dims(_family_shape("qwen3", num_hidden_layers=4, hidden_size=64, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300))
    assert dense.kv_cache_bytes(100, 2) == 4 * 100 * 2 * 2 * 16 * 2 and dense.state_bytes == 0
    hybrid = target_dims(_family_shape(
        "qwen3_5_text", num_hidden_layers=8, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4))
    assert hybrid.kv_cache_bytes(100, 2) == 2 * 100 * 2 * 2 * 16 * 2  # every 4th layer: 2 of 8
    recurrent, conv = 4 * 8 * 8, (2 * 2 * 8 + 4 * 8) * 3
    assert hybrid.state_bytes == 6 * (recurrent + conv) * 4  # float32, whatever the length
    gemma = target_dims(_family_shape(
        "gemma3_text", num_hidden_layers=6, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, vocab_size=300, sliding_window=32))
    per_token_layer = 2 * 1 * 16 * 2
    assert gemma.kv_cache_bytes(100, 2) == (1 * 100 + 5 * 32) * per_token_layer  # 5 local layers + 1 global
    # The mean over a decode from 0 to 100 tokens: the local layers fill up at 32 and stay there.
    assert gemma.mean_kv_cache_bytes(0, 100, 2) == pytest.approx((50 + 5 * (32 * 32 / 2 + 32 * 68) / 100)
                                                                 * per_token_layer)
    mla = target_dims(_family_shape(
        "deepseek_v3", num_hidden_layers=2, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        q_lora_rank=None, vocab_size=300, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2))
    assert mla.kv_cache_bytes(10, 2) == 2 * 10 * (16 + 8) * 2  # the compressed latent and the shared RoPE key
    assert mla.active_parameters < mla.num_parameters  # FLOPs count 2 of 8 routed experts


def test_regeneration_and_extraction_rates_use_the_layer_types_and_active_parameters(tmp_path: Path):
    from dflash_stream.sizing.work import estimated_rates, regeneration_estimate

    cfg = load_config(_config(tmp_path, data={"sources": [{"path": "org/x"}], "regenerate": True,
                                              "max_length": 4096, "generation": {"batch_size": 8}}))
    fields = dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, vocab_size=1000)
    dense = _family_shape("qwen3", **fields)
    hybrid = _family_shape("qwen3_5_text", **fields)
    r_dense = regeneration_estimate(cfg, target_dims(dense), 3000, "gpu")
    r_hybrid = regeneration_estimate(cfg, target_dims(hybrid), 3000, "gpu")
    assert r_hybrid["kv_bytes_read_per_step"] == pytest.approx(r_dense["kv_bytes_read_per_step"] / 4)
    assert r_hybrid["state_bytes_per_step"] == 8 * 2 * target_dims(hybrid).state_bytes
    assert r_dense["state_bytes_per_step"] == 0
    moe = _family_shape("qwen3_moe", **fields, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=2)
    dims = target_dims(moe)
    rate = estimated_rates(cfg, moe, [1, 3, 5], 1000)["extract_tok_s"]
    # FLOPs per token: the active parameters of the 6 layers run (early stop after layer 5), not the total.
    body = dims.active_parameters - 2 * 1000 * 512
    assert rate == pytest.approx(4.0e14 / (2 * body / 8 * 6))


def test_extractor_memory_has_no_regeneration_with_engine_openai(tmp_path: Path):
    """The servers decode beside the launch: an extractor holds the capture forward alone, as without
    regeneration, and `run`'s startup check and the knob never point at data.generation.batch_size."""
    from dflash_stream.sizing.memory import memory_plan
    from dflash_stream.target_model.shape import target_shape

    def extractor(**data):
        cfg = load_config(_config(tmp_path, data=data))
        return memory_plan(cfg, target_shape(cfg.target), [1, 9, 17, 25, 33], "gpu", 96 * GB)["extractor"]

    hf = extractor(regenerate=True, generation={"batch_size": 64})
    served = extractor(regenerate=True, generation={"engine": "openai", "endpoints": ["http://a:8000/v1"],
                                                    "batch_size": 64})
    plain = extractor(regenerate=False)
    assert {"regeneration_kv_cache", "regeneration_prefill"} <= set(hf["parts"]) and "regenerate" in hf["phases"]
    assert not any(k.startswith("regeneration") for k in served["parts"]) and set(served["phases"]) == {"forward"}
    assert served == plain and served["total_bytes"] < hf["total_bytes"]
    # The vLLM variant of the headline config: no regeneration parts in the plan's memory either.
    plan = build_plan(load_config(ROOT / "configs" / "qwen3.6-27b-4gpu-vllm.yaml"), processes=4)
    assert not any(k.startswith("regeneration") for k in plan["memory"]["extractor"]["parts"])


def test_training_rate_counts_the_lm_heads_logits_again_where_backward_recomputes_them(tmp_path: Path):
    """The head costs forward + the input's gradient (4·V·D per block token) where a micro-batch's rows fit one
    chunk of train.loss_chunk_rows (the loss keeps that chunk's softmax) or the head is unchunked, and 6·V·D
    where backward computes each chunk's logits again; the drafter's layers cost the same either way."""
    from dflash_stream.sizing.memory import drafter_dims
    from dflash_stream.sizing.work import estimated_rates

    shape = _family_shape("qwen3", num_hidden_layers=8, hidden_size=512, intermediate_size=1024,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=50_000)
    mean, layers = 1000, [1, 3, 5]
    # 2 sequences x 64 anchors x 7 slots = 896 supervised rows per micro-batch at most.
    train = {"batch_tokens": 2000, "num_anchors": 64}
    rates = {rows: estimated_rates(load_config(_config(tmp_path, train={**train, "loss_chunk_rows": rows},
                                                       drafter={"block_size": 8})), shape, layers, mean)["train_tok_s"]
             for rows in (None, 896, 895)}
    assert rates[None] == rates[896] > rates[895]
    cfg = load_config(_config(tmp_path, train=train, drafter={"block_size": 8}))
    d, vocab = 512, 50_000
    recomputed = 1 / rates[895] - 1 / rates[896]  # seconds per sample token of the logits made again
    assert recomputed == pytest.approx(64 * 8 * 2 * vocab * d / mean / 4.0e14, rel=1e-9)
    assert drafter_dims(cfg, target_dims(shape), len(layers)).hidden_size == d
