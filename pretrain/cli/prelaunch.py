"""pretrain-launch's checks, before any process starts (the command: pretrain/cli/launch.py; --dry-run and
pretrain-slurm ask the same functions): the accelerate config's layout, the environment, the checkpoint a
resume would load (with the command that resumes it on another layout), check_run, the model on the meta
device, the memory estimate against the GPU (refused with pretrain-plan's best layout unless --force), and
the token store of a multi-node launch. A problem is one ConfigError.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pretrain.distributed.layout import option_value
from pretrain.errors import ConfigError
from pretrain.recipe.recompute import recompute_label
from pretrain.system.hardware import resolve_gpu

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "accelerate_configs"
"""The shipped accelerate configs (a refusal names the one that resumes a checkpoint)."""

if TYPE_CHECKING:
    from pretrain.checkpoint.reshard import CheckpointLayout, ResumePlan
    from pretrain.distributed.layout import Launch
    from pretrain.plan.memory import MemoryEstimate
    from pretrain.system.hardware import GpuSpec

USAGE = ("usage: pretrain-launch --config_file FILE [accelerate launch options] [--gpu NAME | --gpu-memory-gib GIB] "
         "[--force] [--doctor] --recipe R [key=value ...]")
OWN_OPTIONS = {"--gpu": "gpu", "--gpu-memory-gib": "gpu_memory_gib", "--force": "force", "--doctor": "doctor"}
FLAGS = ("--force", "--doctor")
"""pretrain-launch's options (taken out of the arguments before they reach accelerate launch)."""


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate launch arguments, run.py arguments starting at --recipe)."""
    if "--recipe" not in argv:
        raise ConfigError(USAGE)
    cut = argv.index("--recipe")
    return argv[:cut], argv[cut:]


def own_options(accelerate_args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(--gpu, --gpu-memory-gib, --force) and the accelerate arguments without them."""
    options = argparse.Namespace(gpu=None, gpu_memory_gib=None, force=False, doctor=False)
    rest, args = [], iter(accelerate_args)
    for arg in args:
        name, has_value, value = arg.partition("=")
        if name not in OWN_OPTIONS:
            rest.append(arg)
        elif name in FLAGS:
            if has_value:
                raise ConfigError(f"{name} takes no value (got {arg!r})")
            setattr(options, OWN_OPTIONS[name], True)
        else:
            value = value if has_value else next(args, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"{name} needs a value\n{USAGE}")
            setattr(options, OWN_OPTIONS[name], value)
    if options.gpu_memory_gib is not None:
        try:
            options.gpu_memory_gib = float(options.gpu_memory_gib)
        except ValueError:
            raise ConfigError(f"--gpu-memory-gib must be a number of GiB, got {options.gpu_memory_gib!r}") from None
    return options, rest


def launch_gpu(options: argparse.Namespace, accelerate_args: list[str]) -> GpuSpec | None:
    """The GPU to check against: --gpu / --gpu-memory-gib (looked up as pretrain-estimate does), else this
    machine's GPU 0 when CUDA sees one and the launch is not a CPU launch, else None (no check)."""

    if options.gpu is not None or options.gpu_memory_gib is not None:
        try:
            return resolve_gpu(options)
        except ConfigError as exc:
            if options.gpu is not None and (options.gpu.replace(",", "").isdigit() or options.gpu == "all"):
                raise ConfigError(f"{exc} (--gpu is pretrain-launch's GPU model; accelerate selects devices with "
                                  "--gpu_ids)") from None
            raise
    if "--cpu" in accelerate_args or _config_uses_cpu(option_value(accelerate_args, "--config_file")):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from pretrain.system.hardware import gpu_for_device

    props = torch.cuda.get_device_properties(0)
    return gpu_for_device(props.name, props.total_memory)


def _config_uses_cpu(path: str | None) -> bool:
    from pretrain.distributed.layout import config_uses_cpu, read_accelerate_config

    return path is not None and config_uses_cpu(read_accelerate_config(path))


def planner_gpu(gpu: GpuSpec) -> tuple[list[str], GpuSpec]:
    """The pretrain-plan options that name ``gpu``, and the GPU they give the planner: a table name, or
    (a detected device the table lacks) its capacity with --gpu-memory-gib, and its card's table name for
    the rates when the table has that card."""
    from pretrain.system.hardware import GPUS

    same_card = [g for g in GPUS.values() if gpu.card is not None and g.card == gpu.card]
    named = GPUS.get(gpu.name) or next((g for g in same_card if g.memory_mib == gpu.memory_mib), None)
    if named is not None:
        args = ["--gpu", named.name]
    else:
        args = (["--gpu", same_card[0].name] if same_card else []) + ["--gpu-memory-gib", str(gpu.memory_gib)]
    options = own_options(args)[0]
    return args, resolve_gpu(options)


