"""Recipes: a typed, strict, validated description of what is trained.

A recipe is YAML. ``base: other.yaml`` inherits from another recipe (path relative to the file, deep
merge, chains allowed, cycles are an error); trailing ``key.path=value`` arguments override any key.
Every field documents its unit here, and the README's recipe reference is generated from this file
(``python tools/recipe_reference.py``). Unknown keys are errors that suggest the closest valid key.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
import reprlib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pretrain.errors import ConfigError
from pretrain.recipe import recompute, safe_yaml


def positive_or_null(description: str, le: int | None = None):
    """A field that is null (meaning: a default stated in the description) or a positive number (at most ``le``)."""
    return Field(None, gt=0, le=le, description=description)


# Bounds no real run comes near, so that a well-typed but absurd number (GBS 2**62) is refused where it enters
# instead of overflowing an index or allocating for ever further on.
MAX_SEQUENCES = 2**24
"""Batch sizes (sequences): Llama 3 405B's largest batch was 4,096 sequences (16M tokens); this is 4,096 times it,
and a step's sample indices (int64, MAX_SEQUENCES x 8 B = 128 MiB) still fit any host."""
AUTO = "auto"
"""``batch.micro_batch_size: auto`` (resolved against the device: pretrain/plan/auto_batch.py)."""
MAX_SEQ_LEN = 2**24
"""data.seq_len (tokens): 16M, above every published training context (1M-10M); attention's cost grows with its
square."""
MAX_NUM_WORKERS = 1024
"""data.num_workers (processes per rank): more than the hardware threads of any one node."""


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors and a loaded recipe is immutable."""

    # allow_inf_nan=False: `.inf` / `.nan` in a recipe (optim.lr=.inf) is refused like any invalid number.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


# Config attributes named like a dropout that are not one of the causal LM's own (heads it does not use).
_NOT_MODEL_DROPOUT = ("classifier_dropout", "summary_first_dropout")


def is_dropout_attribute(name: str) -> bool:
    """Whether a transformers config attribute holds a dropout probability of the causal LM (attn_pdrop,
    attention_dropout, hidden_dropout, resid_pdrop, embd_pdrop, ...): ``model.dropout`` sets them all."""
    return ("dropout" in name or "pdrop" in name) and name not in _NOT_MODEL_DROPOUT


# Mixture-of-experts architectures pretrain builds through transformers' own models, and the name each
# config gives the number of experts. None of them has shared experts or a router z-loss in transformers.
MOE_ARCHS = {"olmoe": "num_experts", "qwen3_moe": "num_experts", "mixtral": "num_local_experts"}
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "router_aux_loss_coef", "output_router_logits", "decoder_sparse_step", "mlp_only_layers")


class MoEConfig(Section):
    """model.moe: the sparse MLP of olmoe, qwen3_moe and mixtral (every block's MLP is a set of experts)."""

    num_experts: int = Field(gt=1, description="Experts per MoE layer.")
    experts_per_token: int = Field(gt=0, description="Experts each token is routed to (top-k).")
    expert_intermediate_size: int = Field(
        gt=0, description="Hidden width of one expert's SwiGLU MLP (features); model.intermediate_size stays null."
    )
    router_aux_loss_coef: float = Field(
        0.01, ge=0,
        description="Weight of the router's load-balancing loss (Switch Transformer's, as transformers computes it "
        "per micro-batch over all layers) added to the training objective; 0 = none. OLMoE used 0.01, "
        "Qwen3-MoE and Mixtral 0.001.",
    )
    ep_size: int = Field(
        1, gt=0,
        description="Expert parallelism (FSDP2 launches): each group of ep_size consecutive ranks holds the experts "
        "split between them (num_experts / ep_size whole experts each) and sends every token to its experts' ranks "
        "by all-to-all; the dense part stays FSDP over all ranks, and the copies of an expert across groups are "
        "FSDP-sharded among themselves. Here, not in the accelerate config: accelerate's parallelism_config has no "
        "expert dimension. Must divide num_experts and the number of processes; 1 = no EP. docs/distributed.md: "
        "Expert parallelism.",
    )

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoEConfig:
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"model.moe.experts_per_token ({self.experts_per_token}) must be at most "
                             f"model.moe.num_experts ({self.num_experts})")
        if self.num_experts % self.ep_size:
            raise ValueError(f"model.moe.ep_size ({self.ep_size}) must divide model.moe.num_experts "
                             f"({self.num_experts}): every expert-parallel rank holds the same number of whole experts; "
                             f"use one of {', '.join(str(d) for d in range(1, self.num_experts + 1) if not self.num_experts % d)}")
        return self


