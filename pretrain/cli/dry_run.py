"""`--dry-run`: will this recipe run on N x GPU, with which layout, how fast, with how much memory?

    python pretrain/run.py --recipe recipes/7b.yaml --dry-run --num-processes 8 --gpu H100-80GB
    python pretrain/run.py --recipe recipes/7b.yaml --dry-run --config_file accelerate_configs/fsdp.yaml --gpu H100-80GB
    python pretrain/run.py --recipe recipes/70b.yaml --dry-run --nodes 4 --num-processes 32 --gpu H100-80GB

One answer from the pieces every launcher uses, before any process exists: the recipe's checks and batch
plan on the launch (``preflight.check_run``), the parameter count (transformers' model on the meta device, as
pretrain-launch builds it), the memory estimate of this very layout (``pretrain/memory``, as
``pretrain-estimate`` prints it), the fit against the GPU with pretrain-launch's verdict and pretrain-plan's
best layout for the same GPUs (``cli/prelaunch.py``'s ``best_layout``: the same text pretrain-launch refuses a
launch with), and the planner's step-time model for this layout (``plan/planner.py``'s ``throughput``). When no
layout fits, pretrain-plan's advice says what would: the fewest GPUs, CPU offload and the memory it needs, a
larger GPU.

The launch: ``--config_file`` (an accelerate config: DDP, FSDP or DeepSpeed), with ``--num-processes`` /
``--nodes`` overriding its counts as accelerate's options do; without a config file, DDP on
``--num-processes``; without any of them, the launch this process was started by (``accelerate launch``'s
environment, or one process). The GPU: ``--gpu NAME`` / ``--gpu-memory-gib``, else this machine's GPU 0,
else none (the estimate is then for a CPU process and nothing is checked against a capacity).
"""

from __future__ import annotations

import argparse

from pretrain.distributed.layout import Launch
from pretrain.errors import EXIT_USAGE, ConfigError


def accelerate_options(args: argparse.Namespace) -> list[str]:
    """The options as ``accelerate launch`` would take them."""
    out = ["--config_file", args.config_file] if args.config_file else []
    if args.num_processes is not None:
        out += ["--num_processes", str(args.num_processes)]
    if args.nodes is not None:
        out += ["--num_machines", str(args.nodes)]
    return out


def planned_launch(args: argparse.Namespace, started_by: Launch) -> Launch:
    """The launch to plan for: the options' (the accelerate config's, with counts overridden), else the one
    this process was started by."""
    options = accelerate_options(args)
    if not options:
        return started_by
    return Launch.from_accelerate_config(args.config_file, options)


def format_duration(seconds: float) -> str:
    """Seconds, minutes, hours, days or years, whichever reads best."""
    for unit, size, below in (("s", 1, 120), ("min", 60, 7200), ("h", 3600, 72 * 3600), ("days", 86400, 730 * 86400)):
        if seconds < below:
            return f"{seconds:.3g} s" if unit == "s" else f"{seconds / size:,.1f} {unit}"
    return f"{seconds / (365 * 86400):,.1f} years"


def parameter_count(recipe) -> tuple[int, int, int, object]:
    """(parameters, of which active per token, vocabulary rows, transformers config) of transformers' model built on the meta device
    (``model.meta_model``), as pretrain-launch builds it: a config transformers cannot build (a config override it
    rejects, a size no machine holds) is refused here, before anything is queued."""
    from pretrain.model.build import count_active_parameters, count_parameters, meta_model

    model, vocab = meta_model(recipe)
    return count_parameters(model), count_active_parameters(model), vocab, model.config


def measured_flops_line(recipe, model_config) -> list[str]:
    """An architecture without a closed form: its FLOPs per token as the run will measure them for MFU."""
    from pretrain.model.measure import measure
    from pretrain.recipe.shape import COUNTED_ARCHS

    if recipe.model.arch in COUNTED_ARCHS:
        return []
    try:
        flops = measure(model_config, recipe.data.seq_len).flops_per_token(recipe.model.activation_checkpointing)
    except ConfigError as exc:
        return [f"FLOPs/token      not measured, so no MFU: {exc}"]
    return [f"FLOPs/token      {flops.model_flops:,.0f} (measured on the meta device, no closed form: the run logs MFU)"]


