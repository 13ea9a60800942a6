"""The model a recipe describes: a transformers config, a layout-independent init, parameter counts.

Vocabulary rounding and the closed-form parameter count are the shape's (``pretrain.recipe.shape``), read here
from the very config transformers builds.

Nothing is downloaded: ``AutoModelForCausalLM.from_config`` builds the architecture without drawing any
weights (on the meta device, or partitioned by ZeRO-3's ``zero.Init``); ``materialize`` allocates each
rank's share on its device and ``init_weights`` draws every module so that its values depend only on the
seed, the module's name and the config, whatever the layout.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import functools
import hashlib
import itertools
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from huggingface_hub.errors import StrictDataclassError
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pretrain.errors import ConfigError, disk_full_error, is_disk_full
from pretrain.model import activation_checkpointing
from pretrain.model.loss import chunked_causal_lm_loss
from pretrain.recipe.config import ModelConfig, is_dropout_attribute
from pretrain.recipe.init_from import checkpoint_config
from pretrain.recipe.shape import MOE_ARCHS, ModelShape, moe_attributes, require_counted, resolve_vocab_size
from pretrain.system.quiet import no_progress_bars

__all__ = ["build_model", "closed_form_num_params", "count_active_parameters", "count_parameters", "dropout_attributes", "hf_config",
           "init_weights", "materialize", "meta_model", "resolve_vocab_size", "save_pretrained_model"]

# Our field -> the config attributes that can hold it, first match wins. GPT-2's config maps hidden_size,
# num_hidden_layers, num_attention_heads and max_position_embeddings to n_embd, n_layer, n_head and
# n_positions through its attribute_map; its MLP width is n_inner and its epsilon layer_norm_epsilon.
_CONFIG_NAMES = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "head_dim": ("head_dim",),
    "max_position_embeddings": ("max_position_embeddings",),
    "rope_theta": ("rope_parameters",),  # transformers 5 turns a `rope_theta` argument into rope_parameters
    "norm_eps": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"),
    "init_std": ("initializer_range",),
    "tie_embeddings": ("tie_word_embeddings",),
}
_NULLABLE = {"num_kv_heads", "intermediate_size", "head_dim", "rope_theta", "norm_eps"}  # null = the architecture's default
_MEANING = {"num_kv_heads": "grouped-query attention", "rope_theta": "rotary position embeddings",
            "head_dim": "head size of its own (it is hidden_size / num_heads)"}
_COMMON_ARCHS = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")
# A transformers config with one of these set builds routed experts (qwen2_moe's num_experts, deepseek's n_routed_experts)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def hf_config(model_cfg: ModelConfig, vocab_size: int, seq_len: int) -> PreTrainedConfig:
    """The transformers config of ``model.arch`` with our fields mapped to its attribute names.

    Every non-null field must have a home in the architecture's config (a field that would be silently
    ignored is an error). ``intermediate_size`` is required where the config has one (its default, e.g.
    llama's 11008, ignores hidden_size). ``model.config_overrides`` must name existing attributes and is
    applied last. ``use_cache`` is off: training never decodes.
    """
    if model_cfg.init_from is not None and checkpoint_config(model_cfg.init_from) is not None:
        return _pretrained_config(model_cfg, vocab_size)  # else a pretrain checkpoint not viewed yet: its recipe's fields
    arch = model_cfg.arch
    if arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        near = difflib.get_close_matches(arch, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(near)}?" if near else "valid types include " + ", ".join(_COMMON_ARCHS)
        raise ConfigError(f"model.arch = {arch!r} is not a transformers model type with a causal-LM head; {hint}")
    default = AutoConfig.for_model(arch)
    experts = [name for name in _EXPERT_COUNTS if getattr(default, name, None)]
    if experts and model_cfg.moe is None:  # transformers would build its default experts, unasked
        raise ConfigError(f"model.arch = {arch} is a mixture of experts ({experts[0]} = {getattr(default, experts[0])} "
                          f"by default) that pretrain does not build; its MoE architectures: {', '.join(MOE_ARCHS)}")
    moe = {}
    if model_cfg.moe is not None:  # the experts' width is the config's intermediate_size (+ the MoE keys)
        moe = moe_attributes(model_cfg)
        model_cfg = model_cfg.model_copy(update={"intermediate_size": moe.pop("intermediate_size")})
    kwargs, problems = _mapped_fields(model_cfg, default, vocab_size, seq_len)
    kwargs.update(moe)
    attributes = sorted({*default.to_dict(), *default.attribute_map})
    for key in model_cfg.config_overrides:
        if not hasattr(default, key):
            near = difflib.get_close_matches(key, attributes, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(near)}?" if near else f"see transformers' {type(default).__name__}"
            problems.append(f"model.config_overrides.{key} is not an attribute of the {arch} config; {hint}")
    dropouts = dropout_attributes(default)
    if model_cfg.dropout and not dropouts:
        problems.append(f"model.dropout = {model_cfg.dropout}, but the {arch} config has no dropout; set model.dropout "
                        "to 0")
    kwargs.update(dict.fromkeys(dropouts, model_cfg.dropout))
    kwargs.update(_foreign_token_ids(default, vocab_size))
    if problems:
        raise ConfigError(problems)
    try:
        return AutoConfig.for_model(arch, **{**kwargs, "use_cache": False, **model_cfg.config_overrides})
    except (StrictDataclassError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model (arch {arch}): transformers rejects the config: {exc}") from None


def _pretrained_config(model_cfg: ModelConfig, vocab_size: int) -> PreTrainedConfig:
    """``model.init_from``'s own config, with what a recipe may still set: every dropout (``model.dropout``) and
    ``model.config_overrides`` (each an existing attribute; the shape's keys are the checkpoint's)."""
    from pretrain.model.pretrained import pretrained_config
    from pretrain.recipe.init_from import SHAPE_FIELDS

    config = pretrained_config(model_cfg.init_from)
    problems = []
    if config.vocab_size != vocab_size:
        problems.append(f"model.vocab_size = {vocab_size}, but {model_cfg.init_from} has {config.vocab_size} embedding "
                        "rows; leave model.vocab_size out")
    shape_keys = {name for names in SHAPE_FIELDS.values() for name in names} - {"max_position_embeddings", "rope_theta"}
    for key in model_cfg.config_overrides:
        if key in shape_keys:
            problems.append(f"model.config_overrides.{key}: the shape of a pretrained model is its checkpoint's; remove it")
        elif not hasattr(config, key):
            problems.append(f"model.config_overrides.{key} is not an attribute of {model_cfg.init_from}'s config "
                            f"({type(config).__name__})")
    dropouts = dropout_attributes(config)
    if model_cfg.dropout and not dropouts:
        problems.append(f"model.dropout = {model_cfg.dropout}, but the {config.model_type} config has no dropout; set "
                        "model.dropout to 0")
    if problems:
        raise ConfigError(problems)
    moe = {}
    if model_cfg.moe is not None:  # the recipe's load-balancing weight; the router logits asked for in training only
        moe = {"router_aux_loss_coef": model_cfg.moe.router_aux_loss_coef, "output_router_logits": False}
    for key, value in {**dict.fromkeys(dropouts, model_cfg.dropout), "use_cache": False, **moe,
                       **model_cfg.config_overrides}.items():
        setattr(config, key, value)
    return config


def _foreign_token_ids(default: PreTrainedConfig, vocab_size: int) -> dict[str, None]:
    """The architecture's default special-token ids that lie past this model's vocabulary, as None.

    They belong to the tokenizer the architecture was released with, not to this one: Phi-3's pad id 32000 makes
    its embedding's padding_idx fail to build at a 4096-token vocabulary, GPT-2's eos 50256 makes transformers
    warn and generate() look for a token that cannot occur. ``config_overrides`` still sets any of them.
    """
    names = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {name: None for name in names if isinstance(getattr(default, name, None), int)
            and getattr(default, name) >= vocab_size}


def dropout_attributes(config: PreTrainedConfig) -> list[str]:
    """The attributes of an architecture's config that hold one of its dropout probabilities (every one is
    set to ``model.dropout``): GPT-2's attn_pdrop / resid_pdrop / embd_pdrop, Llama's attention_dropout,
    GPT-NeoX's attention_dropout / hidden_dropout, ..."""
    return sorted(key for key, value in config.to_dict().items()
                  if is_dropout_attribute(key) and isinstance(value, int | float) and not isinstance(value, bool))


