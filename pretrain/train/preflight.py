"""Every check a run can pass or fail without compute, in one place, for one recipe and one launch.

``pretrain-launch`` and ``pretrain-slurm`` call it before any process exists (with the launch read from
the accelerate config); each training process calls it again first thing (with the launch read from
its environment), so a run started by plain ``accelerate launch`` is held to the same checks.
"""

from __future__ import annotations

from pretrain.distributed.layout import Launch
from pretrain.distributed.run_plan import RunPlan
from pretrain.errors import ConfigError
from pretrain.recipe.batching import num_training_steps, plan_batches
from pretrain.recipe.config import Recipe


def check_run(recipe: Recipe, launch: Launch) -> RunPlan:
    """Raise one ConfigError for the first section that cannot run on ``launch``; else the plan."""
    from pretrain.model.optim import check_optimizer_args, check_schedule
    from pretrain.train.downstream import read_tasks

    launch = launch.for_recipe(recipe)  # model.moe.ep_size: checked against the launch here
    layout = check_layout(recipe, launch)
    num_steps = num_training_steps(recipe.train.max_steps, recipe.train.max_tokens, layout.batch)
    check_optimizer_args(recipe.optim, layout.lr)
    check_schedule(recipe.lr_schedule, num_steps)
    tasks = tuple(read_tasks(recipe.eval)) if recipe.eval.tasks else ()  # a missing or malformed file: exit 2 here
    if recipe.model.init_from is not None:
        from pretrain.model.pretrained import check_weight_files

        check_weight_files(recipe.model.init_from)  # pickle weights, an index naming files outside: exit 2 here
    plan = RunPlan(launch, layout.batch, num_steps, layout.lr, layout.mixed_precision, layout.deepspeed, recipe,
                   tasks)
    if recipe.model.loss != "auto":  # auto always resolves (on first use: Liger's import takes seconds)
        from pretrain.model.loss import loss_choice

        loss_choice(recipe, launch)  # an explicit liger (or plain) may not run here
    return plan


def check_layout(recipe: Recipe, launch: Launch) -> RunPlan:
    """The checks of ``check_run`` that depend on the launch's layout, and no torch optimizer (building one
    imports torch._dynamo: seconds): the batch plan for its world size, the precision on its engine and
    device, a DeepSpeed JSON against the recipe. A partial plan: the batch plan, the peak lr, the precision
    and the DeepSpeed config (``num_steps`` and ``loss`` are ``check_run``'s)."""
    from pretrain.distributed.accelerator import check_precision, deepspeed_config
    from pretrain.model.optim import scaled_lr

    launch = launch.for_recipe(recipe)
    if recipe.stability.rollback.skip == "documents" and (launch.tp_size > 1 or launch.cp_size > 1):
        raise ConfigError(f"stability.rollback.skip=documents scores each document of a window on its whole rows, "
                          f"which a rank under tensor or context parallelism (tp_size {launch.tp_size}, cp_size "
                          f"{launch.cp_size}) does not hold; use skip=window here")
    if launch.tp_size > 1:
        check_tensor_parallel(recipe, launch)
    if launch.cp_size > 1:
        check_context_parallel(recipe, launch)
    if launch.ep_size > 1:
        check_expert_parallel(recipe, launch)
    batch = plan_batches(recipe.batch, launch.data_parallel_size, recipe.data.seq_len)
    lr = scaled_lr(recipe.optim, batch.global_batch_size)
    mixed_precision = check_precision(recipe, launch)
    if recipe.precision.float8 != "off":  # the device is asked only then (it initialises CUDA)
        from pretrain.model.float8 import check_float8, cuda_device

        check_float8(recipe, launch, cuda_device())
    # The user's JSON against the recipe: conflicts are errors.
    deepspeed = deepspeed_config(recipe, batch, launch, lr) if launch.uses_deepspeed else None
    return RunPlan(launch, batch, 0, lr, mixed_precision, deepspeed)


def check_tensor_parallel(recipe: Recipe, launch: Launch) -> None:
    """A TP launch of an architecture transformers has no TP plan for (or one pretrain cannot match with one process)
    is refused before anything starts; the plan is the config class's, so nothing is built."""
    from transformers import CONFIG_MAPPING

    from pretrain.distributed.tensor_parallel import tp_plan_problem, tp_shape_problem

    config = CONFIG_MAPPING[recipe.model.arch]
    model = recipe.model
    problem = tp_plan_problem(config, model.arch, launch.tp_size) or tp_shape_problem(
        model.num_heads, model.num_kv_heads or model.num_heads, model.intermediate_size or 0, launch.tp_size)
    if problem:
        raise ConfigError(problem)


def check_expert_parallel(recipe: Recipe, launch: Launch) -> None:
    """An EP launch of an architecture transformers has no expert plan for (or a transformers without EP) is refused
    before anything starts; the layout's own refusals (engine, world, TP/CP) are check_launch's."""
    from transformers import CONFIG_MAPPING

    from pretrain.distributed.expert_parallel import ep_plan_problem

    problem = ep_plan_problem(CONFIG_MAPPING[recipe.model.arch], recipe.model.arch, launch.ep_size)
    if problem:
        raise ConfigError(problem)


def check_context_parallel(recipe: Recipe, launch: Launch) -> None:
    """What a CP launch cannot split, refused before anything starts: the recipe's sequence length, attention kernel
    and document masking, then the architecture (its transformers model on the meta device: transformers' own
    ``supports_context_parallel``, and the attention modules accelerate's hooks attach to). The device is the
    launcher's to check (``prelaunch.preflight``, ``accelerator.build_accelerator``): a login node planning a GPU job
    has no GPU itself."""
    from pretrain.distributed.context_parallel import model_problem, recipe_problems
    from pretrain.model.build import build_model

    problems = recipe_problems(recipe.data.seq_len, launch.cp_size, recipe.model.attention,
                               recipe.data.document_masking)
    if problems:
        raise ConfigError(problems)
    # The vocabulary does not change what is asked (layer types, module names): a small one keeps the build cheap.
    model = build_model(recipe.model, recipe.model.vocab_size or 256, recipe.data.seq_len, seed=recipe.train.seed,
                        meta=True)
    problem = model_problem(model, recipe.model.arch, launch.cp_size)
    if problem:
        raise ConfigError(problem)
