"""The GPU acceptance benchmark: tokens/s per GPU, MFU, HFU, cold compile time and peak memory (measured against
the estimator) of a 1B and a 3B Llama on one GPU, one setting at a time, in priority order, within a time budget.

    python tools/bench_gpu.py --budget 420                      # a short GPU visit: the most important rows first
    python tools/bench_gpu.py                                   # every row, 300 measured steps each (75-90 min)
    python tools/bench_gpu.py --models llama-1b --settings default,loss-plain,mbs-8 --steps 100
    python tools/bench_gpu.py --reduced --budget 60             # CPU: the tiny recipe, default and loss-plain (CI)
    python tools/bench_gpu.py --budget 420 --rows llama-1b/default,llama-8b-16l/float8-tensorwise   # these, in order

Priority order (``ordered_rows``): llama-1b's default setting (the recipe as shipped: compile and loss ``auto``);
float8 tensorwise, then rowwise (``precision.float8``, torchao; against the default's bf16); compile none, then regional; each checkpointing policy (full, selective, every_2, none); loss chunked, then
Liger; MBS 8, then 2; llama-3b's default (MBS 1); then the rest (loss plain, MBS 1, no step checks, and
llama-3b's other settings). A row whose run equals
an earlier one (same recipe once model.compile and model.loss are resolved for this device and launch, by the
run's own ``accelerator.compile_mode`` and ``loss.resolve_loss``: ac-none and compile-regional repeat the default on
one GPU) is not repeated. A row the estimator says does not fit the GPU (nvidia-smi's memory, or
``--device-memory-gib``) is a ``no-fit`` row, not a launch (llama-3b at MBS 8). With ``--budget SECONDS`` a row
starts only if its expected time fits in what is left (start-up + compile where it compiles + steps x step
time: assumed until the first row has run, then that row's measured start-up, compile and time per unit of the
planner's step-time work, ``pretrain.plan.planner``), the first row that does not fit and every later one are
``budget`` rows, and a row in flight is killed at the deadline (``timeout``). Under ``--budget`` the default
is 10 + 50 steps per row.

Each row is written the moment it finishes: ``bench_gpu.md``, ``bench_gpu.json`` and ``calibration.json``
rewritten atomically, then a line of ``bench_gpu.jsonl`` (flushed and fsynced), so a benchmark killed at any
point keeps every finished row, and a row in the jsonl is in the others too. SIGTERM (``timeout``, a scheduler) ends the row in flight and exits 130; after a
SIGKILL the row in flight is still running: ``running.json`` names its process group (``kill -- -PGID``).

Each (model, setting) is a fresh ``accelerate launch --config_file accelerate_configs/single_gpu.yaml
pretrain/run.py --recipe R <overrides>`` (``--reduced``: ``accelerate_configs/cpu.yaml``), so compile caches
and CUDA's peak-memory statistics never carry from one setting to the next. Every run trains at GAS 1 for
``--warmup-steps`` + ``--steps`` optimizer steps with logging on every step, no evaluation and no checkpoint
(pretrain-sweep's overrides, ``pretrain.plan.sweep.runner.sweep_overrides``); the figures are medians over the
measured steps of its ``metrics.jsonl``: ``perf/tokens_per_s_per_device``, ``perf/mfu``, ``perf/hfu``,
``perf/step_time_s``. **Cold compile** (``cold compile s``): the warm-up steps' wall time (each step's
``perf/step_time_max_s``, CUDA events from the step's start, so the host's compile is in it) beyond the steady
step, summed; on a row that does not compile it is the first steps' other one-off costs, the baseline to
subtract. **Memory**, on one basis: the largest ``memory/peak_gib`` (GPU: ``torch.cuda.max_memory_allocated``,
tensors only; CPU: peak RSS) against the run's ``memory/estimated_tensors_gib``, the estimator's tensor peak
*without* its allowance (1 GiB CUDA context + 5% allocator, ``pretrain.plan.memory.estimate``; neither is in
max_memory_allocated): error = (estimated - measured) / measured. ``est. total GiB`` is the estimate with the
allowance, what the fit is judged on. On CPU the measured peak is the process's RSS, imports included, which
the estimator does not model: the column means something on GPUs. HFU is MFU where nothing is recomputed (the
run logs ``perf/hfu`` only with activation checkpointing). Statuses: ``ok``; ``oom``; ``failed``; ``timeout``;
``refused`` (overrides this checkout cannot run here, e.g. loss-liger without liger-kernel, with the reason);
``no-fit``; ``budget``. The exit status is 0 when every row is ok, no-fit or budget.

Models (``MODELS``): ``llama-1b`` is recipes/llama-1b.yaml as shipped (Llama-3.2-1B, 1.24B parameters,
seq 2048, bf16, ``batch.micro_batch_size: auto``: the largest MBS whose estimate fits the GPU, 8 on an H100 80GB and
16 on an H200 141GB; the row records the choice, ``auto_micro_batch``; ``mbs-4`` is the size it shipped with before). ``llama-3b`` is the same recipe with Llama-3.2-3B's shape (hidden 3072, 28 layers, 24
heads, 8 KV heads, MLP 8192, tied 128,256-token embedding: 3,212,749,824 parameters) at MBS 1: its fp32
weights, gradients and AdamW moments take 16 bytes x 3.21B = 51 GB, and the estimator puts the whole run at
66.3 GiB without activation checkpointing, 13.4 GiB under an H100-80GB (``python pretrain/run.py --recipe
recipes/llama-1b.yaml <these overrides> --dry-run --config_file accelerate_configs/single_gpu.yaml --gpu
H100-80GB``). No new recipe: the override set here is the whole difference. ``--data stdlib`` (the default) trains both on the standard-library corpus
with a 32k BPE (nothing downloaded: GPU machines often have no network; throughput does not depend on the
text, and the model keeps the recipe's 128,256-row vocabulary); ``--data recipe`` keeps FineWeb-Edu and the
Llama tokenizer (prepared beforehand, ``pretrain-prepare-data``).

Expert parallelism (8 GPUs, transformers >= 5.24 in the wheelhouse): the whole OLMoE-1B-7B on FSDP2 against EP 8 and
EP 4, the same launch otherwise::

    python tools/bench_gpu.py --accelerate-config accelerate_configs/fsdp2_ep.yaml --budget 600 \
        --rows olmoe-1b-7b/default,olmoe-1b-7b/ep-8,olmoe-1b-7b/ep-4

Not here (this benchmark is one GPU by design): tensor- and context-parallel rows, which split a model or a sequence
over 2+ GPUs. Owed to a 2+ GPU machine (docs/performance.md#gpu-acceptance-benchmark): llama-1b at seq 8192 and 32768
as CP 2 (accelerate_configs/fsdp2_cp2.yaml --num_processes 2 --parallelism_config_dp_shard_size 1) against FSDP on
the same GPUs, then CP 2 x TP 2 on 4.

Settings (``SETTINGS``): each a named set of recipe overrides, one knob changed from the recipe as shipped
(``default``): ``precision.float8`` tensorwise | rowwise, ``model.compile`` none | regional, ``model.activation_checkpointing`` none | full | selective |
every_2, ``model.loss`` plain | chunked | liger, and ``batch.micro_batch_size``. ``--settings`` picks some;
trailing ``key=value`` arguments apply to every run.

Outputs in ``--out`` (default runs/bench_gpu): ``bench_gpu.md`` (the table, printed too), ``bench_gpu.jsonl``
(one row a line, in the order they finished), ``bench_gpu.json`` (``{"device": ..., "rows": [row, ...]}``, a row
per (model, setting) with every figure and its status), and ``calibration.json``, what the planner reads: a JSON list, one object per run that measured, with

    gpu               the device's name (nvidia-smi's, or the CPU's model name with --reduced)
    model             the MODELS name (llama-1b, llama-3b; tiny with --reduced)
    params            parameters the run counted (run_config.json model.num_params)
    seq_len           tokens per sequence
    mbs               sequences per forward (the micro-batch; GAS 1, one process)
    mfu               median perf/mfu over the measured steps (a fraction, 0-1)
    hfu               median perf/hfu, only where activation checkpointing recomputed (the planner then
                      compares hardware FLOPs)
    tokens_per_s      median perf/tokens_per_s_per_device (tokens/s on that one GPU)
    settings          the setting's name and its overrides: {"name": ..., "overrides": [...]}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpoint import rundir
from pretrain.distributed.accelerator import compile_mode
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.model.loss import resolve_loss
from pretrain.plan import auto_batch, memory
from pretrain.plan.planner import DEFAULT_BASE_MFU, mbs_efficiency
from pretrain.plan.sweep.runner import launch_command, run_process, stderr_tail, sweep_overrides
from pretrain.recipe.batching import plan_batches
from pretrain.recipe.config import load_recipe, load_recipe_dict
from pretrain.recipe.shape import ModelShape
from pretrain.system.hardware import GpuSpec, custom_gpu, gpu_for_device
from pretrain.train.preflight import check_run

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


@dataclass(frozen=True)
class Model:
    recipe: str
    overrides: tuple[str, ...] = ()


MODELS = {
    "llama-1b": Model("recipes/llama-1b.yaml"),
    "llama-3b": Model("recipes/llama-1b.yaml", (
        "model.hidden_size=3072", "model.num_layers=28", "model.num_heads=24", "model.num_kv_heads=8",
        "model.intermediate_size=8192", "batch.micro_batch_size=1",
    )),
    # Llama-3.1-8B's matmuls (hidden 4096, MLP 14,336, 32 heads, 8 KV heads, untied 128,256-token embedding) at half
    # its depth (16 layers, 4.54B parameters), full recompute: the shapes of the anchors' float8 gains (+28-32% at
    # 8B) on one GPU. The whole 8B does not fit one GPU (16 B x 8.03B of fp32 weights, gradients and AdamW moments
    # = 120 GiB, plus activations: 145 GiB by the estimate against an H200's 140); this does: at the benchmark's GAS 1
    # the optimizer step's 67.7 GiB of fp32 weights, gradients and moments is its peak on an H100 80GB (MBS 1), and
    # an H200 141GB takes MBS 16 (MBS auto, chosen at the recipe's GAS).
    "llama-8b-16l": Model("recipes/llama-1b.yaml", (
        "model.hidden_size=4096", "model.num_layers=16", "model.num_heads=32", "model.num_kv_heads=8",
        "model.intermediate_size=14336", "model.tie_embeddings=false", "model.activation_checkpointing=full",
    )),
    # OLMoE-1B-7B (64 experts, top-8) at half its depth (8 layers, 3.5B parameters of which 0.7B active): the MoE
    # row of one GPU, where every expert is local (no EP, no all-to-all); its MFU counts active parameters only.
    "olmoe-1b-7b-8l": Model("recipes/olmoe-1b-7b.yaml", ("model.num_layers=8",)),
    # The whole OLMoE-1B-7B: the multi-GPU rows (8 GPUs, accelerate_configs/fsdp2_ep.yaml), plain FSDP against EP 8.
    "olmoe-1b-7b": Model("recipes/olmoe-1b-7b.yaml"),
}
# --reduced: recipes/tiny.yaml at pretrain-sweep's test shape (2 layers, 64 wide, 64-token sequences), fp32 on CPU.
REDUCED_MODELS = {
    "tiny": Model("recipes/tiny.yaml", ("model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128",
                                        "data.seq_len=64", "batch.micro_batch_size=4")),
}
# Trains on the standard library with a 32k BPE: nothing to download (see the module docstring).
STDLIB_DATA = ("data.source=stdlib", "data.hf_config=null", "data.tokenizer=bpe", "data.tokenizer_vocab_size=32000",
               "data.val_fraction=0.05")

# In priority order (the module docstring): the first model runs every setting of PRIORITY_SETTINGS, then each
# other model's default, then the rest.
SETTINGS: dict[str, tuple[str, ...]] = {
    "default": (),
    # float8 Linear layers (torchao) against the default's bf16: the speed-up the anchors report (+18-28% at 1B-8B)
    "float8-tensorwise": ("precision.float8=tensorwise",),
    # and the LM head in float8 too (precision.float8_skip keeps it in bf16 by default: a fifth of llama-1b's matmul
    # FLOPs at its 128k vocabulary)
    "float8-lm-head": ("precision.float8=tensorwise", "precision.float8_skip=[]"),
    "float8-rowwise": ("precision.float8=rowwise",),
    "compile-none": ("model.compile=none",),
    "compile-regional": ("model.compile=regional",),
    "ac-full": ("model.activation_checkpointing=full",),
    "ac-selective": ("model.activation_checkpointing=selective",),
    # Selective and full without compile: on the H100 (2026-11-26) selective under regional compile had full's
    # peak to the byte and its step time; these two rows tell whether compile or the policy is the cause.
    "ac-selective-eager": ("model.activation_checkpointing=selective", "model.compile=none"),
    "ac-full-eager": ("model.activation_checkpointing=full", "model.compile=none"),
    "ac-every_2": ("model.activation_checkpointing=every_2",),
    "ac-none": ("model.activation_checkpointing=none",),
    "loss-chunked": ("model.loss=chunked",),
    "loss-liger": ("model.loss=liger",),
    "mbs-8": ("batch.micro_batch_size=8",),
    "mbs-4": ("batch.micro_batch_size=4",),  # llama-1b's MBS before auto (the H100 rows of 2026-11-26)
    "mbs-2": ("batch.micro_batch_size=2",),
    "loss-plain": ("model.loss=plain",),
    "mbs-1": ("batch.micro_batch_size=1",),
    # the stability rules read each step's loss and gradient norm: one device-to-host sync per optimizer step
    # (and no rollback, which acts on the updates they skip: the recipe check refuses one without the other)
    "no-step-checks": ("stability.skip_nonfinite=false", "stability.spike_sigma=null",
                       "stability.rollback.enabled=false"),
    # expert parallelism (MoE recipes on 2+ GPUs of an FSDP2 config): whole experts per GPU, tokens by all-to-all
    "ep-8": ("model.moe.ep_size=8",),
    "ep-4": ("model.moe.ep_size=4",),
}
PRIORITY_SETTINGS = ("default", "float8-tensorwise", "float8-lm-head", "float8-rowwise", "compile-none", "compile-regional", "ac-full", "ac-selective", "ac-selective-eager",
                     "ac-full-eager", "ac-every_2", "ac-none",
                     "loss-chunked", "loss-liger", "mbs-8", "mbs-4", "mbs-2")
REDUCED_SETTINGS = ("default", "loss-plain")

# What a row costs before any row has measured it (then: the measured start-up, compile and per-step time).
ASSUMED_STARTUP_S = {"cuda": 75.0, "cpu": 20.0}
"""Process start to the first step: imports, the standard-library corpus tokenized on the first row, model
build and init. An assumption, replaced by the first finished row's figure (the H100 rows of 2026-11-26:
52-74 s)."""
ASSUMED_COMPILE_S = 30.0
"""Regional compile of one Llama block (inductor, cold cache); replaced by the first compiled row's figure
(llama-1b on the H100, 2026-11-26: 10.5-13.1 s)."""
ASSUMED_CPU_STEP_S = 0.5
"""--reduced: one optimizer step of the tiny shape on a busy CPU; the GPU's comes from the planner's model."""

COLUMNS = ("model", "setting", "loss", "compile", "MBS", "tokens/s/GPU", "MFU", "HFU", "cold compile s", "step s",
           "peak GiB", "estimated GiB", "error %", "est. total GiB", "status")
RUNS_OK = ("ok", "no-fit", "budget")
"""Statuses that are answers, not failures (the exit status)."""


def device_name(reduced: bool) -> tuple[str, int | None]:
    """The GPU's name and memory (MiB) from nvidia-smi (this process never initialises CUDA: it would hold
    memory on the GPU the runs measure), or the CPU's name."""
    if not reduced and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            name, _, mib = out.stdout.strip().rpartition(",")
            return name.strip(), int(float(mib))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip(), None
    except OSError:
        pass
    return platform.processor() or "cpu", None


