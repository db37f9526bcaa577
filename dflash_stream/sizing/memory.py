"""Device memory per role: does the extractor fit its GPU, and does the trainer?

Each role's peak is a sum of named parts, counted from what the code allocates (not fitted to measurements):

- extractor: the target's weights, then whichever of its two phases is larger (they alternate): the capture
  forward at `extract.batch_tokens` (one decoder layer's working set, the captured layers' states and their
  concatenation), or regeneration with data.generation.engine hf (`model.generate`: the cache of a full
  generation batch and the prefill's working set; engine openai decodes on servers beside the launch). The cache follows the target's layer types (`target_model.shape`): K/V on attention layers
  only (a sliding layer holds at most its window; MLA its compressed latent), and a fixed-size recurrent state
  per sequence on linear-attention (Gated-DeltaNet) layers.
- trainer: the drafter's parameters and AdamW states, the frozen target embedding and LM head, then whichever is
  larger of the backward phase (gradients, what autograd saved for backward at the worst micro-batch, the
  LM-head/loss chunk) and the optimizer step (gradients and the trainer's flattened all-reduce copies).

The worst micro-batch is the one the token batcher can cut with the most block tokens: short samples, many per
batch, every position an anchor (see `worst_train_batch`). `dflash-stream bench memory` measures the real
trainer step and extractor forward against these estimates. `plan` shows them (observe/plan.py renders them);
`run` checks its role against its GPU before any work (`startup_check`). `DrafterDims.num_parameters` is the one
count of the drafter's parameters (the disk footprint's checkpoints and export use it too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from dflash_stream.config import Config, ConfigError
from dflash_stream.errors import DFlashError
from dflash_stream.target_model.layers import stored_layer_ids
from dflash_stream.target_model.shape import KV_LAYER_TYPES, SLIDING, default_intermediate_size
from dflash_stream.units import fmt_bytes

if TYPE_CHECKING:
    from dflash_stream.target_model.shape import TargetShape

GIB = 2**30
DEFAULT_DEVICE_BYTES = 80 * GIB
"""An 80 GB-class GPU (A100/H100 80GB) when neither --gpu-memory nor roles.device_memory says otherwise."""
USABLE_FRACTION = 0.9
"""Share of the device the estimate may fill: CUDA context, kernel workspaces, NCCL buffers and allocator
fragmentation take the rest."""
ASSUMED_VOCAB = 151_936
STATE_DTYPE_BYTES = 4
"""Bytes per element of a linear-attention layer's recurrent state: transformers' torch path and
flash-linear-attention both keep it in float32, whatever the model's dtype."""

# Bytes autograd keeps for backward in one draft layer, per block token and per unit of each width, counted on
# the real drafter with torch.autograd.graph.saved_tensors_hooks (float32, and bf16 autocast with float32
# weights: RMSNorm outputs stay float32, linear outputs are bf16). "hidden" is D wide (norm inputs/outputs,
# linear inputs), "q" H*Dh (queries, attention output), "kv" G*Dh (block keys/values before the cat), "mlp" the
# MLP width (gate, up, SiLU, product), "stats" per query head (RMSNorm reciprocals, attention log-sum-exp).
# Per layer and key/value position: "kv_cat" (the context+block keys and values attention reads), and per
# context token "context_kv" (the context's keys/values before norm and RoPE).
SAVED_PER_LAYER = {
    "fp32": {"hidden": 24, "q": 16, "kv": 8, "mlp": 16, "stats": 8, "kv_cat": 8, "context_kv": 8},
    "bf16": {"hidden": 26, "q": 12, "kv": 8, "mlp": 8, "stats": 8, "kv_cat": 4, "context_kv": 8},
}
# Once per micro-batch: the last layer's output and the supervised rows gathered from it (float32 in both
# modes), RoPE cos/sin (float32, per position), and per context token the fc input and the fused features.
SAVED_CONTEXT = {"fp32": {"fc_input": 4, "features": 12}, "bf16": {"fc_input": 2, "features": 10}}
# What a DFlash2 layer keeps beside a DFlash one, per block token and hidden unit, counted the same way at
# conv_kernel_size 2 (taps scale it): its four grouped convolutions' inputs and kernel deltas (their per-token
# coefficients are recomputed in backward), and the products around them.
SAVED_CONV_PER_LAYER = {"fp32": 18, "bf16": 17}
SELECTOR_BYTES_PER_CANDIDATE = 16
"""Per supervised row and candidate of a DFlash2 drafter: its id (int64), its logit and its score (float32)."""