def best_layout(recipe, recipe_path: str, overrides: list[str], launch: Launch, gpu: GpuSpec) -> str:
    """What to run instead: pretrain-plan's best layout on the same nodes x GPUs per node, the commands that
    write its accelerate config and launch it; or pretrain-plan's advice when nothing fits."""
    from pretrain.plan import planner as plan

    nodes, gpus = launch.num_nodes, launch.gpus_per_node
    gpu_args, gpu = planner_gpu(gpu)
    ranked, considered = plan.plan(recipe, nodes, gpus, gpu, base_mfu=plan.calibration(recipe, gpu).base_mfu)
    if not ranked:
        return plan.nothing_fits(recipe, nodes, gpus, gpu, considered)
    best = ranked[0]
    config = plan.default_output(recipe, nodes, gpus, gpu)
    plan_cmd = ["pretrain-plan", "--recipe", recipe_path, "--nodes", str(nodes), "--gpus-per-node", str(gpus),
                *gpu_args, *overrides]
    changes = plan.recipe_overrides(recipe, best)
    changed = {c.split("=", 1)[0] for c in changes}
    launch_cmd = ["pretrain-launch", "--config_file", str(config), "--recipe", recipe_path,
                  *(o for o in overrides if o.split("=", 1)[0] not in changed), *changes]
    recompute = recompute_label(best.checkpointing)
    return "\n".join([
        f"pretrain-plan's best layout on {nodes} x {gpus} {gpu.name}: {best.name}, MBS {best.micro_batch_size}, "
        f"GAS {best.grad_accum_steps}, {recompute}: {best.estimate.total_gib:.1f} GiB "
        f"({best.estimate.headroom_gib:.1f} free; {len(ranked)} of {considered} layouts fit). Write its accelerate "
        "config, then launch it" + (" (with your node options, on every node)" if nodes > 1 else "") + ":",
        f"  {shlex.join(plan_cmd)}",
        f"  {shlex.join(launch_cmd)}",
    ])


def does_not_fit(recipe, est: MemoryEstimate, detected: bool) -> str:
    """The estimate against the GPU, in one line, in the estimator's words."""
    workload = est.workload
    recompute = recompute_label(workload.activation_checkpointing)
    where = " (GPU 0 of this machine; --gpu NAME checks another)" if detected else ""
    return (f"{recipe.name} on {est.layout.describe()} (MBS {workload.micro_batch_size}, GAS "
            f"{workload.grad_accum_steps}, {recompute}): estimated {est.total_gib:.1f} GiB per GPU, {est.verdict}{where}")


def check_memory(recipe, run_plan, options: argparse.Namespace, accelerate_args: list[str], recipe_path: str,
                 overrides: list[str]) -> None:
    """Refuse a launch the estimator says does not fit its GPU (ConfigError naming a layout that does); with
    --force, warn and go on. No GPU known: nothing to check."""
    from pretrain.plan.memory import estimate

    gpu = launch_gpu(options, accelerate_args)
    if gpu is None:
        return
    try:
        est = estimate(recipe, run_plan.batch, run_plan.launch, gpu=gpu)
    except ConfigError as exc:
        print(f"warning: no memory estimate for this layout, so no fit check: {exc}", file=sys.stderr)
        return
    if est.fits:
        return
    detected = options.gpu is None and options.gpu_memory_gib is None
    summary = does_not_fit(recipe, est, detected)
    if options.force:
        print(f"warning: --force: {summary}; launching anyway", file=sys.stderr, flush=True)
        return
    raise ConfigError("\n".join([
        f"{summary} (pretrain-estimate --explain shows each term).",
        best_layout(recipe, recipe_path, overrides, run_plan.launch, gpu),
        "Or launch this layout anyway: add --force before --recipe.",
    ]))