class ModelConfig(Section):
    init_from: str | None = Field(
        None,
        description="Start from a pretrained transformers causal LM instead of random weights: a local directory "
        "written by save_pretrained (config.json + *.safetensors; a run's final_model/ is one), a pretrain checkpoint "
        "of any layout (runs/x/checkpoints/step_N: written once as a transformers model beside it, step_N.hf), or a "
        "Hugging Face hub id (e.g. Qwen/Qwen3-1.7B). Its config.json fixes the architecture and shape (the shape keys may be left out; "
        "one that differs is an error) and data.tokenizer defaults to its tokenizer. The optimizer, schedule and step "
        "start fresh; each rank reads only its share of the weights. A resumable output_dir wins (the run continues). "
        "docs/recipes.md: Continued pretraining.",
    )
    arch: str = Field(
        "llama",
        description="Architecture: a transformers `model_type` with a causal-LM head (`llama`, `gpt2`, "
        "`mistral`, `qwen2`, ...). Built with `from_config`: random init, no download.",
    )
    hidden_size: int = Field(256, gt=0, description="Model width d_model (features).")
    num_layers: int = Field(4, gt=0, description="Number of transformer blocks.")
    num_heads: int = Field(4, gt=0, description="Number of attention (query) heads.")
    num_kv_heads: int | None = positive_or_null(
        "Number of key/value heads (GQA); null = num_heads (multi-head attention)."
    )
    intermediate_size: int | None = positive_or_null(
        "MLP hidden width (features); null = the architecture's default (gpt2: 4 x hidden)."
    )
    head_dim: int | None = positive_or_null(
        "Width of one attention head (features); null = hidden_size / num_heads on every architecture (transformers' "
        "own qwen3 and gemma configs default to 128 and 256 whatever the width: set it to get those). "
        "Architectures whose heads are always hidden_size / num_heads (gpt2, gpt_neox, ...) refuse another value."
    )
    vocab_size: int | None = Field(
        None, gt=0, le=2**32,
        description="Embedding rows (tokens, at most 2**32: the token store's uint32); null = the tokenizer's "
        "vocabulary rounded up to a multiple of 64.",
    )
    max_position_embeddings: int | None = positive_or_null(
        "Longest sequence the positions support (tokens); null = data.seq_len."
    )
    rope_theta: float | None = positive_or_null("RoPE base; null = the architecture's default.")
    norm_eps: float | None = positive_or_null("Epsilon of the normalisation layers; null = default.")
    init_std: float = Field(0.02, gt=0, description="Standard deviation of the normal weight init.")
    dropout: float = Field(
        0.0, ge=0, lt=1,
        description="Probability of every dropout in the model: attention, residual / hidden and embedding dropout, "
        "under the names the architecture's config gives them (GPT-2's attn_pdrop, resid_pdrop, embd_pdrop; "
        "Llama's attention_dropout; GPT-NeoX's hidden_dropout, ...). 0 = none, the pretraining default for "
        "every architecture (transformers' GPT-2 config defaults to 0.1, meant for fine-tuning).",
    )
    tie_embeddings: bool = Field(False, description="Share the input embedding and LM-head weights.")
    activation_checkpointing: str = Field(
        "none",
        description="Which activations are recomputed in backward instead of kept: `none`; `full` (every block "
        "keeps only its input: the least memory, one more forward of the blocks, ~33% more compute); "
        "`every_N`, N >= 2 (blocks 0, N, 2N, ... as full, the rest keep everything: 1/N of full's recompute); "
        "`selective` (every block keeps its matmul and attention outputs and recomputes norms, activations "
        "and elementwise ops: no matmul recomputed). `true` / `false` mean full / none. README: Activation "
        "checkpointing.",
    )
    attention: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel: `sdpa` (PyTorch fused), `eager` (reference), `flash_attention_2`."
    )
    compile: Literal["auto", "none", "regional", "full"] = Field(
        "auto",
        description="torch.compile (inductor): `regional` compiles each transformer block (one compile, reused by "
        "every layer) and the embedding / final norm / LM head, in place (checkpoint keys unchanged); `full` the "
        "whole model as one graph (longer compile); `none` eager; `auto` = regional on CUDA, none on CPU "
        "(inductor on CPU compiles C++ for minutes and gains little). true = regional, false = none.",
    )
    loss: Literal["auto", "chunked", "plain", "liger"] = Field(
        "auto",
        description="The training loss's implementation (pretrain/model/loss.py), all the same causal-LM cross-entropy "
        "normalised by the global batch's target tokens: `chunked` (pretrain's own, no fp32 copy of the logits), "
        "`plain` (transformers' ForCausalLMLoss: fp32 logits, for comparison; no z-loss), `liger` (Liger-Kernel's "
        "fused linear cross-entropy: never materialises the logits; CUDA and `pip install liger-kernel`; with "
        "stability.z_loss its lse_square_scale, and train/loss then includes the z-loss, train/z_loss is not "
        "logged), `auto` = liger on CUDA when liger_kernel is installed and supports model.arch (not under "
        "ZeRO-3, nor with stability.z_loss), else chunked. The choice made is in run_config.json (loss/implementation).",
    )
    moe: MoEConfig | None = Field(
        None,
        description="Mixture of experts (required for model.arch olmoe, qwen3_moe and mixtral, refused for any other "
        "arch): experts, top-k, expert width, load-balancing weight. docs/recipes.md: Mixture of experts.",
    )
    config_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra attributes of the transformers config (e.g. `{hidden_act: silu}`); each must exist.",
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_policy(cls, value: Any) -> str:
        return recompute.normalize(value)

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_from_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # the field was a bool before it had modes
            return "regional" if value else "none"
        return value

    @field_validator("config_overrides")
    @classmethod
    def _no_dropout_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        named = sorted(key for key in overrides if is_dropout_attribute(key))
        if named:
            raise ValueError(f"config_overrides sets {', '.join(named)}: every dropout of the model is model.dropout "
                             "(one probability, mapped to each architecture's names); set model.dropout instead")
        return overrides

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        problems = []
        if self.hidden_size % self.num_heads:
            problems.append(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            problems.append(f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({kv})")
        problems += self._moe_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _moe_problems(self) -> list[str]:
        if self.arch in MOE_ARCHS and self.moe is None:
            return [f"model.arch = {self.arch} is a mixture of experts: add model.moe (num_experts, experts_per_token, "
                    "expert_intermediate_size)"]
        if self.arch not in MOE_ARCHS and self.moe is not None:
            return [f"model.moe is set but model.arch = {self.arch} is not one of the mixture-of-experts architectures "
                    f"pretrain builds ({', '.join(MOE_ARCHS)}); remove model.moe or choose one of those"]
        if self.moe is not None and self.intermediate_size is not None:
            return [f"model.intermediate_size = {self.intermediate_size} with model.arch = {self.arch}: an MoE's MLP "
                    "width is model.moe.expert_intermediate_size; set model.intermediate_size to null"]
        clashes = sorted(set(self.config_overrides) & set(MOE_CONFIG_KEYS)) if self.moe is not None else []
        if clashes:
            return [f"model.config_overrides sets {', '.join(clashes)}: model.moe owns them; set them there"]
        return []


# Architectures whose transformers model builds a block-causal mask from per-document position ids (and
# whose position encoding reads them): tests/data/test_document_masking.py checks each against its documents
# run one by one. Others are refused with data.document_masking rather than silently attending across.
DOCUMENT_MASKING_ARCHS = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")


SOURCE_DESCRIPTION = (
    "`stdlib` (built-in offline corpus: this Python's standard-library sources; `stdlib:DIR` only its "
    "package directory DIR, e.g. `stdlib:email`), a local file, directory or glob of .txt / .jsonl / .parquet "
    "files, or `hf:NAME` for a Hugging Face dataset."
)
FORMAT_DESCRIPTION = "Format of local files; `auto` decides by file extension."
TEXT_FIELD_DESCRIPTION = "Field holding the document text in jsonl / parquet / hf data."
HF_CONFIG_DESCRIPTION = "Configuration name of an `hf:` dataset."
HF_SPLIT_DESCRIPTION = "Split of an `hf:` dataset to read."
# The keys that say where one source's documents are: data.* for a single source, or each data.mixture entry.
SOURCE_KEYS = ("source", "format", "text_field", "hf_config", "hf_split")
MIXTURE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
WEIGHT_SUM_TOLERANCE = 1e-6


class MixtureSource(Section):
    """One source of a data mixture: its documents (the keys of a single-source data section) and weight."""

    name: str = Field(
        description="The source's name in metrics (`data/tokens/<name>`, `val/loss/<name>`) and in its store's "
        "directory under data.store: letters, digits, `_`, `-`, `.`; unique in the mixture."
    )
    source: str = Field(description="Where its documents are, as data.source: " + SOURCE_DESCRIPTION)
    weight: float = Field(
        description="Its share of every optimizer step's sequences (> 0); divided by the sum of the weights "
        "(data.normalize_weights=false: they must sum to 1)."
    )
    format: Literal["auto", "text", "jsonl", "parquet"] = Field("auto", description=FORMAT_DESCRIPTION)
    text_field: str = Field("text", description=TEXT_FIELD_DESCRIPTION)
    hf_config: str | None = Field(None, description=HF_CONFIG_DESCRIPTION)
    hf_split: str = Field("train", description=HF_SPLIT_DESCRIPTION)

    @model_validator(mode="after")
    def _name_and_weight(self) -> MixtureSource:
        if not MIXTURE_NAME.match(self.name):
            raise ValueError(f"source name {self.name!r} must be letters, digits, `_`, `-` or `.` (it names metrics "
                             "and a directory), starting with a letter or digit; e.g. `code` or `web-en`")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"source {self.name!r} has weight {self.weight}; every source needs a weight > 0 "
                             "(remove the source to leave it out)")
        return self


class DataConfig(Section):
    source: str = Field("stdlib", description=SOURCE_DESCRIPTION)
    format: Literal["auto", "text", "jsonl", "parquet"] = Field("auto", description=FORMAT_DESCRIPTION)
    text_field: str = Field("text", description=TEXT_FIELD_DESCRIPTION)
    hf_config: str | None = Field(None, description=HF_CONFIG_DESCRIPTION)
    hf_split: str = Field("train", description=HF_SPLIT_DESCRIPTION)
    mixture: list[MixtureSource] = Field(
        default_factory=list,
        description="Several weighted sources instead of data.source: a list of `{name, source, weight}` "
        "(+ `format`, `text_field`, `hf_config`, `hf_split`). Every optimizer step takes each source's share of "
        "its sequences; one token store per source, one tokenizer and seq_len for all. Empty = data.source.",
    )
    normalize_weights: bool = Field(
        True,
        description="Divide the mixture's weights by their sum; false: they must already sum to 1 (± 1e-6).",
    )
    on_exhausted: Literal["repeat", "stop"] = Field(
        "repeat",
        description="When the training stream (a mixture: any source) has been read once: `repeat` (its next "
        "epoch, in a new order; the epochs each source is read are logged) or `stop` (end the run there with a "
        "checkpoint and a message).",
    )
    tokenizer: str = Field(
        "bpe",
        description="`bpe` trains a byte-level BPE on the training corpus (cached); otherwise a local "
        "tokenizer directory / tokenizer.json or a Hugging Face tokenizer name.",
    )
    tokenizer_vocab_size: int = Field(
        8192, ge=256, le=2**32,
        description="Vocabulary size (tokens, 256 to 2**32: the token store's uint32) of a trained `bpe` tokenizer.",
    )
    tokenizer_train_bytes: int = Field(
        1_000_000_000,
        gt=0,
        description="A `bpe` tokenizer is trained on at most this many bytes of training documents: all of a "
        "corpus this small, else the first share of every input file (bytes).",
    )
    store: str | None = Field(
        None,
        description="Directory of the token store (written by `pretrain-prepare-data`, read by training); "
        "null = cache_dir/stores/<key of source, tokenizer, val_fraction>. A mixture: each source's store is "
        "the subdirectory <name>.",
    )
    store_shard_bytes: int = Field(
        512 * 2**20,
        gt=0,
        description="Input bytes per store shard: consecutive input files are grouped up to this size (a larger "
        "file is a shard of its own); the unit of parallel tokenization and of resume. 512 MiB: 15T tokens (~60 TB "
        "of text) make ~115,000 shards (9 files each on the metadata server; 64 MiB made 900,000), still dozens per "
        "worker of a 4,096-worker build, and a killed worker redoes at most one shard (~130M tokens, minutes). A "
        "corpus under workers x 512 MiB has fewer shards than workers: lower it to use them all.",
    )
    seq_len: int = Field(256, gt=0, le=MAX_SEQ_LEN,
                         description=f"Sequence length of a training sample (tokens, at most 2**24 = {MAX_SEQ_LEN:,}).")
    train_subset: int = Field(0, ge=0, description="Use only this many training sequences (of each source); 0 = all.")
    val_subset: int = Field(0, ge=0, description="Use only this many validation sequences (of each source); 0 = all.")
    exclude: list[str] = Field(
        default_factory=list,
        description="Quarantine lists whose documents' rows are left out of the training stream from step 0: paths "
        "to quarantine.json files, or run directories holding one (stability.rollback.skip: documents writes them; "
        "`pretrain-data quarantine` edits them). Documents of another store are ignored; a resume keeps what its "
        "checkpoint resolved.",
    )
    val_fraction: float = Field(
        0.05, gt=0, lt=1, description="Fraction of documents held out for validation (documents, not tokens)."
    )
    shuffle: bool = Field(True, description="Shuffle training sequences (a permutation per epoch from train.seed).")
    drop_last: bool = Field(
        True,
        description="Drop the samples left over at the end of an epoch that do not fill a global batch; "
        "false carries them into the next epoch's first batch. A single source only (a mixture's steps always "
        "mix sources, each source's epochs run on).",
    )
    num_workers: int = Field(0, ge=0, le=MAX_NUM_WORKERS,
                             description=f"DataLoader worker processes per rank (at most {MAX_NUM_WORKERS:,}).")
    prefetch_factor: int | None = positive_or_null("Batches prefetched per DataLoader worker (needs num_workers > 0).")
    num_proc: int | None = positive_or_null(
        "Processes that tokenize into the store (`pretrain-prepare-data --workers` overrides); "
        "null = min(CPU cores, 8)."
    )
    cache_dir: str | None = Field(
        None,
        description="Where tokenizers and tokenized data are cached; null = $PRETRAIN_CACHE_DIR or "
        "~/.cache/pretrain.",
    )
    document_masking: bool = Field(
        False,
        description="Tokens attend only within their own document of a packed sequence, with position ids "
        "restarting at 0 after each eos (block-causal attention, no cross-document context). The eos still "
        "predicts the next document's first token, so every position stays a target. Architectures: "
        + ", ".join(f"`{a}`" for a in DOCUMENT_MASKING_ARCHS) + "; any attention kernel (use "
        "`flash_attention_2` on GPUs: sdpa and eager build a MBS x s x s mask).",
    )
    on_decode_error: Literal["replace", "skip"] = Field(
        "replace",
        description="Text that is not UTF-8: `replace` bad bytes with U+FFFD or `skip` the document; "
        "either way the count is logged.",
    )

    @model_validator(mode="after")
    def _prefetch_needs_workers(self) -> DataConfig:
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError(
                f"data.prefetch_factor ({self.prefetch_factor}) needs data.num_workers > 0; "
                "set data.num_workers or remove data.prefetch_factor"
            )
        return self

    @model_validator(mode="after")
    def _mixture(self) -> DataConfig:
        if not self.mixture:
            return self
        names = [m.name for m in self.mixture]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.mixture names source {twice[0]!r} twice; give each source a unique name")
        total = math.fsum(m.weight for m in self.mixture)
        if not self.normalize_weights and abs(total - 1) > WEIGHT_SUM_TOLERANCE:
            terms = " + ".join(f"{m.name} {m.weight:g}" for m in self.mixture)
            raise ValueError(f"data.mixture weights sum to {total:g} ({terms}), not 1, with "
                             "data.normalize_weights=false; make them sum to 1 or set data.normalize_weights=true")
        defaults = DataConfig.model_fields
        single = [f"data.{k} = {getattr(self, k)!r}" for k in SOURCE_KEYS if getattr(self, k) != defaults[k].default]
        if single:
            raise ValueError(f"{', '.join(single)} is not used with data.mixture (each source gives its own "
                             f"{', '.join(SOURCE_KEYS)}); remove it")
        if not self.drop_last:
            raise ValueError("data.drop_last=false applies to a single source (a mixture's steps always mix "
                             "sources and each source's epochs run on); remove it")
        return self

    def mixture_weights(self) -> dict[str, float]:
        """Each source's share of a step's sequences (the weights divided by their sum); {} for one source."""
        total = math.fsum(m.weight for m in self.mixture)
        return {m.name: m.weight / total for m in self.mixture}

    def source_config(self, name: str) -> DataConfig:
        """This data section with the source keys of mixture source ``name`` (and no mixture): the single
        source whose store that source gets. Its store is the subdirectory ``name`` of data.store, if set."""
        entry = next(m for m in self.mixture if m.name == name)
        store = str(Path(self.store) / name) if self.store else None
        return self.model_copy(update={**{k: getattr(entry, k) for k in SOURCE_KEYS}, "mixture": [],
                                       "store": store})


class BatchConfig(Section):
    # Each at most MAX_SEQUENCES (2**24).
    global_batch_size: int | None = positive_or_null(
        "GBS: sequences per optimizer step across all processes (at most 2**24).", le=MAX_SEQUENCES)
    micro_batch_size: int | Literal["auto"] | None = Field(
        None, description="MBS: sequences per process per forward/backward (at most 2**24); auto: the largest power "
        "of two dividing a rank's share of the global batch whose memory estimate fits the device (the GPU, or a CPU "
        "process's share of the host's memory), chosen at launch and named in the run's first lines "
        "(pretrain/plan/auto_batch.py).")
    gradient_accumulation_steps: int | None = positive_or_null(
        "GAS: micro-batches per optimizer step; GBS = MBS x GAS x world (at most 2**24).", le=MAX_SEQUENCES
    )
    local_batch_size: int | None = positive_or_null(
        "Sequences per process per optimizer step with GAS = 1; GBS = world x local (at most 2**24).",
        le=MAX_SEQUENCES
    )
    sync_each_micro_batch: bool = Field(
        False,
        description="Reduce the gradients after every micro-batch instead of once per optimizer step (accelerate's "
        "GradientAccumulationPlugin(sync_each_batch=True): no no_sync). FSDP: the fp32 gradient shards accumulate "
        "(4 B x Ψ/N per GPU) instead of the unsharded gradients held through the GAS - 1 micro-steps before the last "
        "(4 B x Ψ under precision.reduce_dtype=fp32), for GAS reduce-scatters per step instead of one; pretrain-plan "
        "weighs both. DDP: GAS all-reduces instead of one, no memory saved. DeepSpeed reduces as its ZeRO stage "
        "does either way. Same training: the gradients are summed in another order only.",
    )

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _number_or_auto(cls, value: Any) -> Any:
        """One message for a bad value (a union would give one per member), with the value, as pydantic's own."""
        from pydantic_core import PydanticCustomError

        if value is None or value == AUTO:
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)  # pydantic's lax int, as for the other batch fields
        if isinstance(value, bool) or not isinstance(value, int):
            raise PydanticCustomError("int_or_auto", "Input should be a positive integer or auto")
        if value <= 0:
            raise PydanticCustomError("int_or_auto", "Input should be greater than 0 (or auto)")
        if value > MAX_SEQUENCES:
            raise PydanticCustomError("int_or_auto", f"Input should be less than or equal to {MAX_SEQUENCES} (or auto)")
        return value

    @model_validator(mode="after")
    def _one_way_to_say_it(self) -> BatchConfig:
        gbs, mbs, gas, lbs = (
            self.global_batch_size,
            self.micro_batch_size,
            self.gradient_accumulation_steps,
            self.local_batch_size,
        )
        if lbs is not None:
            if gbs is not None or mbs is not None or gas is not None:
                raise ValueError(
                    "batch.local_batch_size stands alone (GAS = 1, GBS = world x local); remove "
                    "global_batch_size / micro_batch_size / gradient_accumulation_steps, or remove local_batch_size"
                )
            return self
        if gbs is None:
            raise ValueError("give batch.global_batch_size with micro_batch_size or gradient_accumulation_steps, "
                             "or batch.local_batch_size alone")
        if (mbs is None) == (gas is None):
            raise ValueError(
                "give exactly one of batch.micro_batch_size and batch.gradient_accumulation_steps with "
                f"batch.global_batch_size (got micro_batch_size={mbs}, gradient_accumulation_steps={gas}); "
                "the other follows from GBS = MBS x GAS x world"
            )
        return self