def versions() -> dict[str, str | None]:
    """The packages whose versions a row's figures depend on (tools/calibrate_memory.py --add records them)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "accelerate", "torchao", "liger-kernel"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def ordered_rows(models: list[str], settings: list[str]) -> list[tuple[str, str]]:
    """(model, setting) in priority order: the first model's PRIORITY_SETTINGS, each other model's default, the rest."""
    first, others = models[0], models[1:]
    head = [(first, s) for s in SETTINGS if s in settings and s in PRIORITY_SETTINGS]
    defaults = [(m, "default") for m in others if "default" in settings]
    rest = [(m, s) for m in models for s in SETTINGS if s in settings and (m, s) not in head and (m, s) not in defaults]
    return head + defaults + rest


@dataclass
class Planned:
    """A row before it runs: the run's recipe, what model.compile and model.loss resolve to, the estimate."""

    row: dict[str, Any]
    command: list[str]
    run_dir: Path
    key: str
    """The run's recipe with compile and loss resolved: two rows with one key are the same run."""
    compiles: bool
    work: float
    """Hardware FLOPs per optimizer step over the planner's micro-batch efficiency (pretrain-plan's step model)."""
    estimate: memory.MemoryEstimate | None


def plan_row(model_name: str, model: Model, setting: str, args: argparse.Namespace) -> Planned | dict[str, Any]:
    """The row's launch, or a finished row (status refused) when this checkout cannot run its overrides."""
    data = args.data_overrides
    if (load_recipe_dict(ROOT / model.recipe).get("model") or {}).get("init_from"):
        # a model continued from its weights reads the corpus with its own tokenizer (a new BPE is refused)
        data = tuple(o for o in data if not o.startswith("data.tokenizer"))
    overrides = [*model.overrides, *data, *SETTINGS[setting], *args.overrides]
    row: dict[str, Any] = {"model": model_name, "setting": setting, "overrides": list(SETTINGS[setting]),
                           "micro_batch_size": None, "status": "ok", "detail": ""}
    run_dir = args.out / model_name / setting
    try:
        first = load_recipe(ROOT / model.recipe, overrides)
        launch = args.launch.for_recipe(first)  # model.moe.ep_size (the ep-N settings), checked against the launch
        # micro_batch_size auto (the shipped GPU recipes): the size the run chooses on this GPU (a CPU process's
        # share of the host with --reduced), made explicit so the row says what it measured
        first, auto_note = auto_batch.resolve(first, launch, args.gpu if args.device_type == "cuda" else None,
                                              args.device_type)
        mbs = plan_batches(first.batch, 1, 1).micro_batch_size
        # The setting's and the user's overrides last: they win over the measurement's (MBS agrees by construction).
        run_overrides = [*sweep_overrides(mbs, 1, args.steps, args.warmup_steps, run_dir), *overrides]
        recipe = load_recipe(ROOT / model.recipe, run_overrides)
        plan = check_run(recipe, launch).batch  # the run's own checks, before any process starts
        mode = compile_mode(recipe.model.compile, args.device_type, launch)
        loss = resolve_loss(recipe, launch, cuda=args.device_type == "cuda")
    except ConfigError as exc:  # a setting this checkout cannot run (liger missing, say): a row, the others run
        return {**row, "status": "refused", "detail": str(exc)}
    row.update(micro_batch_size=mbs, seq_len=recipe.data.seq_len, dtype=recipe.precision.dtype, loss=loss,
               compile=mode, **({"auto_micro_batch": auto_note} if auto_note else {}))
    try:
        est = memory.estimate(recipe, plan, launch, gpu=args.gpu, device=args.device_type, loss=loss)
        row.update(estimated_total_gib=est.total_gib, estimated_gib=est.tensor_peak_gib)
    except ConfigError as exc:
        est = None
        row["detail"] = f"no estimate: {exc}"
    shape = ModelShape.from_recipe(recipe, plan.seq_len)
    hardware_flops = shape.flops_per_token(plan.seq_len, recipe.model.activation_checkpointing).hardware_flops
    work = hardware_flops * plan.tokens_per_step / mbs_efficiency(mbs * plan.seq_len)
    resolved = recipe.to_dict()
    resolved.pop("output_dir")
    resolved["model"] = {**resolved["model"], "compile": mode, "loss": loss}
    key = json.dumps(resolved, sort_keys=True, default=str)
    command = launch_command(args.accelerate_config, None, str(ROOT / model.recipe), run_overrides)
    return Planned(row, command, run_dir, key, mode != "none", work, est)