@functools.cache
def reads_head_dim(arch: str) -> bool:
    """Whether ``arch``'s attention takes its head size from ``config.head_dim`` although its config class has no such
    field (transformers' qwen3_moe and olmoe read ``getattr(config, "head_dim", hidden_size // heads)``: Qwen3-30B-A3B's
    config.json sets 128 on a 2048-wide model of 32 heads). Asked of a one-block model on the meta device."""
    config = AutoConfig.for_model(arch, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=4, vocab_size=128, head_dim=32,
                                  **_foreign_token_ids(AutoConfig.for_model(arch), 128))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    projection = next((m for n, m in model.named_modules() if n.endswith("self_attn.q_proj")), None)
    return projection is not None and projection.weight.shape[0] == 4 * 32


def _mapped_fields(
    model_cfg: ModelConfig, default: PreTrainedConfig, vocab_size: int, seq_len: int
) -> tuple[dict, list[str]]:
    """Our fields as keyword arguments of the arch's config, and the problems found on the way."""
    arch = default.model_type
    max_positions = model_cfg.max_position_embeddings or seq_len
    values = {
        **model_cfg.model_dump(include=set(_CONFIG_NAMES)),
        "vocab_size": vocab_size,
        "num_kv_heads": model_cfg.num_kv_heads or model_cfg.num_heads,
        "max_position_embeddings": max_positions,
    }
    problems = []
    if max_positions < seq_len:
        problems.append(
            f"model.max_position_embeddings ({max_positions}) is shorter than data.seq_len ({seq_len}); "
            "raise it or set it to null (= data.seq_len)"
        )
    kwargs = {}
    for field, names in _CONFIG_NAMES.items():
        value = values[field]
        name = next((n for n in names if hasattr(default, n)), None)
        if field == "head_dim" and value is None and name is not None:
            # hidden_size / num_heads, what the recipe's widths say, on every architecture: transformers' own
            # qwen3 (128) and gemma (256) defaults would silently resize a recipe's attention.
            value = model_cfg.hidden_size // model_cfg.num_heads
        if name == "intermediate_size" and value is None:
            problems.append(
                f"model.intermediate_size is required for arch {arch} (its default {default.intermediate_size} "
                "does not follow hidden_size); set the MLP width, e.g. 8/3 x hidden_size for SwiGLU"
            )
        elif value is None:
            continue
        elif name is not None:
            kwargs["rope_theta" if name == "rope_parameters" else name] = value
        elif field == "num_kv_heads" and value == model_cfg.num_heads:
            continue  # multi-head attention is what an arch without GQA does anyway
        elif field == "head_dim" and value == model_cfg.hidden_size // model_cfg.num_heads:
            continue  # the head size such an arch has anyway
        elif field == "head_dim" and reads_head_dim(arch):
            kwargs["head_dim"] = value  # an attribute its attention reads though the config class has no field
        elif field in _NULLABLE:
            what = _MEANING.get(field, f"`{names[0]}`")
            problems.append(f"model.{field} = {value}, but the {arch} config has no {what}; set model.{field} to null")
        else:
            problems.append(f"model.arch = {arch} is not supported: its config has no `{names[0]}` (model.{field})")
    return kwargs, problems