class OptimConfig(Section):
    name: str = Field("AdamW", description="A torch.optim class name (AdamW, Adam, SGD, Adafactor, ...).")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate (after warm-up).")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay of the decayed parameter group.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Other keyword arguments of the optimizer class, passed through (e.g. `{betas: [0.9, 0.95], "
        "eps: 1.0e-8}`). On CUDA, optimizers with a fused kernel (Adam, AdamW, SGD, Adagrad) run fused unless "
        "this sets `fused` or `foreach`.",
    )
    grad_clip: float | None = Field(
        1.0, ge=0, description="Clip the global gradient L2 norm to this value; 0 or null = no clipping."
    )
    decay_embeddings: bool = Field(
        True, description="Apply weight decay to embedding matrices (norm weights and biases never decay)."
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none",
        description="Rescale lr when GBS differs from reference_global_batch_size: lr x (GBS/ref) or x sqrt(GBS/ref).",
    )
    reference_global_batch_size: int | None = positive_or_null(
        "The GBS that `lr` was tuned for (needed by lr_scaling)."
    )

    @model_validator(mode="after")
    def _scaling_needs_reference(self) -> OptimConfig:
        if self.lr_scaling != "none" and self.reference_global_batch_size is None:
            raise ValueError(
                f"optim.lr_scaling={self.lr_scaling} needs optim.reference_global_batch_size (the GBS lr was tuned for)"
            )
        reserved = {"params", "lr", "weight_decay"} & set(self.args)
        if reserved:
            raise ValueError(
                f"optim.args must not repeat {sorted(reserved)}: use optim.lr / optim.weight_decay instead"
            )
        return self


