"""Library output that pretrain understands, handled here one message at a time; everything else still prints.

Only what the user should act on reaches the console. Each handler below matches one message by its text and
its category, module or logger, and says why nobody has to act on it, so that a new or changed library message
still shows. What a run prints (tests/multiprocess/test_console.py counts the lines of a 2-process ZeRO-2 run):

- ``install_warning_filters()``: Python warnings, first thing in every process (``pretrain/run.py``), and
  torchao's import messages (``TORCHAO_IMPORT``);
- ``TiedWeightsSaved``: accelerate's "Removed shared tensor" warning, for the weights the model ties;
- ``no_progress_bars()``: transformers' "Writing model shards" bar while pretrain saves a model;
- ``dropping_stdout_lines()``: DeepSpeed's "... built successfully" print while the process group starts;
- ``drop_expert_mesh_messages()``: DTensor's notes on the expert mesh's two-step collectives (``EXPERT_MESH``);
- torchrun's "Setting OMP_NUM_THREADS environment variable for each process to be 1" warning is answered,
  not hidden: pretrain-launch sets the threads per process (``launch.threads_per_process``).
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterable, Iterator

# (message regex, category, module regex, why nobody acts on it)
WARNING_FILTERS: tuple[tuple[str, type[Warning], str, str], ...] = (
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed\.",
     "DeepSpeed's ZeRO (deepspeed/comm/torch.py) calls these deprecated torch collectives (ZeRO-3 at every step, "
     "on every rank); the calls are DeepSpeed's, not the user's, and work in the torch this project pins"),
    (r"FSDP2-wrapped module \((FSDPLlamaRMSNorm, FSDPEmbedding, FSDPLinear|FSDP\w+ForCausalLM)\) returned a view "
     r"tensor", UserWarning, r"torch\.distributed\.fsdp\.",
     "under TP x FSDP2 the root's modules (embedding, final norm, LM head) return DTensor.to_local() of their "
     "sequence- or vocab-sharded outputs, a view; torch warns that an in-place op on it would drop FSDP's "
     "pre-backward hook. Nothing writes these outputs in place (transformers' blocks add the residual out of place, "
     "the loss casts the logits to a new tensor): tests/multiprocess/test_tensor_parallel.py trains the "
     "one-process curve within 1e-5 under TP 2 x FSDP 2 and resumes it exactly"),
)


def install_warning_filters() -> None:
    """Ignore exactly the warnings of ``WARNING_FILTERS`` in this process (``python -W error`` and
    ``PYTHONWARNINGS`` still apply to everything else)."""
    for message, category, module, _why in WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    drop_torchao_import_messages()


class TiedWeightsSaved(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...} while saving" when every name in it is a weight the
    model ties to another (``tie_embeddings``: the LM head is the embedding). safetensors cannot store two
    names for one tensor, so the copy is left out of the checkpoint; loading it back ties the weights again
    (the resume tests continue the exact loss curve). Any other name still warns."""

    LOGGER = "accelerate.utils.other"
    _MESSAGE = re.compile(r"Removed shared tensor (\{.*?\}) while saving")

    def __init__(self, tied_names: Iterable[str]):
        super().__init__()
        self.tied_names = frozenset(tied_names)

    def filter(self, record: logging.LogRecord) -> bool:
        match = self._MESSAGE.search(record.getMessage())
        if match is None:
            return True
        try:
            removed = ast.literal_eval(match.group(1))
        except (ValueError, SyntaxError):
            return True
        return not (isinstance(removed, set) and removed <= self.tied_names)

    @classmethod
    def install(cls, model) -> TiedWeightsSaved:
        """For ``model``'s tied weights (accelerate's ``find_tied_parameters``); returns the filter."""
        from accelerate.utils import find_tied_parameters

        tied = {name for group in find_tied_parameters(model) for name in group}
        log_filter = cls(tied)
        logging.getLogger(cls.LOGGER).addFilter(log_filter)
        return log_filter


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off (``save_pretrained``'s "Writing model shards"): pretrain prints one line
    when the model is written, and a bar's carriage returns garble a log file."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


# DeepSpeed's CPU accelerator prints this from every rank when the process group starts
# (deepspeed/comm/torch.py build_shm_op): the shared-memory collectives loaded, nothing to act on.
DEEPSPEED_BUILT = re.compile(r"^DeepSpeed \S+ built successfully$")


@contextlib.contextmanager
def dropping_stdout_lines(pattern: re.Pattern) -> Iterator[None]:
    """Python-level stdout inside the block is held and printed after it, less the lines matching ``pattern``."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    finally:
        lines = held.getvalue().splitlines(keepends=True)
        sys.stdout.write("".join(line for line in lines if not pattern.match(line.rstrip("\n"))))
        sys.stdout.flush()



class _Dropping(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


# (logger, message regex, why nobody acts on it): what importing torchao logs. transformers imports torchao whenever
# it is installed (transformers/quantizers/auto.py -> quantizer_torchao.py), so every run meets these, float8 or not.
TORCHAO_IMPORT: tuple[tuple[str, str, str], ...] = (
    ("torchao", r"^Failed to load \S*/torchao/_C\S*\.so",
     "torchao's compiled kernels (MX formats, CUTLASS) built for another Python or CUDA than this machine's (its CPU "
     "wheel): float8 training (Float8Linear) uses torch's own float8 matmul and casts, not these"),
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch\.compile",
     "torchao registers its enums with pytree, which newer torch no longer needs; torchao's call, not the user's"),
)


def drop_torchao_import_messages() -> None:
    """The messages of ``TORCHAO_IMPORT`` dropped in this process (once; any other message of those loggers
    still shows). Installed by ``install_warning_filters`` and before pretrain imports torchao itself."""
    for name, pattern, _why in TORCHAO_IMPORT:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Dropping) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Dropping(re.compile(pattern)))


# (logger, message regex, why nobody acts on it): what DTensor logs for expert parallelism's 2-D (efsdp, ep) mesh.
EXPERT_MESH: tuple[tuple[str, str, str], ...] = (
    ("torch.distributed.tensor._redistribute",
     r"from \(_NormPartial\(\S+\), _NormPartial\(\S+\)\) to \(Replicate\(\), Replicate\(\)\), 2 sequential all_reduce",
     "the experts' gradient norm (accelerate's clip_grad_norm_, one per mesh) is summed over efsdp, then ep: two "
     "all-reduces of one scalar per optimizer step instead of one"),
    ("torch.distributed.tensor._redistribute",
     r"from \(_StridedShard\(dim=0, sf=\d+\), Shard\(dim=0\)\) to \(Replicate\(\), Replicate\(\)\), 2 sequential "
     r"all_gather",
     "an expert weight gathered whole (the final model's and the export's full state dict, once per save) over "
     "efsdp, then ep: two all-gathers instead of one, outside the training step"),
)


def drop_expert_mesh_messages() -> None:
    """The messages of ``EXPERT_MESH`` dropped in this process (once); installed where the experts are split
    (pretrain/distributed/expert_parallel.py)."""
    for name, pattern, _why in EXPERT_MESH:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Dropping) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Dropping(re.compile(pattern)))