class Clock:
    """A row's expected seconds: start-up + compile (rows that compile) + steps x step time. The step time is
    the planner's model (GPU) or an assumption (CPU) until a row has run, then the measured time per unit of
    work scaled to the row's work; start-up and compile are assumed until measured."""

    def __init__(self, args: argparse.Namespace):
        self.num_steps = args.steps + args.warmup_steps
        self.startup_s = ASSUMED_STARTUP_S[args.device_type]
        self.compile_s = ASSUMED_COMPILE_S
        self.s_per_work: float | None = None
        rate = args.gpu.bf16_tflops if args.gpu is not None and args.device_type == "cuda" else None
        if rate:
            self.s_per_work = 1 / (rate * 1e12 * DEFAULT_BASE_MFU)

    def expected_s(self, p: Planned) -> float:
        step_s = ASSUMED_CPU_STEP_S if self.s_per_work is None else p.work * self.s_per_work
        return self.startup_s + (self.compile_s if p.compiles else 0.0) + self.num_steps * step_s

    def measured(self, p: Planned, row: dict[str, Any]) -> None:
        if row.get("startup_s") is not None:
            self.startup_s = row["startup_s"]
        if p.compiles and row.get("cold_compile_s") is not None:
            self.compile_s = row["cold_compile_s"]
        if row.get("step_time_s"):
            self.s_per_work = row["step_time_s"] / p.work