class LRScheduleConfig(Section):
    name: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine",
        description="`cosine` (to min_lr_ratio x lr), `linear` (to 0), `constant`, `wsd` (warmup-stable-decay).",
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up from 0 to lr.")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Final lr as a fraction of the peak (cosine and wsd)."
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd only: fraction of the optimizer steps spent in the final decay."
    )


class PrecisionConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Compute dtype; bf16/fp16 are mixed precision with fp32 master weights."
    )
    loss_scale: Literal["dynamic"] | float = Field(
        "dynamic", description="fp16 only: `dynamic` loss scaling or a fixed scale (> 0)."
    )
    initial_scale_power: int = Field(
        16, ge=0, le=64, description="fp16 dynamic scaling: the initial scale is 2**power (0 to 64)."
    )
    loss_scale_window: int = Field(1000, gt=0, description="fp16 dynamic scaling: steps without overflow before the scale grows.")
    hysteresis: int = Field(2, gt=0, description="fp16 dynamic scaling: overflows tolerated before the scale shrinks.")
    # Below 2**-24 (fp16's smallest subnormal) every scaled gradient under 1 underflows to zero; above 2**64 it is
    # beyond the largest initial scale (initial_scale_power <= 64), so the scale could never have reached it.
    min_loss_scale: float = Field(
        1.0, ge=2.0**-24, le=2.0**64,
        description="fp16 dynamic scaling: the scale never goes below this (2**-24 to 2**64).")
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16 only: dtype gradients are accumulated over micro-steps and reduced across ranks in. `fp32` "
        "(default) under every layout, as torchtitan and Megatron do. `bf16` halves the gradient communication volume "
        "(and the fp32 gradient buffers: ZeRO-1's full replicated one, 4 B/param) at a cost in accuracy: 0.5% "
        "relative error of the summed gradient at GAS 128 over 8 ranks, against 4e-8 in fp32 (README, Precision). "
        "DDP accumulates in fp32 either way (bf16 compresses its all-reduce only, with torch's bf16 hook: CUDA "
        "only). Required under DeepSpeed ZeRO-0, which cannot accumulate bf16 gradients in fp32. fp32 recipes "
        "reduce in fp32; fp16 recipes keep loss-scaled fp16 gradients.",
    )

    float8: Literal["off", "tensorwise", "rowwise"] = Field(
        "off",
        description="float8 training of the Linear layers (torchao's Float8Linear, pretrain/model/float8.py): `off`, "
        "`tensorwise` (one scale per tensor; under FSDP2 the weights are all-gathered in float8) or `rowwise` (one "
        "scale per row: closer to bf16, a little slower). Needs torchao (the `float8` extra) and a GPU of compute "
        "capability 8.9 or above (H100, L40S, RTX 4090); on CPU it is emulated, for tests only. precision.dtype "
        "stays the dtype of everything else (bf16 or fp32; not fp16). Not under DeepSpeed.",
    )
    float8_skip: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="float8 only: Linear layers left in precision.dtype, as module-name patterns (fnmatch; a pattern "
        "matches a module's full name or its last parts, so `lm_head` and `*.mlp.down_proj` both work). Linear layers "
        "whose dimensions are not multiples of 16 are left out too (torchao's float8 matmul cannot take them; the log "
        "counts them).",
    )

    @field_validator("float8", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @field_validator("loss_scale")
    @classmethod
    def _positive_scale(cls, value):
        if value != "dynamic" and value <= 0:
            raise ValueError(f"precision.loss_scale must be `dynamic` or a number > 0, got {value}")
        return value

    @model_validator(mode="after")
    def _float8_not_fp16(self) -> PrecisionConfig:
        if self.float8 != "off" and self.dtype == "fp16":
            raise ValueError(
                f"precision.float8={self.float8} cannot run with precision.dtype=fp16 (torchao's float8 training "
                "keeps its high-precision copies in bf16 or fp32 and has no loss scaling); set precision.dtype=bf16"
            )
        return self

    @model_validator(mode="after")
    def _reduce_needs_bf16(self) -> PrecisionConfig:
        if self.reduce_dtype == "bf16" and self.dtype != "bf16":
            raise ValueError(
                f"precision.reduce_dtype=bf16 applies to bf16 recipes only (precision.dtype={self.dtype}); "
                "remove it or set precision.dtype=bf16"
            )
        return self


class TrainConfig(Section):
    max_steps: int | None = positive_or_null("Training horizon in optimizer steps.")
    max_tokens: int | None = positive_or_null("Training horizon in tokens; steps = ceil(max_tokens / tokens per step).")
    seed: int = Field(1234, ge=0, le=2**32 - 1, description="Seed of weight init and data order (0 to 2**32 - 1: "
                      "numpy's seed range).")

    @model_validator(mode="after")
    def _one_horizon(self) -> TrainConfig:
        if (self.max_steps is None) == (self.max_tokens is None):
            raise ValueError(
                "give exactly one of train.max_steps and train.max_tokens "
                f"(got max_steps={self.max_steps}, max_tokens={self.max_tokens})"
            )
        return self


TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A downstream task's name: it becomes a metric key (eval/<name>/acc) and a tensorboard / wandb tag."""


class EvalTaskConfig(Section):
    """One downstream multiple-choice task (pretrain/train/downstream.py; docs/evaluation.md)."""

    name: str = Field(description="The task's name in the metric keys eval/<name>/acc and eval/<name>/acc_norm.")
    path: str = Field(
        description="A jsonl file, one example per line: {\"context\": str, \"choices\": [str, ...], \"gold\": int}. "
        "In a recipe file, relative to that file (as base: is); in a command-line override, to the current "
        "directory. Read and checked before any process starts."
    )
    every_steps: int | None = positive_or_null("Evaluate this task every N optimizer steps; null = eval.every_steps.")
    limit: int | None = positive_or_null("Evaluate only the first N examples of the file; null = all of them.")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not TASK_NAME.fullmatch(value):
            raise ValueError(f"task name {value!r} must be letters, digits, '_', '.' or '-' (it becomes the metric "
                             "key eval/<name>/acc), e.g. hellaswag")
        return value


class EvalConfig(Section):
    """Evaluation on the validation split (pretrain/train/evaluation.py): when, and on how much of it; and the
    downstream tasks (pretrain/train/downstream.py)."""

    every_steps: int = Field(0, ge=0, description="Evaluate every N optimizer steps; 0 = only at start and end.")
    batches: int = Field(
        0, ge=0, description="Validation global batches (GBS sequences each) per evaluation; 0 = as many as "
        "eval.tokens allows."
    )
    tokens: int = Field(
        10_485_760, ge=0,
        description="Validation tokens per evaluation when eval.batches is 0: whole global batches (at least one), "
        "the whole split if it is smaller. A budget, not a fraction: data.val_fraction of a 15T-token corpus is "
        "750B tokens. 10,485,760 = 2,560 rows of 4,096 tokens, what recipes/gpt2-124m.yaml evaluates. 0 = the "
        "whole validation split every time.",
    )
    at_start: bool = Field(True, description="Evaluate the untrained model at step 0 (logged like the others).")
    tasks: list[EvalTaskConfig] = Field(
        default_factory=list,
        description="Downstream multiple-choice tasks scored by log-likelihood (acc, acc_norm), at step 0 (at_start), "
        "every task's every_steps and after the last step: [{name, path, every_steps?, limit?}].",
    )

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, tasks: list[EvalTaskConfig]) -> list[EvalTaskConfig]:
        names = [task.name for task in tasks]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"task names {twice} appear more than once; give each task its own name")
        return tasks


