"""Scale benchmark of pretrain-export: its memory and time at three model widths on CPU, per checkpoint layout, the
growth fitted on log-log, and the figures at 70B (issue 51's scale: a 70B dense model).

    python tools/scale_ckpt.py [--widths 256,512,1024] [--layouts one,zero3,fsdp2] [--shard-mb 16] [--baseline]
                               [--convert N] [--load zero3] [--workdir D] [--write]

For each layout and width, a real run writes the checkpoint (2 optimizer steps of the tiny recipe at that width:
8 blocks of width W, SwiGLU 4W, one process or 2 ranks through accelerate launch; not measured), then
tools/export_probe.py exports it in a fresh process and reports the growth of its anonymous memory (RssAnon:
what the kernel cannot take back; the memory-mapped checkpoint files are page cache) and the seconds.
``--baseline`` adds the comparison: the whole fp32 model read into memory at once, as pretrain-export did before
(for the sharded layouts: a one-process checkpoint's safetensors file is mapped, page cache, either way).
The memory's exponent against the fp32 bytes says whether it grows with the model (1) or is bounded by the shard
(about 0); the figure at 70B follows the fitted exponent from the largest width, the time linearly.
``--convert N`` adds a resume's conversion into the neutral form: rank 0's share among N ranks (what each of a
launch's N ranks reads and holds), and with ``--baseline`` one rank converting it all (as before issue 51), the
bytes of tensors read against the checkpoint's and the memory's growth; at 70B on 1,024 ranks the share follows
the measured fraction (1/N of the bytes plus at most the largest tensor with its states).
``--load LAYOUT`` resumes the one-process checkpoint of each width on LAYOUT (2 ranks) for one step and reads from its
log what rank 0 read to convert its share and to load its share of the neutral form.
``--write`` puts the tables in docs/performance.md's "## Checkpoint scale" section (between its markers).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"
HEADING = "## Checkpoint scale"
BEGIN = "<!-- tools/scale_ckpt.py --write: from here to the end marker -->"
END = "<!-- end of tools/scale_ckpt.py --write -->"
TARGET_FP32 = 70.6e9 * 4  # Llama-3-70B's 70.6e9 parameters in fp32
TARGET_LARGEST = 128256 * 8192 * 4  # its largest tensor: the 128,256 x 8,192 embedding in fp32 (4.2 GB)
TARGET_TENSORS = 70.6e9 * 4 * 3  # its fp32 weights and AdamW's two states: what a resume's conversion reads
TARGET_RANKS = 1024
LAYOUTS = {"one": (None, 1), "zero3": ("zero3.yaml", 2), "fsdp2": ("fsdp.yaml", 2), "zero2": ("zero2.yaml", 2),
           "ddp": ("cpu_ddp.yaml", 2)}
NAMES = {"one": "one process", "zero3": "ZeRO-3, 2 ranks", "fsdp2": "FSDP2, 2 ranks", "zero2": "ZeRO-2, 2 ranks",
         "ddp": "DDP, 2 ranks"}


def _scale_bench():
    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "tools" / "scale_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_bench"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def environment(probe: bool = False) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1")
    if probe:
        # glibc raises its mmap threshold to the size of each large block freed, up to 32 MiB, and keeps the blocks
        # under it for reuse: the small models' 4-16 MiB tensors would count what it keeps, not what is live (a
        # ZeRO-3 export at width 1024: 123 MiB of growth, 55 MiB with the threshold fixed). At 70B the tensors are
        # past 32 MiB, always mapped and returned; fixed here so that the figures are the live memory.
        env["MALLOC_MMAP_THRESHOLD_"] = str(4 * 2**20)
    return env


def run_args(width: int, out: Path, steps: int = 2) -> list[str]:
    """The tiny recipe at ``width`` (8 blocks, SwiGLU 4W), ``steps`` optimizer steps, a checkpoint at step 2."""
    return ["--recipe", str(ROOT / "recipes" / "tiny.yaml"), f"model.hidden_size={width}", "model.num_layers=8",
            f"model.num_heads={max(width // 64, 1)}", f"model.num_kv_heads={max(width // 64, 1)}",
            f"model.intermediate_size={4 * width}", "data.seq_len=64", "batch.global_batch_size=8",
            "batch.micro_batch_size=4", f"train.max_steps={steps}", "lr_schedule.warmup_steps=1",
            "checkpoint.every_steps=2", "checkpoint.save_final_model=false", "eval.batches=1", "eval.tasks=[]",
            "logging.progress=none", f"output_dir={out}"]


def launch(layout: str, args: list[str]) -> subprocess.CompletedProcess:
    config, procs = LAYOUTS[layout]
    run = str(ROOT / "pretrain" / "run.py")
    if config is None:
        cmd = [sys.executable, run, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / config), "--num_processes", str(procs), "--main_process_port", "0",
               run, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the {layout} run failed ({' '.join(args[-2:])}):\n{proc.stderr[-3000:]}")
    return proc


def write_checkpoint(layout: str, width: int, workdir: Path) -> Path:
    """A 2-step run of the tiny recipe at ``width`` on ``layout``; its step-2 checkpoint (reused if there)."""
    out = workdir / f"{layout}_{width}"
    checkpoint = out / "checkpoints" / "step_00000002"
    if not (checkpoint / "trainer_state.json").is_file():
        launch(layout, run_args(width, out))
    return checkpoint


def load_rows(widths: list[int], target: str, workdir: Path, bench) -> dict:
    """The one-process checkpoint at each width resumed on ``target`` (2 ranks) for one step: what its log says rank 0
    read to convert its share and to load its share of the neutral form."""
    import re
    import shutil

    points = []
    for width in widths:
        checkpoint = write_checkpoint("one", width, workdir)
        shutil.rmtree(checkpoint.with_name(f"{checkpoint.name}.neutral"), ignore_errors=True)
        out = workdir / f"load_{target}_{width}"
        shutil.rmtree(out, ignore_errors=True)
        proc = launch(target, [*run_args(width, out, steps=3), f"checkpoint.resume={checkpoint}",
                               "logging.progress=plain"])  # the resume's lines on the console
        log = proc.stdout + proc.stderr
        converted = re.search(r"rank 0 read ([\d.]+) MiB of the checkpoint's ([\d.]+) MiB of tensors", log)
        loaded = re.search(r"this rank read ([\d.]+) MiB of the neutral form's ([\d.]+) MiB", log)
        if not (converted and loaded):
            raise SystemExit(f"the resume on {target} at width {width} did not say what it read:\n{log[-3000:]}")
        points.append({"width": width, "converted": float(converted[1]), "tensors": float(converted[2]),
                       "loaded": float(loaded[1]), "view": float(loaded[2])})
        print(f"{NAMES[target]:>16} resume width {width:>5}: converted {points[-1]['converted']:.1f} of "
              f"{points[-1]['tensors']:.1f} MiB, loaded {points[-1]['loaded']:.1f} of {points[-1]['view']:.1f} MiB",
              flush=True)
    k = bench.fit_exponent([p["view"] for p in points], [p["loaded"] for p in points], 1.0)
    return {"target": target, "points": points, "k": k}


def render_load(row: dict) -> str:
    cells = " | ".join(f"{p['converted']:.0f} of {p['tensors']:.0f} / {p['loaded']:.0f} of {p['view']:.0f}"
                       for p in row["points"])
    head = " | ".join(f"width {p['width']}: converted / loaded (MiB)" for p in row["points"])
    last = row["points"][-1]
    share = last["loaded"] / last["view"]
    return "\n".join([
        f"| resumed on | {head} | loaded exponent | loaded per rank at 70B on 1,024 |",
        "|" + " --- |" * (3 + len(row["points"])),
        f"| {NAMES[row['target']]} | {cells} | {row['k']:.2f} | {TARGET_TENSORS / TARGET_RANKS / 1e9:.2f} GB |",
        "",
        f"The one-process checkpoint of each width resumed on {NAMES[row['target']]} for one step, as its log says: rank "
        "0's share of the conversion (whole tensors, so the embedding's rank reads more at these small widths) and "
        f"of the load of the neutral form (its partitions' rows: {share:.2f} of it at the widest). Each rank loads "
        "1/N of the neutral form, so at 70B on 1,024 ranks 1/1,024 of its "
        f"{TARGET_TENSORS / 1e9:.0f} GB; before issue 51 every rank read all of it."])


def measure(checkpoint: Path, shard_bytes: int, whole: bool, workdir: Path, convert: tuple[int, int] | None = None
            ) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir)) / "exported"
    cmd = [sys.executable, str(ROOT / "tools" / "export_probe.py"), str(checkpoint), str(out), str(shard_bytes)]
    mode = ["--whole"] if whole else ["--convert", *map(str, convert)] if convert else []
    proc = subprocess.run(cmd + mode, cwd=ROOT, env=environment(probe=True), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the export of {checkpoint} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"grown": result["peak_bytes"] - result["baseline_bytes"], "seconds": result["seconds"],
            **{k: result[k] for k in ("read", "total", "largest") if k in result}}


def fp32_bytes(checkpoint: Path) -> tuple[int, int]:
    """(the model's fp32 bytes, its largest tensor's) from the checkpoint's headers and metadata (nothing read)."""
    from pretrain.checkpoint.weights import open_weights

    with open_weights(checkpoint, log=lambda _: None) as weights:
        sizes = [spec.nbytes for spec in weights.specs.values()]
    return sum(sizes), max(sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="256,512,1024")
    parser.add_argument("--layouts", default="one,zero3,fsdp2")
    parser.add_argument("--shard-mb", type=int, default=16, help="pretrain-export --max-shard-size, in MiB")
    parser.add_argument("--baseline", action="store_true", help="also the whole model read at once (the old export)")
    parser.add_argument("--convert", type=int, default=0, metavar="N",
                        help="also a resume's conversion: rank 0's share among N ranks")
    parser.add_argument("--load", choices=sorted(set(LAYOUTS) - {"one"}), default=None,
                        help="also resume the one-process checkpoints on this layout (2 ranks): what rank 0 reads")
    parser.add_argument("--workdir", type=Path, default=None, help="keeps the runs' checkpoints for a rerun")
    parser.add_argument("--write", action="store_true", help="the table into docs/performance.md")
    args = parser.parse_args(argv)
    bench = _scale_bench()
    widths = [int(w) for w in args.widths.split(",")]
    layouts = args.layouts.split(",")
    shard = args.shard_mb * 2**20
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="scale_ckpt-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout in layouts:
        # the comparison where the whole model was this process's memory: one process's safetensors file was mapped
        # (page cache) by the old export too
        for mode in ["export", *(["whole model (before)"] if args.baseline and layout != "one" else [])]:
            points = []
            for width in widths:
                checkpoint = write_checkpoint(layout, width, workdir)
                total, largest = fp32_bytes(checkpoint)
                points.append({"width": width, "fp32": total, "largest": largest,
                               **measure(checkpoint, shard, mode != "export", workdir)})
                print(f"{NAMES[layout]:>16} {mode:>20} width {width:>5}: {total / 2**20:8.1f} MiB fp32, "
                      f"grew {points[-1]['grown'] / 2**20:7.1f} MiB in {points[-1]['seconds']:.2f}s", flush=True)
            k_mem = bench.fit_exponent([p["fp32"] for p in points], [p["grown"] for p in points], 2**20)
            last = points[-1]
            rows.append({"layout": NAMES[layout], "mode": mode, "points": points, "k_mem": k_mem,
                         "mem_70b": bench.extrapolate(last["fp32"], last["grown"], TARGET_FP32, k_mem),
                         "time_70b": last["seconds"] * TARGET_FP32 / last["fp32"]})
    table = render(rows, widths, args.shard_mb)
    if args.convert:
        table += "\n\n" + render_convert(convert_rows(layouts, widths, args, workdir, bench), widths, args.convert)
    if args.load:
        table += "\n\n" + render_load(load_rows(widths, args.load, workdir, bench))
    print(table)
    if args.write:
        write_doc(table, argv if argv is not None else sys.argv[1:])
    return 0