def read_figures(run_dir: Path, warmup_steps: int) -> dict[str, Any]:
    """Medians over the measured steps of one finished run, its cold compile time, its peak memory against the
    estimate on the same basis (tensors only). Raises ValueError."""
    records = rundir.read_metrics(run_dir)
    train = sorted((r for r in records if "train/loss" in r), key=lambda r: r["step"])
    perf = [r for r in train if r.get("perf/tokens_per_s_per_device") is not None]
    if not perf:
        raise ValueError(f"{run_dir / rundir.METRICS_FILE} holds no perf/tokens_per_s_per_device")

    def median(key):
        values = [r[key] for r in perf if r.get(key) is not None]
        return statistics.median(values) if values else None

    mfu = median("perf/mfu")
    # perf/hfu is logged where activation checkpointing recomputes; otherwise the hardware does the model's FLOPs.
    hfu = median("perf/hfu") if any("perf/hfu" in r for r in perf) else mfu
    step_s = median("perf/step_time_s")
    # Every step logs (sweep_overrides), so each has its own wall time (perf/step_time_max_s: CUDA events from
    # the step's start, host-side compile included). Cold compile: what the warm-up steps took beyond the steady
    # step; on a row that does not compile, the first steps' other one-off costs (allocator, autotuning).
    step_times = [r["perf/step_time_max_s"] for r in train if r.get("perf/step_time_max_s") is not None]
    warm = [r["perf/step_time_max_s"] for r in train[:max(warmup_steps, 1)] if r.get("perf/step_time_max_s") is not None]
    peaks = [r["memory/peak_gib"] for r in records if r.get("memory/peak_gib") is not None]
    tensors = [r["memory/estimated_tensors_gib"] for r in records if r.get("memory/estimated_tensors_gib") is not None]
    peak = max(peaks) if peaks else None
    estimate = tensors[-1] if tensors else None
    config = rundir.read_run_config(run_dir) or {}
    return {
        "tokens_per_s_per_gpu": median("perf/tokens_per_s_per_device"),
        "mfu": mfu,
        "hfu": hfu,
        "step_time_s": step_s,
        "first_step_s": step_times[0] if step_times else None,
        "cold_compile_s": sum(max(0.0, t - step_s) for t in warm) if warm and step_s else None,
        "steps_s": sum(step_times),
        "peak_gib": peak,
        "estimated_gib": estimate,  # the run's own estimate, without the allowance
        "estimate_error_pct": (estimate - peak) / peak * 100 if peak and estimate is not None else None,
        "num_measured_steps": len(perf),
        "loss": config.get("loss/implementation"),  # model.loss as the run resolved it
        "compile": config.get("compile/mode"),
        "params": config.get("model/num_params"),
    }