def meta_model(recipe, attention: str | None = None) -> tuple[PreTrainedModel, int]:
    """The recipe's model on the meta device (no memory, no init) and its vocabulary size: what --dry-run
    prints and pretrain-launch builds, so that a config transformers cannot build is refused before launch.
    A pretrained tokenizer is loaded for its size; a BPE's is the recipe's. ``attention``: another kernel to
    build with (pretrain-launch: a login node may lack the GPU nodes' flash-attn)."""
    if recipe.model.vocab_size is not None:
        tokenizer_vocab = None
    elif recipe.data.tokenizer == "bpe":
        tokenizer_vocab = recipe.data.tokenizer_vocab_size
    else:
        from pretrain.data import build_tokenizer

        tokenizer_vocab = len(build_tokenizer(recipe.data))
    vocab = resolve_vocab_size(recipe.model, tokenizer_vocab)
    model_cfg = recipe.model.model_copy(update={"attention": attention}) if attention else recipe.model
    return build_model(model_cfg, vocab, recipe.data.seq_len, seed=recipe.train.seed, meta=True), vocab


def build_model(
    model_cfg: ModelConfig,
    vocab_size: int,
    seq_len: int,
    *,
    seed: int,
    meta: bool = False,
    device: torch.device | str = "cpu",
    shard: Callable[[PreTrainedModel], PreTrainedModel] | None = None,
    convert: Callable[[PreTrainedModel], object] | None = None,
    pretrained: bool = True,
    log: Callable[[str], None] = print,
) -> PreTrainedModel:
    """The causal LM in fp32 (mixed precision casts at run time), initialised by ``init_weights(seed)``, or with
    ``model.init_from``'s weights (``pretrained``: False when a resume will overwrite them anyway).

    No rank ever holds more than its share of the parameters plus the module being drawn:

    - ``meta=True`` builds every parameter on the meta device (no memory, no init): shapes and counts of a
      70B model in seconds, for dry runs and tests.
    - Under DeepSpeed ZeRO-3 (an ``HfDeepSpeedConfig`` is alive, as accelerate makes one for
      ``zero3_init``), ``deepspeed.zero.Init`` partitions each parameter as its module is built, with
      transformers' own init switched off; ``init_weights`` then gathers one module at a time.
    - Otherwise the model is built on the meta device, ``shard`` (FSDP: fully_shard on the meta model)
      turns each parameter into this rank's shard, and only then is storage allocated, on ``device``
      (the run's device: no full CPU copy on a GPU run), and every tensor drawn by ``init_weights``.
    - ``convert`` (float8: pretrain/model/float8.py) swaps modules on the meta model, before ``shard``, keeping
      every module name, so the init draws the same weights.

    Transformers' construction-time draws are skipped in every case: the init draws each tensor once.
    """
    config = hf_config(model_cfg, vocab_size, seq_len)
    partitioned = not meta and is_deepspeed_zero3_enabled()
    with _freed_host_memory_returned():
        model = _build(model_cfg, config, partitioned, meta, device, shard, convert)
        if not meta and model_cfg.init_from is not None and pretrained:
            from pretrain.model.pretrained import load_pretrained

            # every parameter from the checkpoint, this rank's share only: no seeded draw to overwrite
            log(load_pretrained(model, model_cfg.init_from).line(model_cfg.init_from))
        elif not meta:
            init_weights(model, seed)
            if not partitioned:
                _require_drawn(model)
    return model


