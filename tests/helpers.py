"""Launch the real entry point in subprocesses and read what runs write."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = str(ROOT / "pretrain" / "run.py")
TINY = str(ROOT / "recipes" / "tiny.yaml")
# The suite's cache directory (PRETRAIN_CACHE_DIR unless set): tokenizers, stores, and the ops DeepSpeed builds
# (tests/conftest.py), shared by every test and kept between runs.
SUITE_CACHE = ROOT / ".cache" / "pretrain"

# The one small model of the tests: the tiny recipe narrowed to 2 blocks of width 64 on 64-token sequences. A test
# that needs another shape derives it from these with an explicit override.
FAST_MODEL = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=128",
    "data.seq_len=64",
]
# A smaller, faster variant of the tiny recipe for tests that check mechanics, not learning.
FAST = [
    *FAST_MODEL,
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "lr_schedule.warmup_steps=1",
    "eval.batches=2",
    "eval.tasks=[]",  # the demo's downstream task: its own tests (tests/train/test_downstream.py)
    "logging.every_steps=1",
    "logging.progress=plain",
]


def free_port() -> int:
    """A TCP port free now on localhost, for a rendezvous (29500 may be held by another run or test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def env(**extra: str | None) -> dict[str, str]:
    """The test environment: offline hub, a shared data cache, and DeepSpeed on CPU where there is no CUDA (on a GPU
    box DeepSpeed keeps its CUDA accelerator: the GPU tests need it). A None value removes a variable."""
    out = dict(os.environ)
    out.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    if not cuda_available():
        out["DS_ACCELERATOR"] = "cpu"
    out.setdefault("PRETRAIN_CACHE_DIR", str(SUITE_CACHE))
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def run_cmd(cmd: list[str], timeout: float = 600, extra_env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; on a timeout (or an interrupt) the whole session is killed, so the
    workers of a hung ``accelerate launch`` do not outlive the test."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env(**(extra_env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def train(args: list[str], recipe: str = TINY, timeout: float = 600, extra_env: dict | None = None):
    return run_cmd([sys.executable, RUN, "--recipe", recipe, *args], timeout=timeout, extra_env=extra_env)


def accelerate_launch(config: str, args: list[str], recipe: str = TINY, extra: list[str] = (), timeout: float = 900,
                      script: list[str] = (RUN,), extra_env: dict | None = None):
    """``accelerate launch`` of ``script`` (the entry point, or a test's wrapper of it and its arguments)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / config),
           *extra, *script, "--recipe", recipe, *args]
    return run_cmd(cmd, timeout=timeout, extra_env=extra_env)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in metrics(run_dir) if "train/loss" in m}


def val_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["val/loss"] for m in metrics(run_dir) if "val/loss" in m}


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"


def train_killed_at(args: list[str], checkpoint_step: int, out: Path, recipe: str = TINY, timeout: float = 300) -> None:
    """Run the entry point into ``out`` and kill -9 its process group once the checkpoint of
    ``checkpoint_step`` is complete; asserts it was killed before it finished."""
    cmd = [sys.executable, RUN, "--recipe", recipe, *args, f"output_dir={out}"]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    path, deadline = out / "checkpoints" / f"step_{checkpoint_step:08d}" / "trainer_state.json", time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (exit {proc.returncode}) before {path} appeared:\n{proc.stdout.read()}")
        if time.time() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final_model").exists(), "killed too late"


def accelerate_environment(config_file, *options: str) -> dict[str, str]:
    """What `accelerate launch --config_file F <options> run.py` exports to each process (rank 0), built by
    accelerate's own launcher code, plus what torchrun adds (WORLD_SIZE, GROUP_WORLD_SIZE, RANK)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    # A free rendezvous port: accelerate refuses one in use (another run, or a stray test process, on 29500).
    port = str(free_port())
    args = launch_command_parser().parse_args(["--config_file", str(config_file), "--main_process_port", port,
                                               *options, "run.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) if defaults else []  # as accelerate's launch_command sets it
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config)
        environment = prepare_deepspeed_cmd_env(args)[1]
    elif args.num_processes > 1 or args.use_fsdp:
        environment = prepare_multi_gpu_env(args)
    else:
        environment = {"ACCELERATE_MIXED_PRECISION": str(args.mixed_precision)}
    environment = {k: v for k, v in environment.items() if k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}
    return {**environment, "WORLD_SIZE": str(args.num_processes), "GROUP_WORLD_SIZE": str(args.num_machines),
            "RANK": "0"}


# The minimal valid recipe of the in-process tests (no file): every other key has its schema default.
MINIMAL_RECIPE = {"batch": {"global_batch_size": 64, "micro_batch_size": 4}, "train": {"max_steps": 10}}


def recipe_data(**sections) -> dict:
    """MINIMAL_RECIPE with whole sections replaced (``data={...}``), as the mapping a recipe file holds."""
    return {**MINIMAL_RECIPE, **sections}


def make_recipe(*overrides: str, **sections):
    """The one recipe builder of the in-process tests: ``recipe_data(**sections)`` then ``key.path=value``
    overrides, validated as the loader validates a file (named ``t``)."""
    from pretrain.recipe.config import apply_overrides, build_recipe

    return build_recipe(apply_overrides(recipe_data(**sections), overrides), default_name="t")


# Trains in a fresh interpreter through Trainer, not run.py: for tests of what the training process itself
# leaves behind (signal handlers, module state). {before} runs first, {between} after the Trainer is built,
# {after} once it has trained.
TRAINER_SCRIPT = """
import sys
from pretrain.recipe.config import load_recipe
from pretrain.train.trainer import Trainer
{before}
trainer = Trainer(load_recipe(sys.argv[1], sys.argv[2:]))
{between}
trainer.train()
{after}
"""


def train_in_process(args: list[str], before: str = "", between: str = "", after: str = "", recipe: str = TINY,
                     timeout: float = 300) -> subprocess.CompletedProcess:
    script = TRAINER_SCRIPT.format(before=before, between=between, after=after)
    return run_cmd([sys.executable, "-c", script, recipe, *args], timeout=timeout)


def train_here(args: list[str], recipe: str = TINY, trainer_class=None):
    """The entry point's Trainer in this process (what pretrain/run.py runs on one process, without an interpreter
    start and its imports: seconds per run): (the recipe, the trainer after train(), its console output).
    ``trainer_class``: a subclass of the Trainer a test adds a part to."""
    import contextlib
    import io

    from accelerate.state import AcceleratorState, GradientState

    from pretrain.recipe.config import load_recipe
    from pretrain.train.trainer import Trainer

    loaded = load_recipe(recipe, list(args))
    console = io.StringIO()
    try:
        with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
            trainer = (trainer_class or Trainer)(loaded)
            trainer.train()
    finally:
        # accelerate's process-wide singletons: the next run (and any later test of this process) starts afresh
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return loaded, trainer, console.getvalue()


def counted_flops_per_token(model, vocab_size: int, batch: int, seq_len: int) -> float:
    """FLOPs of one training step (forward + backward) counted by PyTorch's FlopCounterMode, per token: the
    reference the FLOPs formulas are checked against."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    return counter.get_total_flops() / (batch * seq_len)


def write_tokenizer_json(path: Path, pre_tokenizer: str = "qwen2", vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer.json trained here on the standard library's json package (no download),
    its end-of-text token <|endoftext|>. ``pre_tokenizer``: "qwen2" (the split transformers' Qwen2Tokenizer
    rebuilds: NFC, Qwen2's regex, byte-level) or "gpt2" (byte-level with GPT-2's regex, pretrain's own BPE)."""
    import sysconfig

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE())
    if pre_tokenizer == "qwen2":
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))]
    backend.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(path))
    return path