def convert_rows(layouts: list[str], widths: list[int], args, workdir: Path, bench) -> list[dict]:
    shard = args.shard_mb * 2**20  # the neutral form's shards, as the export's
    rows = []
    for layout in layouts:
        for world in [args.convert, *([1] if args.baseline else [])]:
            points = []
            for width in widths:
                checkpoint = write_checkpoint(layout, width, workdir)
                points.append({"width": width, **measure(checkpoint, shard, False, workdir, (0, world))})
                print(f"{NAMES[layout]:>16} convert 0 of {world} width {width:>5}: read "
                      f"{points[-1]['read'] / 2**20:7.1f} of {points[-1]['total'] / 2**20:7.1f} MiB, grew "
                      f"{points[-1]['grown'] / 2**20:7.1f} MiB in {points[-1]['seconds']:.2f}s", flush=True)
            k_mem = bench.fit_exponent([p["total"] for p in points], [p["grown"] for p in points], 2**20)
            k_read = bench.fit_exponent([p["total"] for p in points], [p["read"] for p in points], 2**20)
            # at 70B on 1,024 ranks a share is 1/1,024 of the bytes plus at most one tensor with its states (whole
            # tensors): the embedding's rank reads the most
            read_70b = TARGET_TENSORS / TARGET_RANKS + 3 * TARGET_LARGEST if world > 1 else TARGET_TENSORS
            rows.append({"layout": NAMES[layout], "world": world, "points": points, "k_mem": k_mem, "k_read": k_read,
                         "read_70b": read_70b})
    return rows