def _build(model_cfg: ModelConfig, config: PreTrainedConfig, partitioned: bool, meta: bool,
           device: torch.device | str, shard: Callable[[PreTrainedModel], PreTrainedModel] | None,
           convert: Callable[[PreTrainedModel], object] | None = None) -> PreTrainedModel:
    """The model with its storage where it will live, nothing drawn yet."""
    with _partitioned_construction() if partitioned else init_empty_weights():
        try:
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=model_cfg.attention, dtype=torch.float32
            )
        except ImportError as exc:
            raise ConfigError(
                f"model.attention = {model_cfg.attention} cannot be used here: {exc}; try sdpa"
            ) from None
        except (RuntimeError, MemoryError) as exc:
            if not meta:
                raise
            # On the meta device only buffers take memory: sizes no machine could hold (model.hidden_size=1e9).
            raise ConfigError(
                f"model (arch {config.model_type}): even its description does not fit in memory ({exc}); check "
                f"model.hidden_size ({model_cfg.hidden_size}), the vocabulary ({config.vocab_size}) and "
                f"model.config_overrides {model_cfg.config_overrides}"
            ) from None
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            # A config transformers accepted but cannot build (e.g. config_overrides.hidden_act = 'nope').
            raise ConfigError(
                f"model (arch {config.model_type}): transformers cannot build the model from this config "
                f"({type(exc).__name__}: {exc}); check model.config_overrides {model_cfg.config_overrides}"
            ) from None
    model.tie_weights()  # init_empty_weights re-creates every parameter it registers, which unties them
    model.loss_function = chunked_causal_lm_loss  # transformers' loss without the fp32 logits (pretrain/model/loss.py)
    # a flag and a checkpoint function on the layers: module names (the init seeds) do not change
    activation_checkpointing.apply(model, model_cfg.activation_checkpointing)
    if convert is not None:
        convert(model)
    if not meta and not partitioned:
        if shard is not None:
            model = shard(model)
        materialize(model, device)
    return model


# glibc's mallopt parameter, and the largest value its dynamic threshold reaches on 64-bit systems
_M_MMAP_THRESHOLD, _DEFAULT_MMAP_THRESHOLD_MAX = -3, 32 << 20


