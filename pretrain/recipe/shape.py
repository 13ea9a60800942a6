"""The transformer's shape: vocabulary rounding, parameter counts, matmul shapes and FLOPs per token.

The one place these are computed. The model builder (``pretrain.model.build``), the trainer's MFU
(``pretrain.train.metrics``), the memory estimator (``pretrain.plan.memory``) and the planner (``pretrain-plan``) all
read a ``ModelShape``. It is built from a transformers config (the object ``pretrain.model.build.hf_config``
returns, or a ``config.json`` dict) by ``ModelShape.from_hf_config``; a recipe's ``model`` section takes
the same path, first written as the attributes transformers would give it (``model_attributes``), so
that ``pretrain-estimate`` and ``pretrain-plan`` need neither torch nor transformers (seconds of import
time; a test checks the estimator starts in well under two seconds).

FLOPs convention (the one ARCHITECTURE.md documents and every run logs as ``FlopsPerToken.convention``):

    model FLOPs per token = 6 x N + 12 x L x H x head_dim x seq_len

N is the number of weights that take part in a matmul: attention q/k/v/o, the MLP matrices and the LM
head (counted whether or not it is tied to the input embedding, because it is a real V x d matmul per
token). The input embedding and position tables are lookups, not matmuls, and are excluded. Biases and
norm weights are excluded too: they cost ~2 FLOPs per parameter per token instead of 6, are well under
1% of the total, and ``torch.utils.flop_counter.FlopCounterMode`` (the test's reference) does not count
them either. The 12 L H hd s term is QK^T and AV over the full s x s score matrix (forward 4 L H hd s,
backward twice that), as in PaLM's MFU definition; causal kernels that skip the masked half do not
lower it. ``model_flops`` is what MFU uses. ``hardware_flops`` adds what activation checkpointing
recomputes: a measure of how busy the device is, not of useful work. That is one more forward of every
decoder block (not of the LM head), less the block's last matmul, the MLP down projection, whose output
backward never needs: PyTorch's non-reentrant checkpoint stops recomputing once it has every tensor
backward saved (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default). A dropout or a
norm after the down projection (GPT-2's resid_pdrop, GPT-NeoX's hidden_dropout, OLMo-2's post-norm)
saves that output, and then it is recomputed too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pretrain.errors import ConfigError
from pretrain.recipe.recompute import checkpointed_blocks
from pretrain.recipe.recompute import normalize as normalize_policy
from pretrain.recipe.vocab import VOCAB_MULTIPLE, round_vocab  # noqa: F401 - read from here by the model and tests

if TYPE_CHECKING:
    from pretrain.recipe.config import DataConfig, ModelConfig, Recipe

# ---- Vocabulary -----------------------------------------------------------------------------------

# The chunked loss (pretrain/model/loss.py) upcasts this many logits at a time: x 4 B = 256 MiB of fp32, large
# enough that the per-chunk launches do not matter. Here, not in loss.py, because the estimator reads it
# without importing torch.
LOSS_CHUNK_ELEMENTS = 2**26


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the chunked loss."""
    return max(1, LOSS_CHUNK_ELEMENTS // vocab_size)


def liger_chunk_tokens(num_tokens: int, vocab_size: int, hidden_size: int) -> int:
    """Tokens per chunk of Liger-Kernel's fused linear cross-entropy for a micro-batch of ``num_tokens``: its
    ``fused_linear_cross_entropy_forward`` (liger-kernel 0.8.5, ``chunk_mem_const`` 1) bounds a chunk's logits
    to about the hidden states' size: next_power_of_2(ceil(T / ceil(V / H))), at most T."""
    inc_factor = -(-vocab_size // hidden_size)
    per_chunk = -(-num_tokens // inc_factor)
    return min(1 << (per_chunk - 1).bit_length(), num_tokens)


def resolve_vocab_size(model_cfg: ModelConfig, tokenizer_vocab_size: int | None) -> int:
    """Embedding rows: ``model.vocab_size`` if set, else the tokenizer's vocabulary rounded up to a
    multiple of 64 (GPT-2's 50257 -> 50304); the padding rows are never targets."""
    if model_cfg.vocab_size is not None:
        if tokenizer_vocab_size is not None and model_cfg.vocab_size < tokenizer_vocab_size and model_cfg.init_from:
            raise ConfigError(
                f"model.init_from = {model_cfg.init_from}: its embedding has {model_cfg.vocab_size} rows, fewer than the "
                f"tokenizer's vocabulary ({tokenizer_vocab_size}): token ids past the embedding would crash; use the "
                "checkpoint's own tokenizer (leave data.tokenizer out) or one whose vocabulary fits"
            )
        if tokenizer_vocab_size is not None and model_cfg.vocab_size < tokenizer_vocab_size:
            raise ConfigError(
                f"model.vocab_size ({model_cfg.vocab_size}) is smaller than the tokenizer's vocabulary "
                f"({tokenizer_vocab_size}): token ids past the embedding would crash; set model.vocab_size to "
                f"at least {tokenizer_vocab_size}, or null to use {round_vocab(tokenizer_vocab_size)}"
            )
        return model_cfg.vocab_size
    if tokenizer_vocab_size is None:
        raise ConfigError(
            "model.vocab_size is null and there is no tokenizer to take the vocabulary size from; "
            "set model.vocab_size (embedding rows)"
        )
    return round_vocab(tokenizer_vocab_size)


def recipe_vocab_size(model_cfg: ModelConfig, data_cfg: DataConfig) -> int:
    """Embedding rows without loading a tokenizer (the estimator and the planner): ``model.vocab_size``, or
    the size a ``bpe`` tokenizer will be trained to, or a local tokenizer.json's vocabulary
    (``pretrain.recipe.vocab``), rounded up like ``resolve_vocab_size`` does."""
    if model_cfg.vocab_size is None and data_cfg.tokenizer != "bpe":
        from pretrain.recipe.vocab import tokenizer_file_vocab_size

        num_tokens = tokenizer_file_vocab_size(data_cfg.tokenizer)
        if num_tokens is None:
            raise ConfigError(
                f"model.vocab_size is null and the tokenizer ({data_cfg.tokenizer}) is not on this machine (no "
                "local tokenizer.json, not in the Hugging Face cache); run pretrain-prepare-data once (it downloads "
                "it), or pass model.vocab_size=N (the embedding rows) as an override"
            )
        return resolve_vocab_size(model_cfg, num_tokens)
    return resolve_vocab_size(model_cfg, data_cfg.tokenizer_vocab_size if model_cfg.vocab_size is None else None)


# ---- Architectures --------------------------------------------------------------------------------

# The model_types whose matmul shapes are known, each checked against FlopCounterMode in
# tests/train/test_metrics.py (phi3 by hand: its tiny test configs need a 32k vocabulary). Gated MLPs (SwiGLU /
# GeGLU) have three d x f matrices (phi3 fuses gate and up into one d x 2f, the same count), with
# separate q/k/v projections that grouped-query attention narrows; plain MLPs have two, and a fused
# d x 3d qkv projection (no GQA).
MOE_ARCHS = ("olmoe", "qwen3_moe", "mixtral")
"""Mixture of experts: every block's MLP is ``num_experts`` SwiGLU experts of which a router picks top-k."""
GATED_MLP_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "olmo2", "phi3", *MOE_ARCHS)
PLAIN_MLP_ARCHS = ("gpt2", "gpt_neox")
MATMUL_ARCHS = (*GATED_MLP_ARCHS, *PLAIN_MLP_ARCHS)
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
COUNTED_ARCHS = (*LLAMA_FAMILY, "qwen3", "gemma", "olmo", "olmo2", "phi3", "gpt2", "gpt_neox", *MOE_ARCHS)
"""Every parameter tensor is known (not only the matmuls): parameter counts, the memory estimator, and a
recipe's section read without transformers (``model_attributes`` mirrors their defaults only). Each is
checked against the meta-built model in tests/model/test_model.py; any other architecture's shape facts are
measured from the model itself (``pretrain.model.measure``)."""

# the config attributes model.dropout sets (build.dropout_attributes finds them in transformers' config)
_DROPOUT_NAMES = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop"),
                  "gpt_neox": ("attention_dropout", "hidden_dropout"),
                  "phi3": ("attention_dropout", "resid_pdrop", "embd_pdrop")}  # fmt: skip
# transformers' MLP activation where it is not SiLU (the estimator's activation bytes depend on it)
_DEFAULT_HIDDEN_ACT = {"gpt2": "gelu_new", "gemma": "gelu_pytorch_tanh", "gpt_neox": "gelu"}
# transformers' attention_bias default where it is not False: GPT-NeoX's q/k/v and output projections
_DEFAULT_ATTENTION_BIAS = {"gpt_neox": True}

# GPT-2's config names the common attributes its own way (GPT2Config.attribute_map); an override or a
# config.json may use either name, and transformers stores the value under GPT-2's.
_GPT2_NAMES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
               "max_position_embeddings": "n_positions"}  # fmt: skip