class RollbackConfig(Section):
    """``stability.rollback``: what a run does instead of stopping after max_consecutive_skips (pretrain/train/stability.py)."""

    enabled: bool = Field(
        False,
        description="Instead of stopping after stability.max_consecutive_skips skips in a row: reload the newest "
        "verified checkpoint written before the first skip of the streak, skip the global batches from that "
        "checkpoint's step to the step that stopped the run (recorded in output_dir/rollbacks.jsonl and the "
        "checkpoints; a resume skips them too) and go on, in the same process.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Rollbacks to one checkpoint; one more stop there ends the run (exit 3) as without rollback. "
        "A rollback to a newer checkpoint counts afresh.",
    )
    lr_factor: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Multiplies the scheduled lr of the first lr_factor_steps updates after a rollback (1 = unchanged); "
        "overlapping windows multiply (a second rollback to one checkpoint: lr_factor squared).",
    )
    lr_factor_steps: int = Field(
        0, ge=0, description="Updates after a rollback whose lr is multiplied by lr_factor; 0 = none."
    )
    skip: Literal["window", "documents"] = Field(
        "window",
        description="What a rollback leaves out when it retrains from the checkpoint: `window`, every global batch "
        "from the checkpoint's step to the stop; `documents`, only the rows (packed sequences) holding a token of the "
        "num_quarantined documents with the highest loss per token on the window (scored by the reloaded model), "
        "from the window's start on, the freed slots filled by the next samples (output_dir/quarantine.json; "
        "refused under tensor or context parallelism). Either way every document of the window is scored "
        "(output_dir/rollback_scores/).",
    )
    num_quarantined: int = Field(
        3,
        ge=1,
        le=1000,
        description="How many of the window's top-ranked documents each rollback quarantines (skip: documents; "
        "skip: window quarantines none).",
    )