@contextlib.contextmanager
def _freed_host_memory_returned():
    """Let every host tensor of 1 MiB or more be its own memory mapping while the model is built.

    Building allocates and frees one module's full tensors after another (zero.Init's construction, the
    per-module draws). glibc serves blocks below its dynamic mmap threshold (which climbs to 32 MiB) from
    the heap and keeps them when freed, so a model whose matrices are under 32 MiB (hidden size up to
    ~2800) would keep a freed module's worth of resident memory for each module built: measured, 1.3x
    the fp32 model under ZeRO-3 on 2 ranks instead of the rank's half. Afterwards the threshold is the
    32 MiB that the dynamic one reaches anyway. Not glibc (macOS, musl): nothing to do.
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform.startswith("linux") else None
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, 1 << 20):
        yield
        return
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _DEFAULT_MMAP_THRESHOLD_MAX)


@contextlib.contextmanager
def _partitioned_construction():
    """The contexts transformers' ``from_config`` enters itself under ZeRO-3 (no torch or transformers
    init, RoPE buffers kept in their dtype, ``zero.Init`` with the live DeepSpeed config), entered here so
    that ``set_zero3_state`` tells ``from_config`` they are taken care of: it then skips its own
    gathered re-init of every module, a draw that ``init_weights`` would overwrite anyway."""
    import deepspeed
    from transformers import initialization
    from transformers.integrations import deepspeed_config
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
    from transformers.modeling_utils import set_zero3_state

    with (initialization.no_init_weights(), prevent_arange_dtype_change(),
          deepspeed.zero.Init(config_dict_or_path=deepspeed_config()), set_zero3_state()):
        yield


def materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Give every meta tensor of ``model`` storage on ``device``; the others stay where they are (buffers
    built on CPU, or moved to the GPU by fully_shard; accelerate's prepare places the model).

    A sharded parameter (FSDP2's DTensor) gets storage for this rank's shard only. The new storage is
    NaN, so a parameter the architecture's init does not draw is caught (``_require_drawn``) instead of
    training from uninitialised memory. Parameters are swapped in place (torch's
    ``swap_module_params_on_conversion``), so tied parameters stay one tensor with one allocation.
    """
    def allocate(tensor: torch.Tensor) -> torch.Tensor:
        return torch.full_like(tensor, float("nan"), device=device) if tensor.is_meta else tensor

    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model._apply(allocate)  # Module.to_empty, for the meta tensors only (FSDP2 re-points its shards)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def init_weights(model: PreTrainedModel, seed: int, threads: int | None = None) -> None:
    """Re-draw every parameter with transformers' own rules (``model._init_weights``), each module from
    a generator seeded by (seed, the module's qualified name).

    So a module's values do not depend on how many modules were built before it, on the global RNG, on
    the world size, on ZeRO-3 partitioning or on FSDP sharding: the same layer gets the same weights in
    any layout. Modules are visited children first, as transformers does, because a parent's rule may
    overwrite a child's (GPT-2 rescales attn.c_proj by 1/sqrt(2 x layers)); the rule of a parent may touch
    its direct children's parameters, so those are drawn with it. Draws come from the CPU generator on a
    full CPU copy of one module's parameters at a time (``_full_on_cpu``): CPU and CUDA generators give
    different numbers for one seed, and a shard's values must be the slice of the unsharded draw.

    The repeated blocks (the decoder layers) are drawn on ``threads`` threads at once (default: this process's
    share of the machine's cores, ``init_threads``), each module from its own CPU generator with the same seed,
    so the values are the ones the one-thread order draws, bit for bit (a CPU ``normal_`` is one sequential
    stream: 8.5 s of a 1B model's start-up on one core).
    """
    # transformers' init functions skip tensors flagged as already loaded (from_pretrained, resized
    # embeddings); here every tensor is to be drawn.
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if hasattr(tensor, "_is_hf_initialized"):
            del tensor._is_hf_initialized
    drawn: set[int] = set()  # ids of the parameters drawn so far
    order = list(reversed(list(model.named_modules())))
    blocks = _repeated_blocks(model)
    threads = init_threads(len(blocks)) if threads is None else min(threads, len(blocks))
    in_block = [next((b for b in blocks if name == b or name.startswith(f"{b}.")), None) for name, _ in order]
    parallel = threads > 1 and _parallel_safe(model, blocks)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        done = False
        for (name, module), block in zip(order, in_block, strict=True):
            if block is None or not parallel:
                _draw(model, name, module, seed, drawn)
            elif not done:  # the blocks' modules are contiguous in this order: all of them now
                tasks = {b: [(n, m) for (n, m), o in zip(order, in_block, strict=True) if o == b] for b in blocks}
                _draw_blocks(model, tasks, seed, drawn, threads)
                done = True