def model_attributes(model_cfg: ModelConfig, vocab_size: int, seq_len: int) -> dict[str, Any]:
    """A recipe's ``model`` section as the transformers config attributes the shape reads (GPT-2's own names
    for GPT-2), with ``config_overrides`` applied last, as ``pretrain.model.build.hf_config`` applies them.

    Mirrors ``hf_config`` for the architectures in ``COUNTED_ARCHS`` without importing transformers; the
    test suite checks the two give the same parameter count on every shipped recipe.
    """
    arch = model_cfg.arch
    if model_cfg.init_from is not None and arch in COUNTED_ARCHS:
        from pretrain.recipe.init_from import model_attributes as pretrained_attributes

        dropouts = _DROPOUT_NAMES.get(arch, ("attention_dropout",))
        attributes = pretrained_attributes(model_cfg.init_from, vocab_size, list(dropouts), model_cfg.dropout,
                                           model_cfg.config_overrides)
        if attributes is not None:
            return attributes
    if arch not in COUNTED_ARCHS:
        raise ConfigError(
            f"model.arch = {arch!r}: the memory estimator and the planner have formulas for {', '.join(COUNTED_ARCHS)} "
            "(other architectures get measured parameters and FLOPs per token, so MFU, but no memory estimate yet)"
        )
    over = model_cfg.config_overrides
    if arch != "gpt2" and model_cfg.moe is None and model_cfg.intermediate_size is None and "intermediate_size" not in over:
        raise ConfigError(f"model.intermediate_size is required for arch {arch} (the MLP width)")
    names = _GPT2_NAMES if arch == "gpt2" else {}
    attributes = {
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": model_cfg.hidden_size,
        "num_hidden_layers": model_cfg.num_layers,
        "num_attention_heads": model_cfg.num_heads,
        "max_position_embeddings": model_cfg.max_position_embeddings or seq_len,
        "tie_word_embeddings": model_cfg.tie_embeddings,
    }
    if arch == "gpt2":
        attributes["n_inner"] = model_cfg.intermediate_size  # null: 4 x hidden
    else:
        attributes["intermediate_size"] = model_cfg.intermediate_size
    if arch not in PLAIN_MLP_ARCHS:
        attributes["num_key_value_heads"] = model_cfg.num_kv_heads or model_cfg.num_heads
    if arch not in PLAIN_MLP_ARCHS:
        # null: hidden_size / num_heads on every architecture, as build.hf_config sets it (which refuses a
        # head_dim the arch's config cannot hold)
        attributes["head_dim"] = model_cfg.head_dim or model_cfg.hidden_size // model_cfg.num_heads
    attributes.update(dict.fromkeys(_DROPOUT_NAMES.get(arch, ("attention_dropout",)), model_cfg.dropout))
    if model_cfg.moe is not None:
        attributes.update(moe_attributes(model_cfg))
    attributes.update(over)
    return {names.get(key, key): value for key, value in attributes.items()}