def preflight(accelerate_args: list[str], run_args: list[str], options: argparse.Namespace | None = None) -> Launch:
    """Raise ConfigError for anything that would fail inside the launched processes, or not fit their GPUs;
    returns the launch."""
    from pretrain.distributed.layout import Launch
    from pretrain.system.environment import check_environment

    options = options or own_options([])[0]
    launch = Launch.from_accelerate_config(option_value(accelerate_args, "--config_file"), accelerate_args)
    check_environment(None, launch)  # the core packages and the engine's, before anything imports them
    from pretrain.recipe.config import AUTO, load_recipe
    from pretrain.train.preflight import check_run

    recipe_path, overrides = run_args[1] if len(run_args) > 1 else "", run_args[2:]
    recipe_overrides = [o for o in overrides if not o.startswith("--")]
    recipe = load_recipe(recipe_path, recipe_overrides)
    launch = launch.for_recipe(recipe)  # model.moe.ep_size (expert parallelism is the recipe's: see Launch.ep_size)
    cpu = "--cpu" in accelerate_args or _config_uses_cpu(option_value(accelerate_args, "--config_file"))
    check_environment(recipe, launch, gpu_launch=not cpu)
    if launch.cp_size > 1:  # the processes start on this machine: CP needs its GPUs
        import torch

        from pretrain.distributed.context_parallel import check_launch_device

        check_launch_device(launch, cuda=not cpu and torch.cuda.is_available())
    # The checkpoint to resume against this launch first: its refusal, with the command that resumes it, comes
    # in ~2 s (before torch._dynamo, which the optimizer check imports, and transformers).
    check_resume(recipe, launch, LaunchSpelling(accelerate_args, run_args, options, cpu))
    if recipe.batch.micro_batch_size == AUTO:  # checked as the processes will choose it (each says its choice)
        from pretrain.plan import auto_batch

        gpu = None if cpu else launch_gpu(options, accelerate_args)
        recipe, _ = auto_batch.resolve(recipe, launch, gpu, "cuda" if gpu else "cpu")
    run_plan = check_run(recipe, launch)
    # A model config transformers cannot build is refused here, not in every process, built as the run builds it
    # (gemma2 refuses sdpa but trains with eager); flash-attn is the nodes' to check (this machine may lack it).
    from pretrain.model.build import meta_model

    meta_model(recipe, attention="sdpa" if recipe.model.attention == "flash_attention_2" else None)
    check_memory(recipe, run_plan, options, accelerate_args, recipe_path, recipe_overrides)
    check_data(recipe, launch, recipe_path, recipe_overrides)
    return launch


# accelerate launch options that choose the engine and its settings: a command resuming on another engine
# drops them and takes that engine's config file instead.
_ENGINE_FLAGS = ("--use_deepspeed", "--use_fsdp", "--multi_gpu", "--cpu")
_ENGINE_OPTION_PREFIXES = ("--distributed_type", "--deepspeed_", "--fsdp_", "--zero_stage", "--zero3_", "--offload_",
                           "--gradient_accumulation_steps", "--gradient_clipping", "--parallelism_config_",
                           "--num_processes")


class LaunchSpelling:
    """How pretrain-launch spells the launch that resumes a checkpoint: this launch's accelerate options with the
    engine's replaced by another config and process count, its own options and the run's arguments."""

    intro = "This launch resumes it:"

    def __init__(self, accelerate_args: list[str], run_args: list[str], options: argparse.Namespace, cpu: bool,
                 detect: bool = True):
        """``cpu``: the launch runs on CPUs; ``detect``: so does any launch from a machine CUDA sees no GPU on (a
        dry run that plans for a named GPU detects nothing)."""
        self.accelerate_args, self.run_args, self.options, self.cpu = accelerate_args, run_args, options, cpu
        self.detect = detect

    def on_cpu(self) -> bool:
        if self.cpu or not self.detect:
            return self.cpu
        import torch

        return not torch.cuda.is_available()  # zero2.yaml runs over gloo on a CPU machine, DDP needs cpu_ddp.yaml

    def __call__(self, config: Path, world: int) -> tuple[Launch, list[str]] | None:
        from pretrain.distributed.layout import Launch

        args = _without_engine_options(self.accelerate_args) + ["--num_processes", str(world)]
        gpu = ([] if self.options.gpu is None else ["--gpu", self.options.gpu]) + \
            ([] if self.options.gpu_memory_gib is None else ["--gpu-memory-gib", str(self.options.gpu_memory_gib)])
        command = ["pretrain-launch", "--config_file", shown_config(config), *args, *gpu, *self.run_args]
        return Launch.from_accelerate_config(config, args), command