def parse_size(text: str) -> int:
    """'96GB', '80GiB' or a plain number of bytes."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise ConfigError(f"--gpu-memory: expected a size such as 96GB, 80GiB or a number of bytes (got {text!r})") \
            from None


# ---------------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class TargetDims:
    """The target's shape (`target_model.shape.TargetShape`, the one home of its facts) with each width it does
    not give filled by a labelled assumption: what the memory and time models compute with."""

    shape: TargetShape
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_parameters: float
    active_parameters: float
    """Parameters one token runs through (MoE: routed experts top-k of n): what FLOPs are counted from."""
    kv_elements_per_token: dict[str, int]
    """Cache elements one token adds to one layer, per attention layer type (2 x KV heads x head_dim; MLA: the
    latent)."""
    assumed: tuple[str, ...] = ()
    """What was not known and had to be assumed (named in plan's output)."""

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def tied(self) -> bool:
        return self.shape.tie_word_embeddings

    @property
    def active_layer_parameters(self) -> float:
        """Mean active parameters of one decoder layer: the active total without the embedding and the LM head
        (a lookup, and a head the capture forward never runs). Hybrids average their layer kinds."""
        body = self.active_parameters - self.vocab_size * self.hidden_size * (1 if self.tied else 2)
        return max(body, 0.0) / self.num_layers

    def _kv_elements(self) -> tuple[int, int]:
        """Cache elements one token adds (across the layers whose K/V grows with the sequence, across the
        sliding-window layers). Chunked-attention layers (Llama 4) count as growing: an upper bound.
        Linear-attention layers keep no K/V (see `state_bytes`)."""
        per_type = {kind: n * self.kv_elements_per_token[kind]
                    for kind, n in self.shape.layer_type_counts.items() if kind in KV_LAYER_TYPES}
        sliding = per_type.pop(SLIDING, 0)
        return sum(per_type.values()), sliding

    def kv_cache_bytes(self, tokens: float, dtype_bytes: int) -> float:
        """One sequence's K/V cache after `tokens` tokens, a sliding layer holding at most its window."""
        growing, sliding = self._kv_elements()
        window = self.shape.sliding_window or tokens
        return (growing * tokens + sliding * min(tokens, window)) * dtype_bytes

    def mean_kv_cache_bytes(self, start: float, end: float, dtype_bytes: int) -> float:
        """The K/V cache averaged over a decode from `start` to `end` tokens (what one step reads on average)."""
        if end <= start:
            return self.kv_cache_bytes(start, dtype_bytes)
        growing, sliding = self._kv_elements()
        window = self.shape.sliding_window or end
        return (growing * (start + end) / 2 + sliding * _mean_capped(start, end, window)) * dtype_bytes

    @property
    def state_bytes(self) -> int:
        """One sequence's fixed-size state of all linear-attention layers (Gated-DeltaNet: recurrent + conv),
        whatever its length; all of it counted in float32 (the conv state, a few % of it, is in the model's
        dtype: a slight overestimate)."""
        return self.shape.state_elements_per_sequence * STATE_DTYPE_BYTES


def _mean_capped(start: float, end: float, cap: float) -> float:
    """The mean of min(x, cap) for x uniform on [start, end] (start < end)."""
    if end <= cap:
        return (start + end) / 2
    if start >= cap:
        return cap
    return ((cap * cap - start * start) / 2 + cap * (end - cap)) / (end - start)


def target_dims(shape: TargetShape) -> TargetDims:
    """The target's widths, with a labelled assumption for each one neither the config nor the model gives."""
    assumed = []
    d = shape.hidden_size
    inter = shape.intermediate_size
    if inter is None:
        inter = 8 * d // 3
        assumed.append(f"MLP width 8/3 x hidden = {inter:,} (set target.intermediate_size)")
    vocab = shape.vocab_size
    if vocab is None:
        vocab = ASSUMED_VOCAB
        assumed.append(f"vocab {vocab:,} (set target.vocab_size)")
    heads = shape.num_attention_heads
    head_dim = shape.head_dim or (d // heads if heads else 128)
    if heads is None:
        heads = max(1, d // head_dim)
    kv_heads = shape.num_key_value_heads
    if kv_heads is None:
        kv_heads = max(1, heads // 8)
        assumed.append(f"{kv_heads} key/value heads of {head_dim} (GQA 8:1; set target.num_key_value_heads, "
                       "target.head_dim)")
    tied = bool(shape.tie_word_embeddings)
    per_layer = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 3 * d * inter + 2 * d
    params = shape.num_parameters or shape.num_layers * per_layer + vocab * d * (1 if tied else 2) + d
    active = shape.active_parameters or params
    kv_elements = {kind: shape.kv_elements_per_token.get(kind) or 2 * kv_heads * head_dim
                   for kind in shape.layer_type_counts if kind in KV_LAYER_TYPES}
    return TargetDims(shape, inter, heads, kv_heads, head_dim, vocab, params, active, kv_elements, tuple(assumed))


@dataclass(frozen=True)
class DrafterDims:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    context_layers: int
    vocab_size: int
    block_size: int
    kind: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    @property
    def dflash2(self) -> bool:
        return self.kind == "dflash2"

    @property
    def linear_parameters(self) -> int:
        """Weights of the drafter's Linear layers (what bf16 autocast keeps a bf16 copy of); DFlash2 adds its
        convolutions' kernel projections and the selector's hidden projection."""
        d, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = 2 * d * q + 2 * d * kv + 3 * d * self.intermediate_size
        if self.dflash2:
            per_layer += 2 * d * 2 * self.conv_kernel_size * (d // self.conv_group_size)
        selector = d * self.selector_rank if self.dflash2 else 0
        return self.num_layers * per_layer + self.context_layers * d * d + selector

    @property
    def num_parameters(self) -> int:
        """Every parameter of `DFlashDrafter` (linears, the layers' four RMSNorms, hidden_norm and norm), and of
        `DFlash2Drafter` (its convolutions' base kernels, the selector's two codebooks over the vocabulary)."""
        norms = self.num_layers * (2 * self.hidden_size + 2 * self.head_dim) + 2 * self.hidden_size
        extra = 0
        if self.dflash2:
            extra = self.num_layers * 2 * 2 * self.conv_kernel_size * self.hidden_size
            extra += 2 * self.vocab_size * self.selector_rank
        return self.linear_parameters + norms + extra


def drafter_dims(cfg: Config, target: TargetDims, context_layers: int) -> DrafterDims:
    """The drafter's shape as `drafter.spec.build_spec` derives it from the target and `cfg.drafter`."""
    d = cfg.drafter
    heads = d.num_attention_heads or target.num_attention_heads
    return DrafterDims(
        hidden_size=target.hidden_size,
        intermediate_size=d.intermediate_size or default_intermediate_size(target.shape),
        num_layers=d.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=d.num_key_value_heads or target.num_key_value_heads,
        head_dim=d.head_dim or target.head_dim,
        context_layers=context_layers,
        vocab_size=target.vocab_size,
        block_size=d.block_size,
        kind=d.kind,
        conv_kernel_size=d.conv_kernel_size,
        conv_group_size=d.conv_group_size,
        selector_rank=d.selector_rank,
        selector_top_k=d.selector_top_k,
    )


@dataclass(frozen=True)
class TrainBatch:
    """A padded micro-batch as the drafter sees it: `sequences` rows of `length` context tokens, `anchors`
    blocks per row (invalid ones padded, still computed), `rows` supervised slots reaching the LM head."""

    sequences: int
    length: int
    anchors: int
    block_size: int
    rows: int

    @property
    def block_tokens(self) -> int:
        return self.sequences * self.anchors * self.block_size

    def to_dict(self) -> dict[str, int]:
        return {"sequences": self.sequences, "length": self.length, "anchors": self.anchors,
                "block_tokens": self.block_tokens, "supervised_rows": self.rows}


def train_batch(sequences: int, length: int, num_anchors: int, block_size: int) -> TrainBatch:
    """A batch of fully supervised rows: min(num_anchors, length - 1) anchors, B - 1 labels each."""
    anchors = max(1, min(num_anchors, length - 1))
    return TrainBatch(sequences, length, anchors, block_size, sequences * anchors * (block_size - 1))


def worst_train_batch(cfg: Config) -> TrainBatch:
    """The micro-batch with the most block tokens the trainer's token batcher can cut: rows x longest <=
    train.batch_tokens (one row may be longer), every position of a row eligible as an anchor. Short rows
    are the worst case: a batch of samples below num_anchors tokens drafts ~batch_tokens x block_size tokens."""
    t = cfg.train
    shortest = max(2, cfg.min_supervised_tokens)
    candidates = (
        train_batch(max(1, t.batch_tokens // length), length, t.num_anchors, cfg.drafter.block_size)
        for length in range(shortest, cfg.data.max_length + 1)
    )
    return max(candidates, key=lambda b: (b.block_tokens, b.length))


# ---------------------------------------------------------------------------------------------------- roles


@dataclass
class Estimate:
    parts: dict[str, int]
    phases: dict[str, int]
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return max(self.phases.values())


def trainer_memory(d: DrafterDims, batch: TrainBatch, *, bf16: bool, flex: bool, chunk_rows: int | None,
                   tied_head: bool, foreach: bool, verifier: bool = False, kl: bool = False) -> Estimate:
    """Peak bytes of one trainer step at `batch` (forward, backward, the trainer's optimizer step). `verifier`: the
    batch holds the verifier's state beside the K layers; `kl`: the loss makes the target's distribution from it
    (train.loss kl or ce+kl)."""
    mode = "bf16" if bf16 else "fp32"
    act = 2 if bf16 else 4
    p = d.num_parameters
    dim, q_width, kv_width = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    t, n, s = batch.block_tokens, batch.sequences, batch.length
    ctx = n * s
    keys = n * (s + batch.anchors * batch.block_size)  # context + block keys per row, summed over rows
    c = SAVED_PER_LAYER[mode]
    per_layer = (t * (c["hidden"] * dim + c["q"] * q_width + c["kv"] * kv_width + c["mlp"] * d.intermediate_size
                      + c["stats"] * d.num_attention_heads)
                 + keys * c["kv_cat"] * kv_width + ctx * c["context_kv"] * kv_width)
    dense_mask = 0 if flex else n * batch.anchors * batch.block_size * (s + batch.anchors * batch.block_size)
    # SDPA turns the boolean mask into an additive one of the activations' dtype in every layer and keeps it.
    per_layer += dense_mask * act
    if d.dflash2:
        per_layer += t * SAVED_CONV_PER_LAYER[mode] * dim * d.conv_kernel_size // 2
    cc = SAVED_CONTEXT[mode]
    shared = (4 * t * dim + 4 * batch.rows * dim + 8 * d.head_dim * (t + ctx)
              + ctx * (cc["fc_input"] * d.context_layers * dim + cc["features"] * dim))
    head_bytes = 2 if bf16 else 4
    chunk = batch.rows if chunk_rows is None else min(chunk_rows, batch.rows)
    # float32 logits of a chunk beside their head-dtype original (one buffer in float32), and the rows' gradient.
    loss = chunk * d.vocab_size * (4 + (head_bytes if head_bytes != 4 else 0)) + 4 * batch.rows * dim
    if chunk_rows is None:  # plain autograd keeps the logits, their float32 copy and log-softmax for backward
        loss += batch.rows * d.vocab_size * 4
    if kl:
        # The teacher's float32 log-probabilities beside the logits (forward; in backward beside the gradient) and
        # their head-dtype original; per row the verifier's state gathered and its normed copy (kept for backward).
        loss += chunk * d.vocab_size * (4 + head_bytes) + batch.rows * dim * (2 + head_bytes)
        if chunk_rows is None:  # and plain autograd keeps the teacher's distribution and the KL's terms
            loss += batch.rows * d.vocab_size * 8
    if d.dflash2:
        # The candidates of every row, and a chunk's gathered successor codes with their product and gradient.
        step = batch.rows if chunk_rows is None else min(chunk_rows, batch.rows)
        loss += (batch.rows * d.selector_top_k * SELECTOR_BYTES_PER_CANDIDATE
                 + 3 * step * d.selector_top_k * d.selector_rank * 4)
    parts = {
        "drafter_parameters": 4 * p,
        "gradients": 4 * p,
        "optimizer_states": 8 * p,  # AdamW exp_avg and exp_avg_sq, float32
        "target_embedding_lm_head": d.vocab_size * dim * head_bytes * (1 if tied_head else 2),
        "autocast_weight_copies": 2 * d.linear_parameters if bf16 else 0,
        # bf16 states (the verifier's too), int64 ids, mask, lengths
        "batch": ctx * ((d.context_layers + verifier) * dim * 2 + 17) + dense_mask,
        "activations": d.num_layers * per_layer + shared,
        "loss_working_set": loss,
        # The trainer's step: all gradients flattened for the all-reduce, then rescaled copies (old ones alive
        # until the step ends), plus foreach AdamW's sqrt(exp_avg_sq) temporaries on CUDA.
        "optimizer_step_buffers": 8 * p + (4 * p if foreach else 0),
    }
    resident = parts["drafter_parameters"] + parts["optimizer_states"] + parts["target_embedding_lm_head"]
    phases = {
        "backward": resident + sum(parts[k] for k in ("gradients", "autocast_weight_copies", "batch", "activations",
                                                      "loss_working_set")),
        "optimizer_step": resident + parts["gradients"] + parts["optimizer_step_buffers"],
    }
    return Estimate(parts, phases)


@dataclass(frozen=True)
class ForwardShape:
    """A padded forward batch: `rows` x `length` for the attention mask, `tokens` for everything else."""

    rows: int
    length: int
    tokens: int

    def to_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "length": self.length, "tokens": self.tokens}


def records_while_generating(rows: int, prompt_width: int, max_new_tokens: int, batch_tokens: int) -> bool:
    """Whether in-process regeneration keeps a generation batch's states as it decodes (`generate_with_states`),
    sparing those samples the capture forward: only when they are no more tokens' worth than one capture forward
    holds (extract.batch_tokens), every row with its left padding over the prompt and each decoding step (one
    more than the answer's budget)."""
    return rows * (prompt_width + max_new_tokens + 1) <= batch_tokens


def forward_shape(rows: int, length: int) -> ForwardShape:
    return ForwardShape(rows, length, rows * length)


def worst_forward(batch_tokens: int, max_length: int) -> ForwardShape:
    """The extractor's worst padded batch (rows x longest <= batch_tokens, a longer sample alone): the full
    token budget, and rows of max_length, whose attention mask is the largest."""
    return ForwardShape(max(1, batch_tokens // max_length), max_length, max(batch_tokens, max_length))


def forward_working_set(t: TargetDims, shape: ForwardShape, dtype_bytes: int, mask_bytes: int) -> int:
    """One decoder layer's live tensors in an inference forward, beside the residual stream: the normed input,
    q/k/v and their rotated copies, the attention output, then the MLP's gate/up/SiLU/product; plus the RoPE
    tables, the input embeddings and the 4-D attention mask (boolean, and as SDPA's additive copy)."""
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    attention = 2 * t.hidden_size + 2 * q + 4 * kv + q
    mlp = 2 * t.hidden_size + 3 * t.intermediate_size
    per_token = (t.hidden_size + max(attention, mlp) + 2 * t.head_dim) * dtype_bytes
    mask = shape.rows * shape.length * shape.length * (1 + mask_bytes)
    return shape.tokens * per_token + mask


def extractor_memory(t: TargetDims, shape: ForwardShape, *, captured_layers: int, dtype_bytes: int,
                     generation: tuple[int, int] | None = None) -> Estimate:
    """Peak bytes of an extractor: capture forwards of `shape`, and (generation = (batch, max_length))
    regeneration with `model.generate`."""
    captured_bytes = shape.tokens * captured_layers * t.hidden_size * 2  # bf16
    parts = {
        "target_weights": int(t.num_parameters * dtype_bytes),
        "forward_activations": forward_working_set(t, shape, dtype_bytes, dtype_bytes),
        # The captured layers' bf16 states, then their concatenation (both alive while it is made).
        "captured_states": 2 * captured_bytes,
    }
    phases = {"forward": sum(parts.values())}
    if generation is not None:
        batch, length = generation
        parts["regeneration_kv_cache"] = int(batch * t.kv_cache_bytes(length, dtype_bytes))
        if t.state_bytes:  # hybrids: each row's linear-attention layers keep a fixed-size state instead
            parts["regeneration_linear_state"] = batch * t.state_bytes
        # The prefill runs the whole prompt batch through every layer (prompts may be nearly max_length long).
        parts["regeneration_prefill"] = forward_working_set(t, forward_shape(batch, length), dtype_bytes, dtype_bytes)
        phases["regenerate"] = (parts["target_weights"] + parts["regeneration_kv_cache"]
                                + parts.get("regeneration_linear_state", 0) + parts["regeneration_prefill"])
    return Estimate(parts, phases)


# ---------------------------------------------------------------------------------------------------- plan


def target_dtype_bytes(cfg: Config, kind: str) -> int:
    """Bytes per weight of the loaded target (`target_model.loading.resolve_dtype`)."""
    if cfg.target.dtype == "auto":
        return 4 if kind == "cpu" else 2
    return 4 if cfg.target.dtype == "float32" else 2


def _uses_bf16(cfg: Config, kind: str) -> bool:
    """The trainer's autocast rule (`pipeline.trainer.use_bf16`), from the device kind."""
    mp = cfg.train.mixed_precision
    return mp == "bf16" or (mp == "auto" and kind == "gpu")


def device_memory(cfg: Config, kind: str, gpu_memory: int | None, per_machine: int) -> tuple[int, str]:
    """(bytes of one process's device, where the figure comes from)."""
    if gpu_memory:
        return gpu_memory, "--gpu-memory"
    if cfg.roles.device_memory:
        return int(cfg.roles.device_memory), "roles.device_memory"
    if kind == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return ram // per_machine, f"this machine's RAM shared by {per_machine} process(es)"
    return DEFAULT_DEVICE_BYTES, "assumed: an 80 GB-class GPU (80 GiB); pass --gpu-memory or set roles.device_memory"


def _resident(role: str, est: Estimate) -> int:
    """What a role keeps on the device between its phases."""
    if role == "extractor":
        return est.parts.get("target_weights", 0)
    return sum(est.parts[k] for k in ("drafter_parameters", "optimizer_states", "target_embedding_lm_head"))


def role_estimates(cfg: Config, dims: TargetDims, layer_ids: list[int], kind: str, single: bool = False
                   ) -> dict[str, tuple[Estimate, Any]]:
    """{role: (estimate, worst batch shape)} for this config on a device of `kind` (gpu or cpu); `layer_ids` the
    drafter's (the verifier's state, when stored, is counted from the config). `single`: one
    process holds both roles and alternates them, so each role's peak sits beside the other's resident part."""
    dtype_bytes = target_dtype_bytes(cfg, kind)
    forward = worst_forward(cfg.extract.batch_tokens, cfg.data.max_length)
    # Only engine hf runs `model.generate` in the extractors; with engine openai the servers beside the launch
    # decode, and an extractor holds the capture forward alone.
    generates = cfg.data.regenerate and cfg.data.generation.engine == "hf"
    gen = (cfg.data.generation.batch_size, cfg.data.max_length) if generates else None
    stored = stored_layer_ids(dims.num_layers, cfg.target, cfg.verifier_states)
    if cfg.extract.engine == "vllm":  # the servers hold the target: the extractor puts nothing on a device
        extractor = Estimate({}, {"client": 0}, ["extract.engine vllm: the states are computed by the vLLM servers"])
    else:
        extractor = extractor_memory(dims, forward, captured_layers=len(stored), dtype_bytes=dtype_bytes,
                                     generation=gen)
    drafter = drafter_dims(cfg, dims, len(layer_ids))
    batch = worst_train_batch(cfg)
    flex = cfg.drafter.attention == "flex" or (cfg.drafter.attention == "auto" and kind == "gpu")
    trainer = trainer_memory(drafter, batch, bf16=_uses_bf16(cfg, kind), flex=flex,
                             chunk_rows=cfg.train.loss_chunk_rows, tied_head=dims.tied, foreach=kind == "gpu",
                             verifier=cfg.verifier_states, kl=cfg.train.loss != "ce")
    if single:
        beside = {"extractor": _resident("trainer", trainer), "trainer": _resident("extractor", extractor)}
        for role, est in (("extractor", extractor), ("trainer", trainer)):
            est.parts["other_role_resident"] = beside[role]
            est.phases = {k: v + beside[role] for k, v in est.phases.items()}
    return {"extractor": (extractor, forward.to_dict()), "trainer": (trainer, batch.to_dict())}


def _largest_fitting(values: range, fits) -> int | None:
    """The largest value in an increasing range for which fits(value) holds (fits is monotone), or None."""
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(values[mid]):
            best, lo = values[mid], mid + 1
        else:
            hi = mid - 1
    return best


def _override(cfg: Config, dotted: str, value: Any) -> Config:
    """A copy of cfg with one (nested) key changed, e.g. 'data.generation.batch_size'."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return cfg.model_copy(update={head: value})
    return cfg.model_copy(update={head: _override(getattr(cfg, head), rest, value)})


def _knob(cfg: Config, role: str, est: Estimate, dims: TargetDims, layer_ids: list[int], kind: str,
          usable: int, single: bool) -> str:
    """What to change so that a role that does not fit does, with the largest value that fits where one does."""
    def largest(dotted: str, values: range) -> int | None:
        def fits(v: int) -> bool:
            return role_estimates(_override(cfg, dotted, v), dims, layer_ids, kind, single)[role][0].total <= usable

        return _largest_fitting(values, fits)

    if role == "trainer":
        fixed = est.phases["optimizer_step"]
        if fixed > usable:
            if single:
                return (f"the drafter's weights, gradients and AdamW states beside the target's weights need "
                        f"{fmt_bytes(fixed)}: split the roles over two or more processes")
            return (f"the drafter's weights, gradients and AdamW states alone need {fmt_bytes(fixed)}: "
                    "lower drafter.num_layers (or drafter.intermediate_size)")
        if est.parts["loss_working_set"] > est.parts["activations"]:
            best = largest("train.loss_chunk_rows", range(64, 65_537, 64))
            if best:
                return f"lower train.loss_chunk_rows (fits at <= {best:,})"
        best = largest("train.batch_tokens", range(16, cfg.train.batch_tokens + 1, 16))
        if best:
            return f"lower train.batch_tokens (fits at <= {best:,}; raise train.grad_accum to keep the tokens per step)"
        return "lower train.num_anchors (even the smallest train.batch_tokens does not fit)"
    weights = est.parts["target_weights"]
    if weights > usable:
        return (f"the target's weights alone need {fmt_bytes(weights)}: use a device with more memory "
                "(tensor parallelism is not supported)")
    if est.phases.get("regenerate", 0) > usable:
        best = largest("data.generation.batch_size", range(1, cfg.data.generation.batch_size + 1))
        if best:
            return f"lower data.generation.batch_size (fits at <= {best})"
        return "lower data.max_length (even one sequence's KV cache and prefill do not fit)"
    best = largest("extract.batch_tokens", range(16, cfg.extract.batch_tokens + 1, 16))
    return f"lower extract.batch_tokens (fits at <= {best:,})" if best else "lower data.max_length"


def memory_plan(cfg: Config, shape: TargetShape, layer_ids: list[int], kind: str, gpu_memory: int | None = None,
                per_machine: int = 1, single: bool = False) -> dict[str, Any]:
    """What `plan` prints under `memory`: each role's parts, total and whether it fits one device (`single`:
    one process holds both roles)."""
    dims = target_dims(shape)
    device, source = device_memory(cfg, kind, gpu_memory, per_machine)
    usable = int(device * USABLE_FRACTION)
    out: dict[str, Any] = {
        "device_bytes": device, "device_source": source, "usable_fraction": USABLE_FRACTION, "usable_bytes": usable,
        "assumptions": list(dims.assumed), "single_process": single,
    }
    for role, (est, batch) in role_estimates(cfg, dims, layer_ids, kind, single).items():
        fits = est.total <= usable
        out[role] = {
            "total_bytes": est.total, "fits": fits, "parts": est.parts, "phases": est.phases, "worst_batch": batch,
            "knob": None if fits else _knob(cfg, role, est, dims, layer_ids, kind, usable, single),
        }
    return out


def startup_check(cfg: Config, role: str, device_bytes: int) -> str | None:
    """`run`'s check on a GPU of `device_bytes` before any work: raises (naming the knob) when this role's
    estimate exceeds the whole device, returns a warning line when it exceeds the usable share, else None.
    `role` is extractor, trainer or single (one process holding both)."""
    from dflash_stream.target_model import resolve_layer_ids
    from dflash_stream.target_model.shape import target_shape

    shape = target_shape(cfg.target, download=True)
    single = role == "single"
    mem = memory_plan(cfg, shape, resolve_layer_ids(shape.num_layers, cfg.target), "gpu", device_bytes,
                      single=single)
    roles = ("extractor", "trainer") if single else (role,)
    for name in roles:
        r = mem[name]
        if r["total_bytes"] > device_bytes:
            raise DFlashError(f"the {name} needs an estimated {fmt_bytes(r['total_bytes'])} of GPU memory at its worst "
                              f"batch; the device has {fmt_bytes(device_bytes)}: {r['knob']}")
    tight = [f"the {name} needs an estimated {fmt_bytes(mem[name]['total_bytes'])}, over "
             f"{USABLE_FRACTION:.0%} of the device's {fmt_bytes(device_bytes)}: {mem[name]['knob']}"
             for name in roles if not mem[name]["fits"]]
    return "; ".join(tight) or None