def resume_report(recipe, args: argparse.Namespace, launch: Launch, gpu) -> tuple[str, bool]:
    """The resume line (pretrain-launch's check, ``cli/prelaunch.py``'s ``check_resume``: the checkpoint the run
    would resume and what it does with it, a fresh start, or pretrain-launch's refusal with the pretrain-launch
    command that resumes it) and whether it is a refusal."""
    from pretrain.checkpoint.state import TrainerState
    from pretrain.cli.prelaunch import LaunchSpelling, check_resume

    spelling = LaunchSpelling(accelerate_options(args), ["--recipe", args.recipe, *args.overrides], args,
                              cpu=gpu is None, detect=False)
    try:
        plan = check_resume(recipe, launch, spelling)
    except ConfigError as exc:
        return "refused: " + str(exc).replace("\n", "\n" + " " * 17), True
    if plan is None:
        why = "checkpoint.resume=none" if recipe.checkpoint.resume == "none" else f"no checkpoint in {recipe.output_dir}"
        return f"fresh start ({why})", False
    try:
        shown = plan.checkpoint.relative_to(recipe.output_dir)
    except ValueError:
        shown = plan.checkpoint
    return f"from {shown} (step {TrainerState.read(plan.checkpoint).step}; {plan.describe()})", False


def init_from_lines(recipe, launch: Launch, resume: str) -> list[str]:
    """model.init_from: the checkpoint, and its load's memory per rank (pretrain/plan/memory/loading.py)."""
    from pretrain.plan.memory.loading import load_memory

    if recipe.model.init_from is None:
        return []
    lines = [f"init_from        {recipe.model.init_from} (its config.json; tokenizer {recipe.data.tokenizer})"]
    if resume.startswith("from "):
        return [*lines, "                 not read: the run resumes its own checkpoint (checkpoint.resume wins)"]
    try:
        loading = load_memory(recipe, launch)
    except ConfigError as exc:
        return [*lines, f"                 no load estimate: {exc}"]
    return [*lines, f"load             {loading.line()}"]