def moe_attributes(model_cfg: ModelConfig) -> dict[str, Any]:
    """``model.moe`` as the attributes of the arch's transformers config (``pretrain.model.build.hf_config``
    applies them too). Every block is sparse: qwen3_moe's dense layers (mlp_only_layers, decoder_sparse_step)
    are off, and its unused dense width follows the experts'. ``output_router_logits`` stays off in the
    config: the trainer asks for the router logits in its training forward only, so evaluation's loss is the
    cross-entropy alone and an exported model generates without them."""
    moe, arch = model_cfg.moe, model_cfg.arch
    attributes = {
        "num_local_experts" if arch == "mixtral" else "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "intermediate_size": moe.expert_intermediate_size,
        "router_aux_loss_coef": moe.router_aux_loss_coef,
        "output_router_logits": False,
    }
    if arch == "qwen3_moe":
        attributes.update(moe_intermediate_size=moe.expert_intermediate_size, decoder_sparse_step=1,
                          mlp_only_layers=[])
    return attributes


def require_counted(arch: str) -> None:
    """Parameter counts need every tensor of the architecture, not only its matmuls."""
    if arch not in COUNTED_ARCHS:
        raise ConfigError(f"no parameter-count formula for model.arch = {arch}; formulas exist for "
                          f"{', '.join(COUNTED_ARCHS)}")