def _draw(model: PreTrainedModel, name: str, module: torch.nn.Module, seed: int, drawn: set[int],
          generator: torch.Generator | None = None) -> None:
    """One module's rule on its full CPU tensors, from ``generator`` (the process's default generator when None)
    seeded for this module."""
    modules = [module, *module.children()]
    redrawn = _touched_by_rule(model, modules, drawn)
    with _full_on_cpu(modules, drawn, redrawn):
        (generator or torch.default_generator).manual_seed(_module_seed(seed, name))
        model._init_weights(module)


def init_threads(blocks: int) -> int:
    """Threads for drawing ``blocks`` blocks: the cores this process may use over the processes of its node
    (LOCAL_WORLD_SIZE, which accelerate sets), at most one per block."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(blocks, cores // local))


def _repeated_blocks(model: torch.nn.Module) -> list[str]:
    """Qualified names of the repeated blocks: the children of the outermost ModuleList whose children are two or
    more modules of one class (a decoder's layers)."""
    for name, module in model.named_modules():
        children = list(module.children())
        if isinstance(module, torch.nn.ModuleList) and len(children) > 1 and len({type(c) for c in children}) == 1:
            return [f"{name}.{key}" if name else key for key, _ in module.named_children()]
    return []


def _parallel_safe(model: PreTrainedModel, blocks: list[str]) -> bool:
    """The blocks can be drawn on threads: no parameter is a ZeRO-3 partition (its gather and partition are
    DeepSpeed's, not thread-safe), and with FSDP2 shards no block rule reads a child's drawn tensor (its
    ``full_tensor`` is a collective: on threads the ranks could issue them in different orders)."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return False
    if not any(isinstance(p, DTensor) for p in params):
        return True
    first = model.get_submodule(blocks[0])
    every = {id(p) for p in first.parameters()}
    return not any(_touched_by_rule(model, [m, *m.children()], every) for m in first.modules())


# The ops that draw and take a generator. torch.nn.init's are torch functions themselves: the mode sees them first
# and, being off while it handles a call, not the Tensor.normal_ inside, so they get the generator at their door.
_RANDOM = {
    *(getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_",
                                         "log_normal_", "cauchy_")),
    torch.normal, torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.multinomial,
    *(getattr(torch.nn.init, n) for n in ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                                          "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_")),
}


class _OwnGenerator(TorchFunctionMode):
    """Gives a random op on CPU tensors that names no generator this thread's own (seeded per module by ``_draw``)
    instead of the process-wide default one, which threads would share."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("generator") is None and func in _RANDOM and all(
                a.device.type == "cpu" for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)) and (
                torch.device(kwargs.get("device") or "cpu").type == "cpu"):
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


def _draw_blocks(model: PreTrainedModel, tasks: dict[str, list[tuple[str, torch.nn.Module]]], seed: int,
                 drawn: set[int], threads: int) -> None:
    """Each block's modules in their order, blocks on ``threads`` threads. A rule that drew from the process's
    default generator anyway (an op ``_OwnGenerator`` does not know) shows as a changed default state: then the
    blocks are drawn again one at a time, as a single thread would."""
    from concurrent.futures import ThreadPoolExecutor

    def run(entries):
        generator = torch.Generator()
        with torch.no_grad(), _OwnGenerator(generator):  # grad mode and function modes are per thread
            for name, module in entries:
                _draw(model, name, module, seed, drawn, generator)

    before = torch.default_generator.get_state()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="init") as pool:
        for future in [pool.submit(run, entries) for entries in tasks.values()]:
            future.result()
    if not torch.equal(before, torch.default_generator.get_state()):
        ids = {id(p) for entries in tasks.values() for _, m in entries for p in m.parameters(recurse=False)}
        drawn.difference_update(ids)
        for entries in tasks.values():
            for name, module in entries:
                _draw(model, name, module, seed, drawn)