def report(recipe, recipe_path: str, overrides: list[str], launch: Launch, gpu, config_file: str | None,
           detected: bool = False, resume: str = "") -> list[str]:
    """The dry run's lines. ``gpu``: the GPU to check against (None: a CPU process); ``detected``: it is this
    machine's, not one named on the command line; ``resume``: the resume line (``resume_report``)."""
    from pretrain.cli.prelaunch import best_layout, does_not_fit, planner_gpu
    from pretrain.distributed.accelerator import compile_choice
    from pretrain.plan.memory import estimate
    from pretrain.plan.planner import calibration, plan, throughput
    from pretrain.train.preflight import check_run

    launch = launch.for_recipe(recipe)
    run_plan = check_run(recipe, launch)
    if launch.cp_size > 1:  # as pretrain-launch refuses it: a plan for CPU processes (no GPU named or found)
        from pretrain.distributed.context_parallel import check_launch_device

        check_launch_device(launch, cuda=gpu is not None)
    batch, steps = run_plan.batch, run_plan.num_steps
    num_params, num_active, vocab, model_config = parameter_count(recipe)
    active = f", {num_active:,} active per token" if num_active != num_params else ""
    where = f" ({config_file})" if config_file else ""
    lines = [
        f"recipe           {recipe.name}",
        f"model            {recipe.model.arch}, {num_params:,} parameters{active} (vocab {vocab:,})",
        *init_from_lines(recipe, launch, resume),
        f"layout           {launch.describe('GPU' if gpu else 'CPU process')}{where}",
        f"batch plan       world {batch.world_size}: GBS {batch.global_batch_size} = MBS {batch.micro_batch_size} "
        f"x GAS {batch.grad_accum_steps} x world {batch.world_size}",
        f"tokens per step  {batch.tokens_per_step:,} ({batch.global_batch_size} x {batch.seq_len} tokens)",
        f"optimizer steps  {steps:,} ({steps * batch.tokens_per_step:,} tokens)",
        f"output_dir       {recipe.output_dir}",
        *([f"resume           {resume}"] if resume else []),
        f"compile          {compile_choice(recipe.model.compile, 'cuda' if gpu else 'cpu', launch)[1]}",
        "",
    ]
    try:
        est = estimate(recipe, batch, launch, gpu=gpu, device="cuda" if gpu else "cpu")
    except ConfigError as exc:
        return [*lines, f"memory           no estimate: {exc}", *measured_flops_line(recipe, model_config)]
    device = f"GPU ({gpu.name})" if gpu else "process (CPU: no GPU named or seen; --gpu NAME plans for one)"
    lines += [f"memory per {device}, pretrain-estimate's estimate (--explain there shows each formula):"]
    lines += [f"  {line}".rstrip() for line in est.summary().splitlines()[3:]]  # model, layout, workload: above
    if gpu is None:
        return lines
    lines.append("")
    _, plan_gpu = planner_gpu(gpu)  # a detected GPU the table lacks: its capacity, the default card's rates
    if gpu.bf16_tflops is not None and gpu.intra_node_gb_s is not None:  # a card whose rates the table has
        calibrated = calibration(recipe, gpu)
        *_, tokens_per_s = throughput(est, gpu, calibrated.base_mfu)
        step_s = batch.tokens_per_step / (tokens_per_s * batch.world_size)
        lines += [f"speed            ~{tokens_per_s:,.0f} tokens/s per GPU: ~{format_duration(step_s)} per optimizer step, "
                  f"the run's {steps:,} steps in ~{format_duration(steps * step_s)}",
                  f"                 (pretrain-plan's step-time model: matmuls at {calibrated.base_mfu:.1%} of the "
                  f"{gpu.name}'s dense bf16 peak, less for small micro-batches, plus exposed communication; it ranks "
                  f"layouts, it does not measure them. The {calibrated.base_mfu:.1%}: {calibrated.source})"]
    if not est.fits:
        lines.append("verdict          " + does_not_fit(recipe, est, detected)
                     + ": pretrain-launch refuses this launch")
        lines.append(best_layout(recipe, recipe_path, overrides, launch, gpu))
        return lines
    ranked, considered = plan(recipe, launch.num_nodes, launch.gpus_per_node, plan_gpu)
    if ranked:
        lines.append(f"pretrain-plan    best of {len(ranked)} layouts that fit {launch.num_nodes} x {launch.gpus_per_node} "
                     f"{gpu.name} (of {considered}): {ranked[0].describe()}")
    return lines


def dry_run(recipe, args: argparse.Namespace, started_by: Launch) -> int:
    """Print the report; the exit status: 2 when pretrain-launch would refuse the resume (the run would not start,
    so "will it run" is no), else 0."""
    from pretrain.cli.prelaunch import launch_gpu
    from pretrain.plan import auto_batch
    from pretrain.system.environment import INSTALL_HINT, package_problems

    launch = planned_launch(args, started_by).for_recipe(recipe)  # model.moe.ep_size: the recipe's part of the layout
    # The packages the run would need (an hf: source's datasets, wandb, Liger, torchao, the planned launch's
    # DeepSpeed): a plan made on a laptop for a cluster is not refused for them; the report names each to install
    # where the run starts (which refuses without them). The core packages were checked before the recipe was read.
    missing = package_problems(recipe, launch)
    gpu = launch_gpu(args, accelerate_options(args))
    detected = args.gpu is None and args.gpu_memory_gib is None
    recipe, auto_note = auto_batch.resolve(recipe, launch, gpu, "cuda" if gpu else "cpu")
    resume, refused = resume_report(recipe, args, launch, gpu)
    lines = report(recipe, args.recipe, list(args.overrides), launch, gpu, args.config_file, detected, resume)
    if auto_note:  # under the batch plan it chose
        at = next(i for i, line in enumerate(lines) if line.startswith("batch plan"))
        lines.insert(at + 1, f"                 {auto_note}")
    if missing:
        lines += ["", "packages         the run needs what this environment lacks (install before launching; "
                      "the launch refuses without them):", *(f"  - {problem}" for problem in missing),
                  f"  {INSTALL_HINT}"]
    print("\n".join(lines))
    return EXIT_USAGE if refused else 0