def _reader(config: Any) -> Callable[[str], Any]:
    """name -> value (None when absent) of a transformers config object or a config.json dict."""
    if isinstance(config, Mapping):
        return config.get
    return lambda name: getattr(config, name, None)


# ---- The shape ------------------------------------------------------------------------------------


# data.document_masking keeps this dense count: attention within documents does less work (per row,
# sum of doc_len^2 instead of seq_len^2 scores; flash_attention_2 skips the rest, sdpa and eager compute and
# mask them), but MFU counts the full seq_len, as Megatron-LM and most published MFU figures do, so that it
# stays comparable across runs, corpora and code bases.
CONVENTION = (
    "model FLOPs/token = 6 x N + 12 x L x H x head_dim x seq_len; N = matmul weights (attention, MLP, "
    "LM head whether tied or not; no embedding lookup, position table, bias or norm); attention counted "
    "over the full seq_len x seq_len scores; training = forward + backward = 3 x forward; mixture of experts: N "
    "counts the router and the top-k experts a token is routed to (active parameters), not all experts"
)


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs (forward + backward) per token of one sequence of ``seq_len`` tokens."""

    model_flops: float
    """6 N + 12 L H hd s: the work the model needs; MFU's numerator."""
    hardware_flops: float
    """model_flops plus the forward that activation checkpointing recomputes (equal without it)."""
    num_params_non_embedding: int
    """N: weights of every matmul, LM head included (tied or not); no embeddings, biases or norms."""
    convention: str = field(default=CONVENTION, compare=False)
    """How the figures were found (the closed form's formula, or measured): the same FLOPs compare equal."""


