"""`pretrain-launch`: check a launch before any process starts, then hand it to `accelerate launch`.

    pretrain-launch --config_file accelerate_configs/zero2.yaml [--num_processes 2 ...] \\
        [--gpu NAME | --gpu-memory-gib GIB] [--force] --recipe recipes/tiny.yaml [key.path=value ...]

Everything `accelerate launch` would only discover inside N processes (a missing accelerate config, a
batch size that does not divide for its world size, a DeepSpeed JSON that contradicts the recipe, fp16
without a GPU) is reported here as one message with exit code 2. Then the command is exactly
`accelerate launch <accelerate args> pretrain/run.py --recipe ... [overrides]`.

The checkpoint the run would resume (checkpoint.resume, as rank 0 chooses it) is checked against the launch's
layout by the object every process resumes with (train/resume.py, Resume.plan): a checkpoint no process could load is refused
in about two seconds, with the pretrain-launch command that resumes it.

Memory too: the estimator (pretrain/memory, as `pretrain-estimate` reports it) sizes one GPU's share of
the run on the launch's layout and world size with the recipe's MBS and GAS. A run that does not fit the
GPU is refused (exit 2) with the estimate, the GPU's capacity, and the best layout `pretrain-plan` finds
for the same nodes and GPUs per node, with the commands that write its accelerate config and launch it.

pretrain-launch's own options, given before --recipe like accelerate's, and not passed to accelerate:

--gpu NAME            the GPU the run will use, a name from pretrain-estimate --list-gpus (H100-80GB,
                      A100-40GB, ...). Without it, the GPU of this machine when CUDA sees one (a launch
                      from a GPU node, unless --cpu or use_cpu: true); with neither (a login node, a CPU
                      machine) memory is not checked.
--gpu-memory-gib GIB  a device capacity the table lacks (with --gpu: that card's rates for the planner).
--force               launch a run that does not fit anyway, with one warning line.
--doctor              first run `pretrain doctor` under the same accelerate launch (every rank's compute,
                      memory, collectives and output_dir, judged per host); train only if every host
                      passes, else exit with the doctor's status (1) and its table naming the hosts.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from pretrain.cli.prelaunch import own_options, preflight, split_args
from pretrain.distributed.layout import DOCTOR_ENTRY, accelerate_command, threads_per_process
from pretrain.distributed.supervise import run_launcher
from pretrain.errors import EXIT_INTERRUPTED, EXIT_USAGE, ConfigError
from pretrain.system.environment import use_environment_op_builds


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C before the launcher takes it (the checks, the doctor): nothing trained yet
        print("interrupted: before the launch", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    if "--recipe" not in argv and {"-h", "--help"} & set(argv):
        print(__doc__.strip())  # after --recipe, --help is accelerate's own
        return 0
    try:
        accelerate_args, run_args = split_args(argv)
        options, accelerate_args = own_options(accelerate_args)
        launch = preflight(accelerate_args, run_args, options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    command = accelerate_command(run_args[1], run_args[2:], accelerate_args=accelerate_args)
    environment, threads = dict(os.environ), ""
    use_environment_op_builds(environment)  # the ops the launch builds: in this environment's own directory
    if "OMP_NUM_THREADS" not in environment:  # else torchrun sets 1 and warns that it should be tuned
        environment["OMP_NUM_THREADS"] = str(threads_per_process(launch.world_size // launch.num_nodes))
        threads = f"OMP_NUM_THREADS={environment['OMP_NUM_THREADS']} "
    if options.doctor:
        doctor = accelerate_command(run_args[1], run_args[2:], accelerate_args=accelerate_args, entry=DOCTOR_ENTRY)
        print(f"doctor: {threads}" + " ".join(shlex.quote(c) for c in doctor), flush=True)
        status = subprocess.run(doctor, env=environment).returncode
        if status != 0:
            print(f"doctor: exit {status}; not training (the hosts and figures are above and in the recipe's "
                  "output_dir/doctor.json)", file=sys.stderr, flush=True)
            return status
    print(f"launch: {threads}" + " ".join(shlex.quote(c) for c in command), flush=True)
    # Not exec'd: pretrain-launch stays its parent and takes Ctrl-C, so that torchrun prints no traceback for
    # it and the shell sees 130 (pretrain/distributed/supervise.py).
    return run_launcher(command, environment)


if __name__ == "__main__":
    sys.exit(main())