class Spelling(Protocol):
    """How an entry point spells the command that resumes a checkpoint (pretrain-launch: ``LaunchSpelling``;
    pretrain-slurm submit: ``slurm.SubmitSpelling``): everything but the layout is the entry point's own."""

    intro: str  # the line before the command

    def on_cpu(self) -> bool:
        """The resuming processes run on CPUs (a DDP checkpoint resumes under cpu_ddp.yaml, not ddp.yaml)."""

    def __call__(self, config: Path, world: int) -> tuple[Launch, list[str]] | None:
        """The launch of ``config`` on ``world`` processes and the command that makes it, or None when this entry
        point cannot spell it."""


def check_resume(recipe, launch: Launch, spelling: Spelling) -> ResumePlan | None:
    """The checkpoint the run would resume against this launch (``Resume.plan``, the object every process
    resumes with): its plan, None for a fresh start, or a refusal before any process starts, with the command
    that resumes it in the entry point's spelling (checked by the same object before it is printed)."""
    from pretrain.checkpoint.reshard import LayoutRefused
    from pretrain.checkpoint.resume import Resume

    checkpoint = Resume.checkpoint(recipe)
    if checkpoint is None:
        return None
    try:
        return Resume.plan(recipe, launch, checkpoint)
    except LayoutRefused as exc:
        command = resuming_command(exc, checkpoint, recipe, launch, spelling)
        if command is None:
            raise
        raise ConfigError(f"{exc}.\n{spelling.intro}\n  {shlex.join(command)}") from None


def resuming_config(saved: CheckpointLayout, launch: Launch, cpu: bool) -> str | None:
    """The shipped accelerate config of the layout that wrote a checkpoint, or None when none resumes it."""
    if saved.engine == "ddp":
        return ("cpu_ddp.yaml" if cpu else "ddp.yaml") if launch.world_size > 1 else \
            ("cpu.yaml" if cpu else "single_gpu.yaml")
    if saved.engine == "fsdp":
        return "fsdp.yaml"
    if saved.offload_optimizer == "nvme":
        return None  # the shipped configs offload no state to NVMe; the refusal names what to keep
    if saved.zero_stage in (None, 1, 2, 3):
        return f"zero{saved.zero_stage or 2}.yaml"
    return None  # ZeRO-0: no shipped config; the refusal names the layout


def resuming_command(refusal, checkpoint: Path, recipe, launch: Launch, spelling: Spelling) -> list[str] | None:
    """The command (``spelling``'s) with the shipped accelerate config of the layout that wrote ``checkpoint``
    (this launch's number of processes unless only the saved one resumes), or None when no shipped config
    resumes it, the entry point cannot spell it, or the batch does not divide there."""
    from pretrain.checkpoint.resume import Resume
    from pretrain.train.preflight import check_layout

    name = resuming_config(refusal.saved, launch, spelling.on_cpu())
    if name is None:
        return None
    world = refusal.saved.world_size if refusal.same_world else launch.world_size
    try:
        spelled = spelling(CONFIGS_DIR / name, world)
        if spelled is None:
            return None
        resuming, command = spelled
        check_layout(recipe, resuming)  # what the launch changes; the rest of check_run is the recipe's alone
        Resume.plan(recipe, resuming, checkpoint)
    except ConfigError:
        return None
    return command


def _without_engine_options(args: list[str]) -> list[str]:
    out, rest = [], iter(args)
    for arg in rest:
        name, has_value, _ = arg.partition("=")
        if name in _ENGINE_FLAGS:
            continue
        if name.startswith(_ENGINE_OPTION_PREFIXES) or name == "--config_file":
            if not has_value:
                next(rest, None)
            continue
        out.append(arg)
    return out


def shown_config(path: Path) -> str:
    """A shipped config as a user in the repository's root types it, else its absolute path."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def check_data(recipe, launch: Launch, recipe_path: str, overrides: list[str]) -> None:
    """A multi-node launch needs its token store prepared (no node tokenizes): refuse it with the commands
    that prepare it; a named store made for other data is refused on any launch."""
    if launch.num_nodes == 1 and not recipe.data.store:
        return  # the run prepares it before its process group (ensure_data)
    from pretrain import data
    from pretrain.data.prepare import prepare_commands

    data.check_data(recipe.data, launch.num_nodes, prepare_commands(recipe_path, overrides, launch.num_nodes))