def _module_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from the run seed and a module name (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Touches(TorchFunctionMode):
    """Records which of the given tensors any torch function receives (a read, a write, ``.data``)."""

    def __init__(self, watched: set[int]):
        super().__init__()
        self.watched, self.touched = watched, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.touched.update(id(t) for t in pytree.tree_leaves((args, kwargs))
                            if isinstance(t, torch.Tensor) and id(t) in self.watched)
        return func(*args, **kwargs)


def _touched_by_rule(model: PreTrainedModel, modules: list[torch.nn.Module], drawn: set[int]) -> set[int]:
    """The ids of the already drawn parameters of ``modules`` that the init rule of ``modules[0]`` uses.

    A parent's rule sees its children's parameters, which their own rules drew before it; most rules (a
    Llama decoder layer's, the model's) leave them alone, and gathering a sharded one for nothing holds it
    full beside the rank's share (the embedding: 0.1x of a 500M model). The rule is first run on meta
    stand-ins of the module's parameters, watched by a torch function mode: a stand-in it reads or writes
    (``normal_``, ``.data``, ``mul_``) marks its parameter as used. A rule that cannot run on meta tensors
    counts as using every one of them. Meta tensors draw no random numbers, and buffers are left real: a
    rule writes them the same values again in the real run.
    """
    params = {id(p): p for m in modules for p in m.parameters(recurse=False)}
    if not any(i in drawn for i in params):
        return set()
    stand_ins = {i: torch.nn.Parameter(torch.empty(getattr(p, "ds_shape", p.shape), dtype=p.dtype, device="meta"),
                                       requires_grad=p.requires_grad) for i, p in params.items()}
    slots = [(m, key, p) for m in modules for key, p in m._parameters.items() if p is not None and id(p) in params]
    watch = _Touches({id(t) for t in stand_ins.values()})
    for module, key, param in slots:
        module._parameters[key] = stand_ins[id(param)]
    try:
        with watch:
            model._init_weights(modules[0])
    except Exception:  # noqa: BLE001 - an op without a meta kernel: gather all of them, as before
        return {i for i in params if i in drawn}
    finally:
        for module, key, param in slots:
            module._parameters[key] = param
    return {i for i, t in stand_ins.items() if i in drawn and id(t) in watch.touched}


@contextlib.contextmanager
def _full_on_cpu(modules: list[torch.nn.Module], drawn: set[int], redrawn: set[int]):
    """Let the init draw full CPU tensors for these modules' own parameters, then put the values where each
    parameter lives. Every rank draws the same values, so a rank keeps its part of the draw without
    communication: a ZeRO-3 partition (DeepSpeed's own ``param.partition``) or a DTensor shard (FSDP2)
    gets its slice, a tensor on another device is copied back; one on CPU is drawn in place.

    A parameter not drawn yet (not in ``drawn``) holds nothing worth reading, so its full tensor is a new
    NaN-filled CPU tensor: no all-gather, and at most one full module beside the rank's share. One drawn
    before is left where it is unless it is in ``redrawn`` (a parent's rule that uses a child's tensor,
    GPT-2's c_proj): then it is gathered with its current values, ZeRO-3 through ``GatheredParameters``
    (rank 0's values kept), FSDP2 through ``full_tensor``. A shard's slice is copied straight out of the
    full tensor (no shard-sized temporary).
    """
    params = list({id(p): p for m in modules for p in m.parameters(recurse=False)
                   if id(p) not in drawn or id(p) in redrawn}.values())
    fresh = {id(p) for p in params if id(p) not in drawn}

    def new_full(param: torch.Tensor) -> torch.Tensor:
        return torch.full(param.shape, float("nan"), dtype=param.dtype, device="cpu")

    with _gathered([p for p in params if id(p) not in fresh]), _zero3_fresh([p for p in params if id(p) in fresh]):
        sharded = {id(p): torch.nn.Parameter(new_full(p) if id(p) in fresh else p.full_tensor().cpu(),
                                             requires_grad=p.requires_grad)
                   for p in params if isinstance(p, DTensor)}
        slots = [(m, key, p) for m in modules for key, p in m._parameters.items() if id(p) in sharded]
        moved = [(p, p.data) for p in params if id(p) not in sharded and p.device.type != "cpu"]
        for module, key, param in slots:
            module._parameters[key] = sharded[id(param)]
        for param, data in moved:
            param.data = new_full(data) if id(param) in fresh else data.to("cpu")
        try:
            yield
        finally:
            for module, key, param in slots:
                module._parameters[key] = param
            for param in {id(p): p for _, _, p in slots}.values():
                full = sharded[id(param)].detach()
                # every rank drew the same full tensor: each keeps its slice, no communication
                shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh,
                                                                      param.placements)
                param.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))])
            for param, data in moved:
                data.copy_(param.data)
                param.data = data
    drawn.update(fresh)