class StabilityConfig(Section):
    """What a run does about updates that would damage it (see pretrain/train/stability.py)."""

    skip_nonfinite: bool = Field(
        True,
        description="Skip the optimizer update (and the LR schedule's step) of an optimizer step whose loss or "
        "gradient norm is NaN or infinite; the weights stay as they were. fp16: a non-finite gradient norm is "
        "left to the loss scaler, which skips it and lowers the scale.",
    )
    spike_sigma: float | None = Field(
        6.0,
        gt=0,
        description="Also skip an update whose loss or gradient norm is more than this many standard deviations "
        "above the mean of the last window_steps updates (OLMo-core's skip-step rule); null = no spike rule.",
    )
    window_steps: int = Field(
        128,
        ge=2,
        description="Optimizer steps in the rolling window of losses and gradient norms (skipped steps are left "
        "out); the spike rule applies once the window is half full.",
    )
    max_consecutive_skips: int = Field(
        5,
        ge=0,
        description="Stop the run (exit 3, a message naming the step and the rule) after this many skipped updates "
        "in a row; its newest checkpoint holds the last healthy state. 0 = never stop.",
    )
    z_loss: float = Field(
        0.0,
        ge=0,
        description="Coefficient of the z-loss z x mean(logsumexp(logits)^2) added to the training loss (PaLM; "
        "1e-4 is common), logged as train/z_loss; train/loss and val/loss stay the cross-entropy. 0 = off.",
    )
    rollback: RollbackConfig = Field(default_factory=RollbackConfig)

    @property
    def checks_steps(self) -> bool:
        """Whether every optimizer step's loss and gradient norm are read (one device-to-host sync per step)."""
        return self.skip_nonfinite or self.spike_sigma is not None


class CheckpointConfig(Section):
    # `async` is a Python keyword: the field is async_, read and written (to_dict, checkpoints) as `async`.
    model_config = ConfigDict(**Section.model_config, serialize_by_alias=True)

    every_steps: int = Field(0, ge=0, description="Save every N optimizer steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=0, description="Keep the newest N checkpoints; 0 = keep all.")
    save_last: bool = Field(True, description="Also save a checkpoint after the last step (false: e.g. for sweeps).")
    resume: str = Field(
        "auto",
        description="`auto` (continue from output_dir's latest checkpoint if any), `none`, or a checkpoint directory.",
    )
    save_final_model: bool = Field(
        True, description="Export a transformers `save_pretrained` model and tokenizer to output_dir/final_model."
    )
    final_model_shard_size: str = Field(
        "5GB", description="The largest safetensors file of final_model (e.g. 5GB, 500MB): the ranks write its shards "
        "in parallel, each holding one shard at a time.",
    )
    async_: bool = Field(
        False, alias="async",
        description="Write checkpoints in the background: the loop waits only while the states are copied to host "
        "memory (one copy of this rank's checkpoint states); the files, checksums, manifest and `latest` follow in "
        "a thread, one save in flight at a time. Same files and guarantees as a synchronous save.",
    )


    @field_validator("final_model_shard_size")
    @classmethod
    def _a_size(cls, value: str) -> str:
        from huggingface_hub.serialization._base import parse_size_to_int

        try:
            if parse_size_to_int(value) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{value!r} is not a size; write it like 5GB or 500MB") from None
        return value


class LoggingConfig(Section):
    backends: list[Literal["jsonl", "wandb", "tensorboard"]] = Field(
        default_factory=lambda: ["jsonl"], description="Any of `jsonl` (output_dir/metrics.jsonl), `wandb`, `tensorboard`."
    )
    project: str = Field("pretrain", description="wandb project / tensorboard group name.")
    run_name: str | None = Field(None, description="Run name in the trackers; null = the recipe name.")
    progress: Literal["auto", "bar", "plain", "none"] = Field(
        "auto",
        description="Console output: `bar` (rich progress bar), `plain` (one line per log step, for log "
        "files), `auto` (bar on a terminal, plain otherwise), `none`.",
    )
    every_steps: int = Field(10, gt=0, description="Log metrics at step 1 and every N optimizer steps.")
    # The throughput and MFU settings change only what is logged (perf/*), never what is trained, so they live
    # with the rest of what is logged.
    peak_tflops: float | None = positive_or_null(
        "Peak dense TFLOP/s of one device in the training dtype, for MFU; null = the built-in table "
        "by GPU name (an unknown GPU gets no MFU), or measured at start-up on CPU."
    )
    throughput_warmup_steps: int = Field(
        1, ge=0, description="Optimizer steps after each start or resume left out of throughput and MFU (warm-up, compile)."
    )

    @field_validator("backends")
    @classmethod
    def _unique(cls, value):
        if len(set(value)) != len(value):
            raise ValueError(f"logging.backends lists a backend twice: {value}")
        return value


class ProfileConfig(Section):
    """torch.profiler through accelerate (``accelerate.utils.ProfileKwargs``): one Chrome trace per rank."""

    start_step: int = Field(
        0, ge=0, description="First optimizer step traced; 0 = no profiling. Traces go to output_dir/profile/."
    )
    num_steps: int = Field(2, gt=0, description="Optimizer steps traced from start_step on.")
    record_shapes: bool = Field(False, description="Record operator input shapes (larger traces).")
    profile_memory: bool = Field(False, description="Record tensor allocations and frees.")
    with_stack: bool = Field(False, description="Record the Python source line of each operator (larger traces).")


class StragglerConfig(Section):
    """A rank persistently slower than the others (pretrain/train/straggler.py)."""

    action: Literal["off", "warn", "exclude"] = Field(
        "warn", description="`warn`: name the slow rank and its host in the log and output_dir/stragglers.jsonl; "
        "`exclude`: also stop with a checkpoint and resubmit the pretrain-slurm job without that host (under SLURM; "
        "elsewhere it warns); `off`: neither.")
    factor: float = Field(
        1.5, gt=1, le=100, description="A logged step is slow when the slowest rank's own step time is at least this "
        "many times the median of the other ranks' (each rank's part before the gradient synchronisation).")
    window: int = Field(
        3, ge=1, le=10_000, description="Slow logged steps in a row, the slowest rank on the same host each time, "
        "before the action (the check runs on logging steps: logging.every_steps apart).")


class RuntimeConfig(Section):
    collective_timeout_s: float | None = Field(
        None, gt=0, le=30 * 86400,
        description="Timeout of the process group's collectives (seconds, at most 30 days); null = torch's default "
        "(10 min NCCL, 30 min gloo).",
    )
    hang_timeout_s: float | None = Field(
        None, ge=1, le=30 * 86400,  # under 1 s the watchdog would fire inside any real step
        description="Hang watchdog: if no optimizer step (with its evaluation and checkpoint) completes within this "
        "many seconds (1 s to 30 days), every rank writes its Python stacks to output_dir/hang/ and exits 1; null = no watchdog. Set it above "
        "the slowest step, evaluation or checkpoint save (and the first step's compilation)."
    )
    memory_snapshot_on_oom: bool = Field(
        False, description="CUDA only: record allocator history and dump output_dir/memory_snapshot_rank<R>.pickle "
        "(for pytorch.org/memory_viz) when a training step runs out of memory; ignored with a warning on CPU."
    )
    straggler: StragglerConfig = Field(default_factory=StragglerConfig,
                                       description="A rank persistently slower than the others: named, or excluded.")


class DeepSpeedSection(Section):
    """Used only when the accelerate config launches DeepSpeed; the ZeRO stage and offload come from there."""

    optimizer: Literal["auto", "torch", "deepspeed"] = Field(
        "auto",
        description="`torch`: the recipe's torch.optim optimizer as DeepSpeed's client optimizer (no JIT op build); "
        "`deepspeed`: DeepSpeed's fused / CPU Adam with the recipe's hyper-parameters; `auto`: deepspeed when the "
        "DeepSpeed JSON has an `optimizer` block, torch otherwise.",
    )
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None,
        description="dtype of gradient all-reduce / reduce-scatter; null = from the recipe (bf16 recipes: "
        "precision.reduce_dtype; otherwise DeepSpeed's default, the compute dtype). In a bf16 recipe a value "
        "other than precision.reduce_dtype is an error: precision.reduce_dtype is the one source of truth.",
    )
    prescale_gradients: bool = Field(False, description="Divide gradients by the world size before the all-reduce.")
    reduce_bucket_size: int | None = positive_or_null("ZeRO reduce bucket (elements); null = DeepSpeed's 5e8.")
    allgather_bucket_size: int | None = positive_or_null(
        "ZeRO-1/2 all-gather bucket (elements); null = DeepSpeed's 5e8."
    )
    overlap_comm: bool | None = Field(None, description="Overlap gradient reduction with backward; null = default.")
    contiguous_gradients: bool | None = Field(None, description="Copy gradients into a contiguous buffer; null = default.")
    stage3_prefetch_bucket_size: int | None = positive_or_null("ZeRO-3 parameter prefetch (elements).")
    stage3_param_persistence_threshold: int | None = Field(
        None, ge=0, description="ZeRO-3: parameters smaller than this (elements) stay unpartitioned."
    )
    stage3_max_live_parameters: int | None = positive_or_null("ZeRO-3: parameters resident at once (elements).")
    steps_per_print: int = Field(0, ge=0, description="DeepSpeed's own progress print every N steps; 0 = never.")
    wall_clock_breakdown: bool = Field(False, description="DeepSpeed's forward/backward/step timing breakdown.")
    dump_state: bool = Field(False, description="Print DeepSpeed's state after initialisation.")