def run_planned(p: Planned, args: argparse.Namespace, timeout_s: float, running: Path) -> dict[str, Any]:
    row = dict(p.row)
    shutil.rmtree(p.run_dir, ignore_errors=True)
    p.run_dir.mkdir(parents=True)

    def record_group(pgid: int) -> None:
        # A benchmark killed with SIGKILL cannot end the row in flight: this names its process group.
        write_atomic(running, json.dumps({"pgid": pgid, "model": row["model"], "setting": row["setting"],
                                          "run_dir": str(p.run_dir)}) + "\n")

    started = time.monotonic()
    try:
        code, stdout, stderr = run_process(p.command, p.run_dir / "run", timeout_s, on_start=record_group)
    finally:
        running.unlink(missing_ok=True)
    row["wall_s"] = time.monotonic() - started
    if code != 0:
        out_of_memory = "out of memory" in stderr.lower() or "OutOfMemoryError" in stderr
        status = "oom" if out_of_memory else "timeout" if code == -1 else "failed"
        row.update(status=status, detail=stderr_tail(stderr, stdout))
        return row
    try:
        row.update(read_figures(p.run_dir, args.warmup_steps))
    except (ValueError, ConfigError) as exc:
        row.update(status="failed", detail=str(exc))
        return row
    row["startup_s"] = max(0.0, row["wall_s"] - row.pop("steps_s"))  # process start, set-up and exit
    return row


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [r["model"], r["setting"], r.get("loss") or "-", r.get("compile") or "-",
                 fmt(r["micro_batch_size"], "d"), fmt(r.get("tokens_per_s_per_gpu"), ",.0f"), fmt(r.get("mfu"), ".1%"),
                 fmt(r.get("hfu"), ".1%"), fmt(r.get("cold_compile_s"), ".1f"), fmt(r.get("step_time_s"), ".3f"),
                 fmt(r.get("peak_gib"), ".2f"), fmt(r.get("estimated_gib"), ".2f"),
                 fmt(r.get("estimate_error_pct"), "+.1f"), fmt(r.get("estimated_total_gib"), ".2f"), r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def calibration(rows: list[dict[str, Any]], gpu: str) -> list[dict[str, Any]]:
    """The rows pretrain-plan --calibration reads (pretrain.plan.planner.read_calibration)."""
    return [{"gpu": gpu, "model": r["model"], "params": r["params"], "seq_len": r["seq_len"],
             "mbs": r["micro_batch_size"], "mfu": r["mfu"], **({"hfu": r["hfu"]} if r["hfu"] != r["mfu"] else {}),
             "tokens_per_s": r["tokens_per_s_per_gpu"], "settings": {"name": r["setting"], "overrides": r["overrides"]}}
            for r in rows if r["status"] == "ok"]


def write_atomic(path: Path, text: str) -> None:
    """Readers (and a benchmark killed mid-write) see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Report:
    """The outputs, rewritten the moment a row finishes: a benchmark stopped at any point keeps every row."""

    def __init__(self, out: Path, gpu: str, args: argparse.Namespace):
        self.out, self.gpu, self.rows = out, gpu, []
        self.header = {"device": gpu, "date": time.strftime("%Y-%m-%d"), "versions": versions(), "steps": args.steps,
                       "warmup_steps": args.warmup_steps, "budget_s": args.budget}
        self.jsonl = out / "bench_gpu.jsonl"
        self.jsonl.write_text("")  # a new benchmark: this file holds this run's rows only

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        write_atomic(self.out / "bench_gpu.md", table(self.rows))
        write_atomic(self.out / "bench_gpu.json", json.dumps({**self.header, "rows": self.rows}, indent=2))
        write_atomic(self.out / "calibration.json", json.dumps(calibration(self.rows, self.gpu), indent=2) + "\n")
        # The jsonl line last: once a row is there, every other output holds it too (a kill between the two leaves
        # the row in the others only, still a finished row).
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        figures = ", ".join(f"{k} {fmt(row.get(k), spec)}" for k, spec in (
            ("tokens_per_s_per_gpu", ",.0f"), ("mfu", ".1%"), ("cold_compile_s", ".1f"), ("wall_s", ".0f")))
        print(f"bench_gpu: {row['model']} / {row['setting']}: {row['status']}"
              + (f" ({figures})" if row["status"] == "ok" else f": {row['detail']}"), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reduced", action="store_true",
                        help="CPU: tiny recipe, accelerate_configs/cpu.yaml, 3 steps, settings default,loss-plain")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help="wall-clock seconds for the whole benchmark: a row starts only if its expected time "
                             "fits in what is left, and is killed at the deadline (default: no limit)")
    parser.add_argument("--models", help=f"comma-separated, of: {', '.join(MODELS)} (default: all)")
    parser.add_argument("--settings", help=f"comma-separated, of: {', '.join(SETTINGS)} (default: all)")
    parser.add_argument("--rows", help="comma-separated MODEL/SETTING pairs, run in this order instead of the "
                                         "priority order of --models and --settings (e.g. the owed rows of a visit)")
    parser.add_argument("--steps", type=int,
                        help="measured optimizer steps per run (default 300; with --budget 50; --reduced 3)")
    parser.add_argument("--warmup-steps", type=int, help="steps left out of the figures (compile, allocator warm-up; "
                                                         "default 20; with --budget 10; --reduced 1)")
    parser.add_argument("--data", choices=("stdlib", "recipe"), default="stdlib",
                        help="stdlib: the offline standard-library corpus (default); recipe: the recipe's own data")
    parser.add_argument("--accelerate-config", help="default accelerate_configs/single_gpu.yaml (--reduced: cpu.yaml)")
    parser.add_argument("--device-memory-gib", type=float,
                        help="the memory rows must fit by the estimator (default: the GPU's, from nvidia-smi; "
                             "--reduced: no check)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_gpu")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides applied to every run")
    args = parser.parse_args(argv)
    models = REDUCED_MODELS if args.reduced else MODELS
    names = args.models.split(",") if args.models else list(models)
    settings = args.settings.split(",") if args.settings else list(REDUCED_SETTINGS if args.reduced else SETTINGS)
    args.row_list = None
    if args.rows:
        if args.models or args.settings:
            parser.error("--rows names each row: drop --models and --settings")
        pairs = [r.strip().partition("/") for r in args.rows.split(",") if r.strip()]
        args.row_list = [(m, st) for m, _, st in pairs]
        names = list(dict.fromkeys(m for m, _ in args.row_list))
        settings = list(dict.fromkeys(st for _, st in args.row_list))
    unknown = [n for n in names if n not in models] + [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown model or setting {', '.join(unknown)}; models: {', '.join(models)}; "
                     f"settings: {', '.join(SETTINGS)}")
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget {args.budget:g}: give the seconds the benchmark may take (> 0), e.g. --budget 420")
    if args.device_memory_gib is not None and args.device_memory_gib <= 0:
        parser.error(f"--device-memory-gib {args.device_memory_gib:g}: give the device's memory in GiB (> 0)")
    args.models, args.settings = {n: models[n] for n in names}, settings
    budgeted = args.budget is not None and not args.reduced
    args.steps = args.steps or (3 if args.reduced else 50 if budgeted else 300)
    if args.warmup_steps is None:
        args.warmup_steps = 1 if args.reduced else 10 if budgeted else 20
    config = args.accelerate_config or f"accelerate_configs/{'cpu' if args.reduced else 'single_gpu'}.yaml"
    args.accelerate_config = str(ROOT / config) if not Path(config).is_absolute() else config
    args.data_overrides = STDLIB_DATA if args.data == "stdlib" and not args.reduced else ()
    args.device_type = "cpu" if args.reduced else "cuda"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = None if args.budget is None else started + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    name, memory_mib = device_name(args.reduced)
    gpu: GpuSpec | None = gpu_for_device(name, memory_mib * MIB) if memory_mib else None
    if args.device_memory_gib is not None:
        gpu = custom_gpu(args.device_memory_gib, like=gpu)
    args.gpu = gpu
    try:
        args.launch = Launch.from_accelerate_config(args.accelerate_config)
    except ConfigError as exc:
        print(f"bench_gpu: {exc}", file=sys.stderr)
        return 2
    report, clock = Report(args.out, name, args), Clock(args)
    running = args.out / "running.json"
    print(f"bench_gpu: {name}: {args.warmup_steps} + {args.steps} steps per row ({args.accelerate_config})"
          + (f", budget {args.budget:g} s" if deadline else "") + f"; rows in {args.out}", flush=True)
    # `timeout` and schedulers stop with SIGTERM: end the row in flight (run_process kills its group on
    # KeyboardInterrupt) and leave with every finished row written.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    seen: dict[str, str] = {}
    over_budget = ""
    try:
        for model_name, setting in args.row_list or ordered_rows(list(args.models), args.settings):
            planned = plan_row(model_name, args.models[model_name], setting, args)
            if isinstance(planned, dict):
                report.add(planned)
                continue
            if planned.key in seen:
                print(f"bench_gpu: {model_name} / {setting}: the same run as {seen[planned.key]} "
                      f"(compile {planned.row['compile']}, loss {planned.row['loss']}): not repeated", flush=True)
                continue
            seen[planned.key] = f"{model_name} / {setting}"
            est = planned.estimate
            if est is not None and est.fits is False:
                report.add({**planned.row, "status": "no-fit", "detail": f"the estimator: {est.verdict}"})
                continue
            expected = clock.expected_s(planned)
            left = None if deadline is None else deadline - time.monotonic()
            if over_budget or (left is not None and expected > left):
                over_budget = over_budget or f"expected {expected:.0f} s, {max(left, 0):.0f} s of the budget left"
                report.add({**planned.row, "status": "budget", "detail": f"not started: {over_budget}"})
                continue
            print(f"bench_gpu: {model_name} / {setting}: MBS {planned.row['micro_batch_size']}, compile "
                  f"{planned.row['compile']}, loss {planned.row['loss']}: expected {expected:.0f} s"
                  + (f" of {left:.0f} s left" if left is not None else "") + " ...", flush=True)
            timeout = args.timeout_s if left is None else min(args.timeout_s, left)
            row = run_planned(planned, args, timeout, running)
            report.add({**row, "expected_s": expected})
            if row["status"] == "ok":
                clock.measured(planned, row)
    except KeyboardInterrupt:
        print(f"bench_gpu: stopped; {len(report.rows)} finished row(s) in {args.out}", file=sys.stderr, flush=True)
        return 130
    rows = report.rows
    print(f"\n{name}: {args.steps} measured steps after {args.warmup_steps} ({args.accelerate_config}), "
          f"{time.monotonic() - started:.0f} s\n\n{table(rows)}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['model']} / {r['setting']}: {r['status']}: {r['detail']}")
    return 0 if all(r["status"] in RUNS_OK for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