@dataclass(frozen=True)
class ModelShape:
    """Everything the arithmetic needs about the architecture (transformers' defaults filled in)."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    tie_embeddings: bool
    hidden_act: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    resid_dropout: float = 0.0
    """Dropout after the block's output projections (GPT-2's resid_pdrop, GPT-NeoX's hidden_dropout)."""
    embd_dropout: float = 0.0
    attn_dropout: float = 0.0
    num_experts: int = 0
    """MoE: experts per block (0: a dense MLP); ``intermediate_size`` is then one expert's width."""
    experts_per_token: int = 0
    """MoE: the router's top-k."""

    # ---- construction

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "the model config") -> ModelShape:
        """From a transformers config: the object ``pretrain.model.build.hf_config`` builds, or a ``config.json``
        dict (transformers' defaults filled in where the dict leaves an attribute out)."""
        get = _reader(config)
        arch = get("model_type")
        if arch not in MATMUL_ARCHS:
            raise ConfigError(
                f"{source}: model_type = {arch!r}; pretrain has shape formulas for {', '.join(MATMUL_ARCHS)}"
            )

        def first(*names: str, default: Any = None) -> Any:
            return next((get(name) for name in names if get(name) is not None), default)

        def need(*names: str) -> Any:
            value = first(*names)
            if value is None:
                raise ConfigError(f"{source}: missing {' / '.join(names)}")
            return value

        gpt2, plain = arch == "gpt2", arch in PLAIN_MLP_ARCHS

        def aliases(attribute: str) -> tuple[str, ...]:  # GPT-2's own name first, as transformers stores it
            return (_GPT2_NAMES[attribute], attribute) if gpt2 else (attribute,)

        d, heads = need(*aliases("hidden_size")), need(*aliases("num_attention_heads"))
        attention_bias = bool(first("attention_bias", default=_DEFAULT_ATTENTION_BIAS.get(arch, False)))
        moe = arch in MOE_ARCHS
        if arch == "qwen3_moe" and (first("mlp_only_layers", default=[]) or first("decoder_sparse_step", default=1) != 1):
            raise ConfigError(f"{source}: qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step > 1) has "
                              "no shape formula; pretrain builds every block sparse")
        return cls(
            arch=arch,
            vocab_size=need("vocab_size"),
            hidden_size=d,
            num_layers=need(*aliases("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=heads if plain else first("num_key_value_heads", default=heads),
            head_dim=d // heads if plain else first("head_dim", default=d // heads),
            intermediate_size=(first("n_inner" if gpt2 else "intermediate_size", default=4 * d) if plain
                               else need("moe_intermediate_size") if arch == "qwen3_moe"
                               else need("intermediate_size")),
            max_positions=(need(*aliases("max_position_embeddings")) if gpt2
                           else first("max_position_embeddings", default=0)),
            tie_embeddings=first("tie_word_embeddings", default=gpt2),
            hidden_act=first("activation_function" if gpt2 else "hidden_act", default=_DEFAULT_HIDDEN_ACT.get(arch, "silu")),
            qkv_bias=gpt2 or attention_bias or arch == "qwen2",  # qwen2's q/k/v projections always have biases
            o_bias=gpt2 or attention_bias,
            mlp_bias=plain or bool(first("mlp_bias", default=False)),  # GPT-NeoX's MLP has biases too
            resid_dropout=first("hidden_dropout" if arch == "gpt_neox" else "resid_pdrop", default=0.1 if gpt2 else 0.0),
            embd_dropout=first("embd_pdrop", default=0.1 if gpt2 else 0.0),
            attn_dropout=first("attn_pdrop" if gpt2 else "attention_dropout", default=0.1 if gpt2 else 0.0),
            num_experts=need("num_local_experts", "num_experts") if moe else 0,
            experts_per_token=need("num_experts_per_tok") if moe else 0,
        )

    @classmethod
    def from_model_config(cls, model_cfg: ModelConfig, vocab_size: int, seq_len: int) -> ModelShape:
        """From the recipe's ``model`` section, with transformers' defaults for what it leaves null."""
        return cls.from_hf_config(model_attributes(model_cfg, vocab_size, seq_len), source="model")

    @classmethod
    def from_recipe(cls, recipe: Recipe, seq_len: int | None = None) -> ModelShape:
        """A recipe's model, its vocabulary taken without a tokenizer (``recipe_vocab_size``)."""
        return cls.from_model_config(recipe.model, recipe_vocab_size(recipe.model, recipe.data),
                                     seq_len or recipe.data.seq_len)

    # ---- matmuls

    @property
    def family(self) -> str:
        """gpt2 or llama: the block layout the estimator's activation formulas follow (GPT-NeoX's LayerNorms,
        fused qkv and plain MLP are GPT-2's; its rotary positions are Llama's, a small term left out)."""
        return "gpt2" if self.arch in PLAIN_MLP_ARCHS else "llama"

    @property
    def gated_mlp(self) -> bool:
        return self.arch in GATED_MLP_ARCHS

    def block_matmuls(self) -> tuple[list[int], list[int]]:
        """(attention, MLP) weight-matrix element counts of one block that one token passes through, in module
        order; the MLP's last is the down projection. MoE: the router (d x E), then top-k experts' gate, up
        and down (the active weights: FLOPs and MFU count these)."""
        d, f = self.hidden_size, self.intermediate_size
        if self.gated_mlp:  # q, k, v, o (GQA shrinks k and v only); gate, up, down
            q, k = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            if self.num_experts:
                top_k = self.experts_per_token
                return [d * q, d * k, d * k, q * d], [d * self.num_experts, top_k * d * f, top_k * d * f, top_k * f * d]
            return [d * q, d * k, d * k, q * d], [d * f, d * f, f * d]
        return [3 * d * d, d * d], [d * f, f * d]  # fused qkv (d x 3d), output (d x d); fc, proj

    @property
    def matmul_params(self) -> int:
        """N of the FLOPs convention: every block's matmul weights and the LM head (tied or not)."""
        attention, mlp = self.block_matmuls()
        return self.num_layers * sum(attention + mlp) + self.vocab_size * self.hidden_size

    def flops_per_token(self, seq_len: int, activation_checkpointing: str = "none") -> FlopsPerToken:
        """Training FLOPs per token (the module docstring's convention).

        ``activation_checkpointing`` is the policy (pretrain/recipe/recompute.py); only ``hardware_flops``
        changes. A checkpointed block runs its forward again in backward up to the last tensor backward needs
        (non-reentrant checkpointing stops there: the down projection's output is not needed, so it is not
        recomputed): full does that for every block, every_N for blocks 0, N, 2N, ... Selective keeps every
        matmul's and the attention kernel's output, so it recomputes no matmul FLOPs (only norms, activations
        and elementwise ops, which the convention does not count).
        """
        attention, mlp = self.block_matmuls()
        block = sum(attention + mlp)
        attention_forward = 4 * self.num_heads * self.head_dim * seq_len  # QK^T and AV of one block, per token
        model = 6 * self.matmul_params + 3 * self.num_layers * attention_forward
        policy = normalize_policy(activation_checkpointing)
        recomputed = 0
        if policy != "selective":
            # OLMo-2's post-feedforward norm, or a dropout after the down projection, saves its output
            down_proj_recomputed = self.arch == "olmo2" or self.resid_dropout > 0
            recomputed_params = block - (0 if down_proj_recomputed else mlp[-1])
            recomputed = checkpointed_blocks(policy, self.num_layers) * (2 * recomputed_params + attention_forward)
        return FlopsPerToken(float(model), float(model + recomputed), self.matmul_params)

    # ---- parameters

    def block_param_sizes(self) -> list[int]:
        """Element counts of one transformer block's parameter tensors, in module order.

        llama, mistral, qwen2, gemma (gated MLP, RMSNorm): d q + 2 d k + q d + 3 d f + 2 d, q = heads x
        head_dim, k = kv_heads x head_dim, + biases: q/k/v (q + 2 k: qwen2, attention_bias), o_proj (d:
        attention_bias), MLP (2 f + d: mlp_bias). qwen3 adds RMSNorms of one head on q and k (2 head_dim);
        olmo has no norm weights (non-parametric LayerNorm); olmo2 has q and k norms over all heads (q + k)
        and its two norms after attention and MLP instead of before; phi3 fuses q/k/v (d x (q + 2 k)) and
        gate/up (d x 2 f) into one matrix each.
        gpt2 (every matrix has a bias, LayerNorms have weight and bias):
        2 x 2 d + (3 d^2 + 3 d) + (d^2 + d) + (d f + f) + (f d + d); gpt_neox the same (its q/k/v and output
        biases only with attention_bias, its default).
        """
        require_counted(self.arch)
        d, f = self.hidden_size, self.intermediate_size
        attention, mlp = self.block_matmuls()
        if self.family == "gpt2":
            (qkv, proj), (fc, out) = attention, mlp
            if self.arch == "gpt_neox" and not self.qkv_bias:
                return [d, d, d, d, qkv, proj, fc, f, out, d]
            return [d, d, qkv, 3 * d, proj, d, d, d, fc, f, out, d]
        q, k = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.num_experts:  # the router, then every expert's fused gate_up (E x 2f x d) and down (E x d x f)
            E = self.num_experts
            sizes = [d, *attention, d, d * E, E * 2 * f * d, E * d * f]
            if self.arch == "olmoe":  # q_norm and k_norm over the whole projection
                sizes += [q, k]
            elif self.arch == "qwen3_moe":  # q_norm and k_norm per head
                sizes += [self.head_dim, self.head_dim]
            return sizes
        if self.arch == "olmo":
            sizes = [*attention, *mlp]
        elif self.arch == "olmo2":
            sizes = [*attention, q, k, d, *mlp, d]
        elif self.arch == "phi3":
            sizes = [d, sum(attention[:3]), attention[3], d, sum(mlp[:2]), mlp[2]]
        else:
            sizes = [d, *attention, d, *mlp]
        if self.arch == "qwen3":
            sizes += [self.head_dim, self.head_dim]
        if self.qkv_bias:
            sizes += [q, k, k]
        if self.o_bias:
            sizes.append(d)
        if self.mlp_bias:
            sizes += [f, f, d]
        return sizes

    def param_sizes(self) -> list[int]:
        """Element counts of every parameter tensor (a tied LM head counts once): embeddings V d (+ GPT-2's
        positions P d), the blocks, the final norm (GPT-2's LayerNorm has a bias too), the LM head V d."""
        V, d = self.vocab_size, self.hidden_size
        sizes = [V * d]
        if self.arch == "gpt2":
            sizes.append(self.max_positions * d)
        sizes += self.block_param_sizes() * self.num_layers
        sizes += [d, d] if self.family == "gpt2" else [] if self.arch == "olmo" else [d]
        if not self.tie_embeddings:
            sizes.append(V * d)
        return sizes

    @property
    def num_params(self) -> int:
        return sum(self.param_sizes())

    @property
    def block_params(self) -> int:
        return sum(self.block_param_sizes())

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: all of them but the experts the router does not pick (MoE), so
        shared parameters + top-k experts; ``num_params`` for a dense model."""
        inactive = (self.num_experts - self.experts_per_token) * 3 * self.hidden_size * self.intermediate_size
        return self.num_params - self.num_layers * inactive

    def formula(self) -> str:
        V, d, L, f = self.vocab_size, self.hidden_size, self.num_layers, self.intermediate_size
        head = "" if self.tie_embeddings else f" + LM head {V:,} x {d:,}"
        if self.num_experts:
            return (
                f"embeddings {V:,} x {d:,} + {L} blocks x {self.block_params:,} (attention, router {d:,} x "
                f"{self.num_experts}, {self.num_experts} SwiGLU experts 3 x {d:,} x {f:,}, top-{self.experts_per_token} "
                f"active, norms) + final RMSNorm{head}"
            )
        if self.family == "gpt2":
            positions = f" + positions {self.max_positions:,} x {d:,}" if self.arch == "gpt2" else ""
            return (
                f"embeddings {V:,} x {d:,}{positions} + {L} blocks x "
                f"{self.block_params:,} (qkv, proj, MLP {d:,} -> {f:,}, 2 LayerNorms, biases) + final LayerNorm{head}"
            )
        norms = {"olmo": "no norm weights", "olmo2": "q/k norms, 2 RMSNorms", "qwen3": "q/k head norms, 2 RMSNorms"}
        final = "" if self.arch == "olmo" else " + final RMSNorm"
        return (
            f"embeddings {V:,} x {d:,} + {L} blocks x {self.block_params:,} (q {d:,} x {self.num_heads * self.head_dim:,}, "
            f"k/v {d:,} x {self.num_kv_heads * self.head_dim:,}, o, gated MLP 3 x {d:,} x {f:,}, "
            f"{norms.get(self.arch, '2 RMSNorms')}){final}{head}"
        )


def flops_per_token(config: Any, seq_len: int, *, activation_checkpointing: str = "none") -> FlopsPerToken:
    """Training FLOPs per token from a transformers config (or a ``ModelShape``) alone: no weights needed."""
    if not isinstance(config, ModelShape):
        arch = _reader(config)("model_type")
        if arch not in MATMUL_ARCHS:
            raise ConfigError(
                f"no FLOPs formula for model.arch = {arch} (so no MFU); formulas exist for {', '.join(MATMUL_ARCHS)}. "
                "Train without MFU or add the architecture's matmul shapes to pretrain/recipe/shape.py"
            )
        config = ModelShape.from_hf_config(config)
    return config.flops_per_token(seq_len, activation_checkpointing)
