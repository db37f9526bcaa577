"""Config loading: YAML + overrides, sizes, and one clear line for every bad key or value."""

from pathlib import Path

import pytest

from dflash_stream.cli import main
from dflash_stream.config import ConfigError, load_config

CONFIGS = Path(__file__).parent.parent / "configs"

MINIMAL = """
output_dir: out
data:
  sources: [{path: rows.jsonl}]
store: {path: out/store, budget: 1GB}
"""


@pytest.fixture
def minimal(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(MINIMAL)
    return path


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS / name)
    assert int(cfg.store.budget) > 0


def test_sizes_accept_decimal_binary_and_plain(minimal):
    assert int(load_config(minimal, ["--store.budget=150GB"]).store.budget) == 150 * 10**9
    assert int(load_config(minimal, ["--store.budget=150GiB"]).store.budget) == 150 * 2**30
    assert int(load_config(minimal, ["--store.budget=12345"]).store.budget) == 12345


def test_overrides_reach_nested_keys_and_list_items(minimal):
    cfg = load_config(minimal, ["--train.lr=1e-3", "--data.generation.max_new_tokens=7", "--data.sources.0.limit=5"])
    assert cfg.train.lr == 1e-3
    assert cfg.data.generation.max_new_tokens == 7
    assert cfg.data.sources[0].limit == 5


@pytest.mark.parametrize(
    "override, words",
    [
        (["--store.codec=zip"], ["store.codec", "'lossless', 'fp8' or 'none'", "zip"]),
        (["--store.budgett=1GB"], ["store.budgett", "allowed here", "budget"]),
        (["--store.budget=lots"], ["store.budget", "150GiB"]),
        (["--train.lr=-1"], ["train.lr", "greater than 0"]),
        (["--target.device=gpu"], ["target.device", "cuda:N"]),
        (["--roles.mode=both"], ["roles.mode", "'single'"]),
        (["--data.sources.3.limit=1"], ["data.sources.3", "1 entries"]),
        (["store.codec=none"], ["--section.key=value"]),
        (["--train.epochs=3", "--store.reuse=2"], ["store.reuse=2", "train.epochs=3"]),
        (["--data.generation.engine=vllm"], ["data.generation.engine", "'hf' or 'openai'"]),
        (["--data.generation.engine=openai"], ["data.generation", "endpoints", "http://localhost:8000/v1"]),
        (["--data.generation.endpoints=[localhost:8000]"], ["data.generation.endpoints", "localhost:8000", "http(s) URL"]),
        (["--data.generation.concurrency=0"], ["data.generation.concurrency", "greater than or equal to 1"]),
    ],
)
def test_bad_keys_and_values_name_the_key(minimal, override, words):
    with pytest.raises(ConfigError) as err:
        load_config(minimal, override)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_missing_section_and_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("output_dir: x\n")
    with pytest.raises(ConfigError, match="missing config key 'data'"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_reuse_follows_epochs(minimal):
    cfg = load_config(minimal, ["--train.epochs=3"])
    assert cfg.store.reuse == 3 and cfg.extraction_passes == 1
    cfg = load_config(minimal, ["--train.epochs=3", "--train.epoch_source=reextract"])
    assert cfg.store.reuse == 1 and cfg.extraction_passes == 3


def test_cli_prints_one_line_and_exits_2(minimal, capsys):
    assert main(["audit", str(minimal.parent / "no-such-run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-stream: error:") and "\n" not in err


def test_store_codec_names_are_the_registry() -> None:
    import typing

    from dflash_stream.config import StoreConfig
    from dflash_stream.store import codecs

    assert typing.get_args(StoreConfig.model_fields["codec"].annotation) == codecs.names()


def test_endpoints_get_their_api_path(minimal):
    cfg = load_config(minimal, ["--data.generation.engine=openai",
                                "--data.generation.endpoints=[http://a:8000, 'https://b/v1/', http://c:1/api]"])
    assert cfg.data.generation.endpoints == ["http://a:8000/v1", "https://b/v1", "http://c:1/api"]


def test_where_answers_come_from_leaves_the_data_digest_alone(minimal):
    """The response cache and the store are named by the data digest: endpoints, concurrency and timeouts do not
    change the answers, the sampling settings do; engine hf keeps the digest it had (the demo's, pinned)."""
    from dflash_stream.data.spec import data_spec_digest

    assert data_spec_digest(load_config(CONFIGS / "demo.yaml")) == "f752dce66a8335f9"
    served = ["--data.regenerate=true", "--data.generation.engine=openai", "--data.generation.endpoints=[http://a:1]"]
    base = data_spec_digest(load_config(minimal, served))
    for other in (["--data.generation.endpoints=[http://b:2, http://c:3]"], ["--data.generation.concurrency=7"],
                  ["--data.generation.timeout_s=5"], ["--data.generation.seed=3"]):  # greedy: the seed is unused
        assert data_spec_digest(load_config(minimal, served + other)) == base, other
    for other in (["--data.generation.max_new_tokens=9"], ["--data.generation.model=m"],
                  ["--data.generation.temperature=0.7"], ["--data.generation.engine=hf"]):
        assert data_spec_digest(load_config(minimal, served + other)) != base, other
