"""What tensor parallelism, context parallelism, expert parallelism and float8 change in the estimate: which
parameters the TP plan splits, which activations shrink, which experts a rank unshards, the all-to-all buffers, and
torchao's float8 casts.

- **TP** (accelerate's tp_size, transformers' TP plan: pretrain/distributed/tensor_parallel.py). The plan is the
  architecture's own: its config's ``base_model_tp_plan`` (the blocks' q/k/v/gate/up colwise, o/down rowwise) and
  its CausalLM class's ``_tp_plan`` (the LM head, colwise with its output gathered), and the vocab-parallel input
  embedding transformers adds. A module the plan names holds 1/TP of its weight (and of a colwise bias); everything
  else (norms, a rowwise bias) is replicated on the TP ranks. FSDP then shards both over its own
  ranks. Activations: without sequence parallelism (transformers' plans have none) the residual stream, the norms
  and the block outputs stay whole on every TP rank (the rowwise o/down outputs are all-reduced); the colwise
  outputs (q, k, v, gate, up, their products) and the attention over heads / TP are split. The logits are gathered
  (colwise_gather_output): whole.
- **CP** (cp_size): every sequence is split over the CP ranks, so every per-token activation and the logits are
  those of seq / CP tokens; K/V of the other chunks are exchanged inside the attention and not kept for backward.
- **EP** (model.moe.ep_size: pretrain/distributed/expert_parallel.py, EP x FSDP2 as transformers and torchtitan lay
  it out). Every rank stays data parallel. The dense part (attention, router, embeddings, norms, LM head) is FSDP
  over the whole world; each group of EP consecutive ranks holds every expert once, E / EP whole experts per rank,
  and the world / EP copies of each expert (efsdp) are FSDP-sharded among themselves. So a rank's shards are
  Ψ_dense / N + (X / EP) / (N / EP) = Ψ / N, as under plain FSDP (X: every block's experts, E x 3 d f each): the
  parameters, gradients and optimizer states per rank do not change. What a rank unshards does: plain FSDP gathers a
  block with all E of its experts, EP the dense part and its own E / EP experts (over efsdp only), so one unsharded
  block is ``block - (1 - 1/EP) x E x 3 d f`` and every unsharded gradient (a unit's on its way to the
  reduce-scatter, no_sync's accumulated ones) shrinks the same way: Ψ_EP = Ψ - L x (1 - 1/EP) x E x 3 d f. Tokens
  reach their experts by all-to-all: each carries the micro-batch's T x top-k (token, expert) rows of d in the
  compute dtype, (EP - 1) / EP of them to other ranks; one is in flight at a time (dispatch or combine, forward or
  backward), its send and receive buffers 2 x T k d b (the average: a rank whose experts the router favours
  receives more).
- **float8** (precision.float8, torchao's Float8Linear): torchao saves the high-precision input and weight for
  backward (``matmul_with_hp_or_float8_args`` in torchao/float8/float8_linear.py) and casts them again there, so
  no float8 copy outlives the matmul that made it. The extra is transient: the float8 copies of the running
  Linear's weight and input in forward, its weight and output gradient in backward (1 B per element, plus
  scales). Counted conservatively as two weight-sized and two activation-sized float8 tensors of the largest
  Linear alive at once. FSDP2's float8 all-gather (tensorwise) would shrink the gathered units; not counted
  (the bf16 figure is kept: an overestimate).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from pretrain.errors import ConfigError
from pretrain.plan.memory.terms import Phases, Term, num
from pretrain.recipe.shape import ModelShape

_COLWISE_OUTPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE_OUTPUTS = ("o_proj", "down_proj")


TP_PLAN_CACHE = "tp_plans"
"""Under the cache root: one JSON file per (transformers version, architecture), what ``read_tp_plan`` returns."""


@cache
def tp_plan(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """(the model's TP plan as transformers applies it: module pattern -> style, its config's ``base_model_tp_plan``).

    pretrain.distributed.tensor_parallel.parallelize applies the model's resolved plan, which is more than the
    config's (transformers 5.24 adds the vocab-parallel embedding and the CausalLM's LM head), so it is read from a
    model (``read_tp_plan``). Building one imports torch and transformers' modeling code (seconds), so the answer is
    kept under the cache root, keyed by transformers' installed version (read from its metadata, no import): the
    planner and pretrain-estimate then size TP without importing either. A cache that cannot be written (read-only,
    shared) only costs the seconds."""
    import json
    import os
    import tempfile
    from importlib.metadata import version

    from pretrain.data.cache import cache_root

    safe = arch.replace("_", "").isalnum()  # a file name: transformers' model types are [a-z0-9_]
    path = cache_root() / TP_PLAN_CACHE / f"transformers-{version('transformers')}" / f"{arch}.json"
    if safe and path.is_file():
        try:
            entry = json.loads(path.read_text())
            plan, base = entry["tp_plan"], entry["base_model_tp_plan"]
            if all(isinstance(k, str) and isinstance(v, str) for d in (plan, base) for k, v in d.items()):
                return plan, base
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # unreadable or not ours: read the plan again and replace the file
    plan, base = read_tp_plan(arch)
    if safe:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{arch}-", suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"tp_plan": plan, "base_model_tp_plan": base}, f)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
        except OSError:
            pass
    return plan, base


def read_tp_plan(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """``tp_plan``'s answer from transformers itself: a one-block model of the architecture on the meta device (no
    memory, a fraction of a second once torch and transformers are imported)."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from pretrain.model.build import _foreign_token_ids

    config_class = CONFIG_MAPPING[arch]
    base = dict(getattr(config_class, "base_model_tp_plan", None) or {})
    if not base:
        return {}, {}
    # special-token ids of the architecture's own tokenizer lie past this vocabulary (OLMoE's eos 50279): None, as
    # pretrain.model.build does, so that transformers prints no warning into a plan's output
    config = config_class(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                          intermediate_size=128, vocab_size=128, tie_word_embeddings=False,
                          **_foreign_token_ids(config_class(), 128))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name.removeprefix("model."): style for name, style in model.tp_plan.items()}, base