# ---- in-process runs on one thread (trim2) --------------------------------------------------------------------
class OneThread:
    """``with OneThread():`` torch on one intra-op thread in this process, and OMP_NUM_THREADS=1 for the processes
    started meanwhile, as accelerate launch gives each of its processes. Two threads on two busy cores wait for each
    other (an in-process 40-step run measured 194 s on two threads on a loaded machine, 22 s as a 2-process launch
    of one thread each), and the runs of a test that compares curves all reduce in the same order."""

    def __enter__(self):
        import torch

        self.threads, self.omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
        return self

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.threads)
        if self.omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = self.omp


# ---- shipped recipes that start from a pretrained model ---------------------------------------------------------
# model.init_from of a shipped recipe -> a directory of tests/assets holding its config.json (tests/assets/README.md):
# the shape and the meta build need nothing else; nothing is downloaded and the checkout's runs/ is never read.
INIT_FROM_ASSETS = {
    "Qwen/Qwen3-1.7B": ROOT / "tests" / "assets" / "qwen3-1.7b",
    "runs/tiny/final_model": ROOT / "tests" / "assets" / "tiny-final-model",
}


def shipped_recipe(path, overrides: list[str] | tuple[str, ...] = ()):
    """``load_recipe`` of a shipped recipe, its model.init_from (if any) read from tests/assets."""
    from pretrain.recipe.config import load_recipe, load_recipe_dict

    init_from = (load_recipe_dict(path).get("model") or {}).get("init_from")
    extra = [f"model.init_from={INIT_FROM_ASSETS[init_from]}"] if init_from else []
    return load_recipe(path, [*extra, *overrides])


def hub_cache_with_assets(root: Path) -> Path:
    """A Hugging Face hub cache (HF_HUB_CACHE) under ``root`` holding the hub models of INIT_FROM_ASSETS as their
    config.json alone, as a cache holds a model whose config was read and nothing else downloaded."""
    for repo, asset in INIT_FROM_ASSETS.items():
        if repo.count("/") != 1 or repo.startswith("runs/"):
            continue
        folder = root / f"models--{repo.replace('/', '--')}"
        revision = "0" * 40
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / "main").write_text(revision)
        snapshot = folder / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_bytes((asset / "config.json").read_bytes())
    return root