def _gathered(params: list[torch.nn.Parameter]):
    """Under DeepSpeed ZeRO-3 (zero.Init) parameters are partitioned at construction: gather the full
    tensors (their current values) for the init. Every rank draws the same values; rank 0's are kept."""
    params = [p for p in params if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


@contextlib.contextmanager
def _zero3_fresh(params: list[torch.nn.Parameter]):
    """ZeRO-3 parameters not drawn yet: a full NaN CPU tensor each for the init to draw into, then
    DeepSpeed's own ``partition(has_been_updated=True)`` copies this rank's slice into its partition and
    frees the full tensor (what ``GatheredParameters`` does on exit, without the all-gather and the
    broadcast: every rank drew the same values)."""
    params = [p for p in params if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    empty = [(param, param.data) for param in params]  # the partitioned state's placeholder, on its device
    for param in params:
        param.data = torch.full(param.ds_shape, float("nan"), dtype=param.dtype, device="cpu")
        param.ds_status = ZeroParamStatus.AVAILABLE
    try:
        yield
    finally:
        for param, placeholder in empty:
            param.partition(has_been_updated=True)
            param.data = placeholder


def _require_drawn(model: torch.nn.Module) -> None:
    """Every parameter ``materialize`` allocated (as NaN) must have been drawn by the architecture's init."""
    # a sum is NaN if any element is (init values are far from overflowing); no tensor-sized mask
    missed = [name for name, p in model.named_parameters()
              if (p.to_local() if isinstance(p, DTensor) else p).sum().isnan()]  # device-to-host sync per tensor
    if missed:
        raise ConfigError(
            f"model.arch = {model.config.model_type}: transformers' _init_weights does not initialise "
            f"{', '.join(missed[:5])}{' ...' if len(missed) > 5 else ''}; this architecture cannot be built "
            "from scratch here, choose another model.arch"
        )


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (a tied embedding counts once); works on meta and ZeRO-3 partitioned models."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def count_active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token uses: all but the experts its router does not pick (a mixture of experts keeps
    its experts under ``.experts.``, num_experts_per_tok of ``num_experts`` / ``num_local_experts``); the
    total for a dense model."""
    config = model.config
    top_k = getattr(config, "num_experts_per_tok", None)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    total = 0
    for name, p in model.named_parameters():
        numel = getattr(p, "ds_numel", p.numel())
        total += numel * top_k // num_experts if top_k and ".experts." in name else numel
    return total


def closed_form_num_params(model_cfg: ModelConfig, vocab_size: int, seq_len: int) -> int:
    """Parameter count from the architecture's formula (``ModelShape.param_sizes``), without building the
    model: the shape of the config transformers would build for this recipe section."""
    config = hf_config(model_cfg, vocab_size, seq_len)
    require_counted(config.model_type)
    return ModelShape.from_hf_config(config, source="model").num_params


def save_pretrained_model(model: PreTrainedModel, state_dict: dict[str, torch.Tensor] | None, tokenizer, final: Path,
                          texts: list[str], reader: tuple | None = None, shard_bytes: int | None = None) -> None:
    """``final`` as a transformers model directory (``model``'s config with ``state_dict``'s weights, or with
    ``reader``'s: (specs, read), read a shard at a time; safetensors, ``pretrain.model.hf_save``) plus the tokenizer,
    written under ``.tmp-<name>`` and renamed: the run's final_model and pretrain-export both write it here.
    ``model`` may live on the meta device. The config carries the tokenizer's special ids and the KV cache on, and
    the tokenizer is verified on ``texts`` (a validation sample) to load back with the training ids
    (``pretrain.model.export_checks``); a tokenizer that cannot is a ConfigError and nothing is written to
    ``final``."""
    from pretrain.model.export_checks import ready_for_generation, save_verified_tokenizer
    from pretrain.model.hf_save import SHARD_BYTES, in_memory, write_pretrained

    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    ready_for_generation(model, tokenizer)
    specs, read = reader if reader is not None else in_memory(state_dict)
    # A tied weight once: save_pretrained drops an alias only when it shares storage with its tensor, and the
    # gathered state of a tensor-parallel run (or its checkpoint) holds the LM head as a copy of the embedding.
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    specs = {k: v for k, v in specs.items() if k not in aliases}
    try:
        tmp.mkdir(parents=True)
        with no_progress_bars():  # the caller prints one line; a bar garbles a log file
            write_pretrained(model, specs, read, tmp, shard_bytes or SHARD_BYTES)
        save_verified_tokenizer(tokenizer, tmp, texts)
    except ConfigError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:
        if not is_disk_full(exc, final.parent):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_full_error(final.parent, f"the model to {final}", "the partial copy is removed and the checkpoints "
                              "are untouched; free space there, then export the newest checkpoint with "
                              f"pretrain-export <checkpoint> {final}") from None
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