@dataclass(frozen=True)
class TensorParallel:
    """How a model divides over ``size`` TP ranks."""

    size: int
    split_block: int
    """Elements of one block in the modules the plan splits (each TP rank holds 1/size of them)."""
    whole_block: int
    """Elements of one block the plan leaves whole (norms, rowwise biases): every TP rank holds all of them."""
    split_rest: int
    """Outside the blocks: the LM head and the embedding where the plan names them."""
    whole_rest: int
    splits_activations: bool
    """The block's colwise outputs (q, k, v, gate, up) and the attention heads are split (plain colwise/rowwise)."""
    split_modules: tuple[str, ...]

    @property
    def block_local(self) -> int:
        """One block's elements on one TP rank (before FSDP)."""
        return -(-self.split_block // self.size) + self.whole_block

    def local(self, shape: ModelShape) -> int:
        """The model's elements on one TP rank (before FSDP)."""
        return shape.num_layers * self.block_local + -(-self.split_rest // self.size) + self.whole_rest

    def formula(self, shape: ModelShape) -> str:
        L, T = shape.num_layers, self.size
        return (f"Ψ_TP = ({L} x {num(self.split_block)} + {num(self.split_rest)}) / {T} (split by the TP plan: "
                f"{', '.join(self.split_modules)}) + {L} x {num(self.whole_block)} + {num(self.whole_rest)} (whole: "
                f"norms and what the plan leaves out) = {num(self.local(shape))}")


NO_TP = None


def tensor_parallel(shape: ModelShape, size: int) -> TensorParallel | None:
    """The TP division of ``shape`` over ``size`` ranks (None for size 1). Refuses, naming why, what the training
    launch refuses (pretrain.distributed.tensor_parallel.tp_plan_problem) and a plan module the estimator cannot
    size."""
    if size <= 1:
        return NO_TP
    from types import SimpleNamespace

    from pretrain.distributed.tensor_parallel import tp_plan_problem, tp_shape_problem

    plan, base = tp_plan(shape.arch)
    problem = tp_plan_problem(SimpleNamespace(base_model_tp_plan=base), shape.arch, size)
    if problem:
        raise ConfigError(problem)
    if shape.num_experts or shape.family != "llama" or shape.arch == "phi3":
        raise ConfigError(f"model.arch = {shape.arch}: the memory estimator sizes TP for dense Llama-style blocks "
                          "with separate q/k/v and gate/up projections only; set tp_size to 1")
    problem = tp_shape_problem(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, size)
    if problem:
        raise ConfigError(problem)
    d, f, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q, k = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    # (weight, bias split by colwise) per plan module; a rowwise bias stays whole
    block_modules = {"q_proj": (d * q, q * shape.qkv_bias), "k_proj": (d * k, k * shape.qkv_bias),
                     "v_proj": (d * k, k * shape.qkv_bias), "o_proj": (q * d, 0),
                     "gate_proj": (d * f, f * shape.mlp_bias), "up_proj": (d * f, f * shape.mlp_bias),
                     "down_proj": (f * d, 0)}
    rest_modules = {"lm_head": V * d, "embed_tokens": V * d}
    split_block = split_rest = 0
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        name = pattern.rsplit(".", 1)[-1]
        if pattern.startswith("layers.*.") and name in block_modules:
            weight, bias = block_modules[name]
            split_block += weight + (bias if style.startswith("colwise") else 0)
            styles[name] = style
        elif name in rest_modules and "*" not in pattern:
            if name == "lm_head" and shape.tie_embeddings:
                continue
            split_rest += rest_modules[name]
            styles[name] = style
        else:
            raise ConfigError(f"model.arch = {shape.arch}: its TP plan names {pattern!r} ({style}), which the memory "
                              "estimator cannot size; set tp_size to 1")
    whole_block = shape.block_params - split_block
    whole_rest = shape.num_params - shape.num_layers * shape.block_params - split_rest
    plain = (all(styles.get(n) == "colwise" for n in _COLWISE_OUTPUTS)
             and all(styles.get(n) == "rowwise" for n in _ROWWISE_OUTPUTS))
    return TensorParallel(size, split_block, whole_block, split_rest, whole_rest, plain, tuple(styles))


@dataclass(frozen=True)
class ExpertParallel:
    """How a mixture of experts divides over ``size`` EP ranks (EP x FSDP2; the module docstring)."""

    size: int
    num_experts: int
    expert_block: int
    """Elements of one block's experts, all of them: E x 3 d f (fused gate_up E x 2f x d, down E x d x f)."""
    num_layers: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def elsewhere_block(self) -> int:
        """Elements of one block's experts that live on the other EP ranks: (1 - 1/EP) x E x 3 d f."""
        return self.expert_block - self.expert_block // self.size

    def block_local(self, block: int) -> int:
        """One block's unsharded elements on one rank: the dense part and its E / EP experts."""
        return block - self.elsewhere_block

    def local(self, shape: ModelShape) -> int:
        """Ψ_EP: the parameters one rank ever unshards (the dense part and its experts of every block)."""
        return shape.num_params - self.num_layers * self.elsewhere_block

    def formula(self, shape: ModelShape) -> str:
        E, T = self.num_experts, self.size
        return (f"Ψ_EP = Ψ - {self.num_layers} x (1 - 1/{T}) x {num(self.expert_block)} (each block's {E} experts, "
                f"of which this rank holds {self.local_experts}) = {num(self.local(shape))} unsharded at most")


NO_EP = None


def expert_parallel(shape: ModelShape, size: int) -> ExpertParallel | None:
    """The EP division of ``shape`` over ``size`` ranks (None for size 1). Refuses what the recipe's schema and the
    launch refuse: a dense model, experts that do not divide."""
    if size <= 1:
        return NO_EP
    if not shape.num_experts:
        raise ConfigError(f"model.moe.ep_size = {size} (expert parallelism) needs a mixture of experts; "
                          f"model.arch = {shape.arch} here is dense: set model.moe.ep_size=1")
    if shape.num_experts % size:
        raise ConfigError(f"model.moe.ep_size ({size}) must divide model.moe.num_experts ({shape.num_experts}): every "
                          "expert-parallel rank holds the same number of whole experts")
    from pretrain.distributed.expert_parallel import transformers_problem

    problem = transformers_problem(size)  # the launch's own refusal (the architecture's plan: every MOE_ARCHS has one)
    if problem:
        raise ConfigError(problem)
    expert_block = shape.num_experts * 3 * shape.hidden_size * shape.intermediate_size
    return ExpertParallel(size, shape.num_experts, expert_block, shape.num_layers)


def all_to_all_bytes(shape: ModelShape, tokens: int, precision_bytes: int) -> int:
    """One all-to-all's rows: the micro-batch's ``tokens`` x top-k (token, expert) pairs of d in the compute dtype
    (what a rank sends, and on average receives, in one dispatch or combine)."""
    return tokens * shape.experts_per_token * shape.hidden_size * precision_bytes


def all_to_all_term(shape: ModelShape, tokens: int, precision_bytes: int, ep: ExpertParallel | None) -> Term | None:
    """EP's send and receive buffers of the all-to-all in flight (the module docstring), or None without EP.
    ``tokens``: one rank's micro-batch."""
    if ep is None:
        return None
    one = all_to_all_bytes(shape, tokens, precision_bytes)
    total = 2 * one
    return Term.phased(
        "all_to_all", "EP all-to-all buffers", Phases(total, total, 0),
        f"one all-to-all in flight (dispatch or combine, forward or backward), its send and receive buffers: "
        f"2 x T {num(tokens)} x top-{shape.experts_per_token} x d {num(shape.hidden_size)} x {precision_bytes} B; "
        f"(EP {ep.size} - 1) / {ep.size} of the rows leave the rank; the average: the rank of an expert the router "
        "favours receives more")


def check_context_parallel(seq_len: int, cp_size: int, attention: str, document_masking: bool) -> None:
    """What accelerate's CP (torch's context_parallel, ring attention over SDPA) cannot split: the launch's own refusals
    (pretrain/distributed/context_parallel.py), so that the planner never ranks a layout the launch refuses."""
    from pretrain.distributed.context_parallel import recipe_problems

    problems = recipe_problems(seq_len, cp_size, attention, document_masking)
    if problems:
        raise ConfigError(problems)


def float8_term(mode: str, shape: ModelShape, tokens: int, tp: TensorParallel | None) -> Term | None:
    """torchao's transient float8 copies (the module docstring), or None when float8 is off. ``tokens`` is one rank's
    micro-batch (after CP). The LM head is left in bf16 (precision.float8_skip's default), so only block Linears
    count."""
    if mode == "off":
        return None
    d, f = shape.hidden_size, shape.intermediate_size
    T_size = tp.size if tp else 1
    attention, mlp = shape.block_matmuls()
    largest_weight = -(-max(attention + mlp) // T_size)
    widest = max(d, -(-f // T_size), -(-shape.num_heads * shape.head_dim // T_size))
    scales = 4 * 4  # tensorwise: one fp32 scale per cast
    if mode == "rowwise":
        scales = 4 * 2 * (max(d, f) + tokens)  # one fp32 scale per row of each cast
    total = 2 * largest_weight + 2 * tokens * widest + scales
    tp_text = f" / TP {T_size}" if T_size > 1 else ""
    return Term.phased(
        "float8", f"float8 casts ({mode})", Phases(total, total, 0),
        f"transient (torchao saves the bf16 input and weight for backward): 2 x 1 B x largest block Linear "
        f"{num(max(attention + mlp))}{tp_text} + 2 x 1 B x T {num(tokens)} x widest Linear side {num(widest)} "
        f"+ {mode} scales {num(scales)} B; conservative: no FSDP2 float8 all-gather saving counted")