class Recipe(Section):
    name: str | None = Field(None, description="Recipe name; null = the file name without .yaml.")
    description: str = Field("", description="Free text shown in --print-config.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    batch: BatchConfig
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    train: TrainConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    stability: StabilityConfig = Field(default_factory=StabilityConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig, description="Trace some optimizer steps.")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    output_dir: str | None = Field(None, description="Where the run writes; null = runs/<name> ($PRETRAIN_RUNS_DIR/<name> "
                                   "when that is set).")

    @model_validator(mode="after")
    def _document_masking_arch(self) -> Recipe:
        if self.data.document_masking and self.model.arch not in DOCUMENT_MASKING_ARCHS:
            raise ValueError(
                f"data.document_masking=true is not supported for model.arch = {self.model.arch!r} (verified: "
                f"{', '.join(DOCUMENT_MASKING_ARCHS)}); use one of those or set data.document_masking=false"
            )
        return self

    @model_validator(mode="after")
    def _one_reduce_dtype(self) -> Recipe:
        comm, prec = self.deepspeed.communication_data_type, self.precision
        if prec.dtype == "bf16" and comm is not None and comm != prec.reduce_dtype:
            raise ValueError(
                f"deepspeed.communication_data_type={comm} conflicts with precision.reduce_dtype={prec.reduce_dtype}: "
                "in a bf16 recipe precision.reduce_dtype decides the reduction dtype under every layout; remove "
                f"deepspeed.communication_data_type or set precision.reduce_dtype={comm}"
                + (" (fp16 reduction of bf16 gradients is not offered)" if comm == "fp16" else "")
            )
        return self

    @model_validator(mode="after")
    def _rollback_can_happen(self) -> Recipe:
        """stability.rollback acts where the rules would stop the run, from a periodic checkpoint: without either
        it would be accepted and never act."""
        stability = self.stability
        if not stability.rollback.enabled:
            return self
        missing = []
        if not stability.checks_steps:
            missing.append("no update is ever skipped (stability.skip_nonfinite=false and stability.spike_sigma=null)")
        if stability.max_consecutive_skips == 0:
            missing.append("the rules never stop the run (stability.max_consecutive_skips=0): set it, e.g. 5")
        if self.checkpoint.every_steps == 0:
            missing.append("no checkpoint is written before the end (checkpoint.every_steps=0): set it, e.g. 1000")
        if missing:
            raise ValueError(f"stability.rollback.enabled=true cannot act: {'; '.join(missing)}; or set "
                             "stability.rollback.enabled=false")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)



# --------------------------------------------------------------------------------------------------
# Loading: files, inheritance, overrides, and errors a user can act on.

# Keys that moved to another section: old dotted key -> new dotted key. The loader refuses an old key wherever it
# appears (a recipe file, a file it inherits through base:, an override, a dict given to build_recipe) with one
# message naming the new key: renaming it silently would leave recipes that read one way and mean another once a
# moved key's old name is reused. A recipe recorded by an older pretrain (a checkpoint's) is renamed through the
# same table (renamed_keys), since nobody edits those.
MOVED_KEYS = {
    "train.eval_every_steps": "eval.every_steps",
    "train.eval_batches": "eval.batches",
    "train.eval_at_start": "eval.at_start",
    "train.log_every_steps": "logging.every_steps",
    "runtime.peak_tflops": "logging.peak_tflops",
    "runtime.throughput_warmup_steps": "logging.throughput_warmup_steps",
    "runtime.profile": "profile",
}
MOVED_IN = "0.2"  # the first release whose recipes use the new keys


def _has_key(data: dict[str, Any], dotted: str) -> bool:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def moved_keys(data: dict[str, Any], where: str) -> list[str]:
    """One problem per old key in ``data`` (a recipe mapping), each naming its new key and ``where`` it was."""
    return [f"{old} moved to {new} in pretrain {MOVED_IN}: rename it in {where}"
            for old, new in MOVED_KEYS.items() if _has_key(data, old)]