def render_convert(rows: list[dict], widths: list[int], world: int) -> str:
    head = ("| checkpoint | converted by | " + " | ".join(f"width {w}: tensors / read / grown / s" for w in widths)
            + " | read exponent | memory exponent | most read by a rank at 70B on 1,024 |")
    lines = [head, "|" + " --- |" * (5 + len(widths))]
    for row in rows:
        cells = [f"{p['total'] / 2**20:.0f} / {p['read'] / 2**20:.0f} / {p['grown'] / 2**20:.0f} MiB / "
                 f"{p['seconds']:.1f}" for p in row["points"]]
        who = f"rank 0 of {row['world']}" if row["world"] > 1 else "one rank (before)"
        lines.append(f"| {row['layout']} | {who} | " + " | ".join(cells)
                     + f" | {row['k_read']:.2f} | {row['k_mem']:.2f} | {row['read_70b'] / 1e9:.1f} GB |")
    lines.append("")
    lines.append(f"A resume's conversion into the neutral form (`reshard._convert_share`): tensors, the checkpoint's fp32 "
                 f"weights and optimizer states; read, the bytes of them rank 0 read for its share among {world} "
                 "ranks (whole tensors: 1/N of the bytes plus at most one tensor); grown, its anonymous memory at its "
                 "peak: one neutral shard pending (16 MiB here, as --shard-mb; 2 GiB in a run) and the tensor being "
                 "read with its states (48 MiB at width 1024) and the gather's copy of it (a one-process checkpoint's are "
                 "memory-mapped, page cache); s, on one core. "
                 f"At 70B (Llama-3-70B: {TARGET_TENSORS / 1e9:.0f} GB of fp32 weights and Adam states) on 1,024 "
                 f"ranks a share is 1/1,024 of it ({TARGET_TENSORS / TARGET_RANKS / 1e9:.2f} GB) plus at most one "
                 f"tensor with its states: the rank that holds the 128,256 x 8,192 embedding reads "
                 f"{3 * TARGET_LARGEST / 1e9:.1f} GB, a rank with one 8,192 x 28,672 MLP matrix 2.8 GB, and the "
                 "conversion takes as long as the largest share, whose memory is that tensor with its states and one "
                 "2 GiB shard; one rank converting it all read "
                 f"{TARGET_TENSORS / 1e9:.0f} GB. Rank 0 holds the model's other entries (buffers) too.")
    return "\n".join(lines)