def _moved_override(parts: list[str], value_text: str, item: str) -> str | None:
    """The problem of an override whose key is, or lies inside, an old key (runtime.profile.start_step=2)."""
    for old, new in MOVED_KEYS.items():
        old_parts = old.split(".")
        if parts[: len(old_parts)] == old_parts:
            renamed = ".".join([new, *parts[len(old_parts):]])
            return (f"{'.'.join(parts)} moved to {renamed} in pretrain {MOVED_IN}: rename it in the override "
                    f"{item!r} ({renamed}={value_text})")
    return None


def renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every old key of MOVED_KEYS moved to its new place: for recipes an older pretrain recorded
    (a checkpoint's trainer_state.json), never for what a user gives."""
    data = copy.deepcopy(data)
    for old, new in MOVED_KEYS.items():
        if not _has_key(data, old):
            continue
        *old_parents, old_leaf = old.split(".")
        node = data
        for part in old_parents:
            node = node[part]
        value = node.pop(old_leaf)
        *new_parents, new_leaf = new.split(".")
        node = data
        for part in new_parents:
            node = node.setdefault(part, {})
        node[new_leaf] = value
    return data



def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        hint = ""
        if path.parent.is_dir():
            near = difflib.get_close_matches(path.name, [p.name for p in path.parent.glob("*.yaml")], n=1)
            if near:
                hint = f" (did you mean {path.parent / near[0]}?)"
        raise ConfigError(f"recipe file not found: {path}{hint}; give the path of a recipe YAML, e.g. recipes/tiny.yaml")
    data = safe_yaml.read(path, "recipe")
    if data is None:
        raise ConfigError(f"recipe {path} is empty; a recipe needs at least batch: and train: (or base: another "
                          "recipe), e.g. recipes/tiny.yaml")
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a YAML mapping of sections, got a {type(data).__name__}")
    return data


def _anchor_task_paths(data: dict[str, Any], directory: Path) -> None:
    """A relative ``eval.tasks[].path`` in a recipe file is relative to that file (as ``base:`` is), so a shipped
    recipe finds its task from any directory; on the command line it stays relative to the current directory.
    Anything malformed is left for the schema to report."""
    section = data.get("eval")
    tasks = section.get("tasks") if isinstance(section, dict) else None
    for task in tasks if isinstance(tasks, list) else []:
        if isinstance(task, dict) and isinstance(task.get("path"), str) and not Path(task["path"]).is_absolute():
            task["path"] = str(directory / task["path"])


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Return base updated by override, merging nested mappings key by key (lists are replaced)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_recipe_dict(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a recipe file and everything it inherits through ``base:``, merged into one dict."""
    path = Path(path).resolve() if _chain else Path(path)
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise ConfigError(f"recipe inheritance cycle: {cycle}; remove one of these `base:` keys")
    data = _read_yaml(path)
    moved = moved_keys(data, str(path))
    if moved:
        raise ConfigError(moved)
    _anchor_task_paths(data, resolved.parent)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: `base` must be a file path (relative to the recipe), got {base!r}")
    base_path = (resolved.parent / base).resolve()
    if not base_path.is_file():
        near = difflib.get_close_matches(base_path.name, [p.name for p in base_path.parent.glob("*.yaml")], n=1) \
            if base_path.parent.is_dir() else []
        raise ConfigError(f"{path}: base: {base} names {base_path}, which does not exist"
                          + (f" (did you mean {base_path.parent / near[0]}?)" if near else "")
                          + "; `base` is a recipe file's path relative to the recipe that names it")
    parent = load_recipe_dict(base_path, (*_chain, resolved))
    parent.pop("name", None)  # a recipe's name is its own, never inherited
    return deep_merge(parent, data)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value (e.g. train.max_steps=40)")
    key, _, raw = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key; write it like optim.lr=1e-3")
    if not raw.strip():
        return parts, None
    # Text that is not YAML is the value itself (a path with a colon, say); valid YAML gets the recipe's refusals.
    return parts, safe_yaml.loads(raw, f"override {item!r}", or_text=True)


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    moved = [problem for item in overrides
             if (problem := _moved_override(parse_override(item)[0], item.partition("=")[2].strip(), item))]
    if moved:
        raise ConfigError(moved)
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section"
                )
            node = child
        node[parts[-1]] = value
    return data


def _field_names(model_cls: type[BaseModel], loc: tuple) -> list[str]:
    """Valid keys at the section named by loc (for 'did you mean' suggestions)."""
    cls = model_cls
    for part in loc:
        if isinstance(part, int):  # an item of a list of sections (eval.tasks.0)
            continue
        field = cls.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        cls = annotation
    return [f.alias or name for name, f in cls.model_fields.items()]


def _shown(value: Any, limit: int = 80) -> str:
    """A value for an error message: its repr, cut short (a wrong-typed section can be a large structure)."""
    text = reprlib.repr(value) if isinstance(value, (dict, list, tuple, set)) else repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def format_validation_error(exc: ValidationError, source: str, model_cls: type[BaseModel] = Recipe) -> ConfigError:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            valid = _field_names(model_cls, loc[:-1])
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            hint = f"did you mean '{'.'.join([*map(str, loc[:-1]), near[0]])}'?" if near else (
                f"valid keys here: {', '.join(valid)}" if valid else "remove it"
            )
            problems.append(f"unknown key '{key}': {hint}")
        elif err["type"] == "missing":
            problems.append(f"missing required key '{key}'")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "value_error":
                problems.append(msg if loc == () else f"{key}: {msg}")
            else:
                problems.append(f"{key} = {_shown(err.get('input'))}: {msg}")
    return ConfigError([f"{source}: {p}" for p in problems] if len(problems) > 1 else f"{source}: {problems[0]}")


RUNS_DIR_ENV = "PRETRAIN_RUNS_DIR"


def runs_root() -> Path:
    """Where runs go by default: ``runs/`` of the working directory, or ``$PRETRAIN_RUNS_DIR`` (a cluster's scratch
    filesystem; the test suite's own directory, never the checkout's runs/)."""
    return Path(os.environ.get(RUNS_DIR_ENV) or "runs")


def build_recipe(data: dict[str, Any], source: str = "recipe", default_name: str | None = None) -> Recipe:
    moved = moved_keys(data, source)
    if moved:
        raise ConfigError(moved)
    data = dict(data)
    if data.get("name") is None and default_name:
        data["name"] = default_name
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_from"), str) and model["init_from"]:
        from pretrain.recipe.init_from import resolve_recipe_dict

        data = resolve_recipe_dict(data)  # the checkpoint's shape and tokenizer, before the schema reads them
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(exc, source) from None
    if recipe.output_dir is None:
        from pretrain.trust import contained

        # the name comes from the recipe: "../x" or "/x" would put the run outside runs/
        default = contained(runs_root(), recipe.name, f"{source}: the recipe's name (the default output_dir is "
                            f"{runs_root()}/<name>)")
        recipe = recipe.model_copy(update={"output_dir": str(default)})
    from pretrain.trust import check_output_dir

    check_output_dir(recipe.output_dir)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load, inherit, override and validate a recipe. Raises ConfigError listing every problem."""
    data = apply_overrides(load_recipe_dict(path), overrides)
    return build_recipe(data, source=str(path), default_name=Path(path).stem)