def render(rows: list[dict], widths: list[int], shard_mb: int) -> str:
    head = ("| layout | what | " + " | ".join(f"width {w}: fp32 / grown / s" for w in widths)
            + " | memory exponent | memory at 70B (fitted) | time at 70B (linear) |")
    lines = [head, "|" + " --- |" * (5 + len(widths))]
    for row in rows:
        cells = [f"{p['fp32'] / 2**20:.0f} MiB / {p['grown'] / 2**20:.0f} MiB / {p['seconds']:.1f}"
                 for p in row["points"]]
        lines.append(f"| {row['layout']} | {row['mode']} | " + " | ".join(cells)
                     + f" | {row['k_mem']:.2f} | {row['mem_70b'] / 2**30:.1f} GiB | {row['time_70b'] / 60:.0f} min |")
    lines.append("")
    lines.append("fp32: the model's fp32 weights; grown: the exporting process's anonymous memory (RssAnon) at its "
                 "peak over its value before the export (glibc's mmap threshold fixed at 4 MiB, see the tool); s: the "
                 "export's seconds, on one core. The time at 70B is linear in the weights from the widest point (the "
                 "smaller ones are mostly fixed costs).")
    bound = 2 * 5e9 + TARGET_LARGEST
    lines.append("")
    lines.append(f"Shards of {shard_mb} MiB here. At 70B with the default 5GB shards the export's own memory is bounded "
                 f"by two shards and the largest tensor: 2 x 5 GB + {TARGET_LARGEST / 1e9:.1f} GB (the 128,256 x "
                 f"8,192 embedding in fp32) = {bound / 2**30:.1f} GiB plus the process's constant, whatever the "
                 "model's size.")
    return "\n".join(lines)


def write_doc(table: str, argv: list[str]) -> None:
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"
    body = (f"{BEGIN}\nMeasured {datetime.date.today().isoformat()} on this CPU machine ({machine}), no GPU, "
            f"with\n\n    python tools/scale_ckpt.py {' '.join(argv)}\n\n{table}\n{END}")
    text = DOC.read_text()
    if BEGIN in text:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        text = text[:start] + body + text[end:]
    else:
        text = text.rstrip() + f"\n\n{HEADING}\n\n{body}\n"
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    sys.exit(main())
