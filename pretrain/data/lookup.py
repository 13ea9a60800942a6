"""Which data a run read at an optimizer step, and at which steps it read a document (``pretrain-data which``).

The answer comes from the run directory alone (``checkpoint/rundir.read_run`` reads it into a ``RunRecord``):
``recipe.resolved.yaml`` (seed, data section, mixture), ``run_config.json`` (the batch plan, the horizon, each
store's path, the latest resume), the rollbacks of the run's timeline, and the token stores those paths name. The order is not recomputed here: ``build_train_loader`` builds the same sample order and
rank slices (``RankBatchSampler``) and the same dataset the run's loader read, so the lookup cannot drift from
training. Steps are numbered as in metrics.jsonl: step N is the N-th optimizer step, which reads global batch
N - 1 of the order.

World size. A resume keeps the global batch size, the seed and the data (a change is refused), so the sequences
of every step are the same on any world size; only how they were split over ranks and micro-steps depends on the
layout of the launch that ran the step. Every start of a run appends its step and plan to ``launches.jsonl``: step s
is split as the last launch that started before s says. A run directory written before that file existed falls back
on ``run_config.json`` (the latest launch's plan, for the steps after its resume) and, for earlier steps, on the
checkpoints left (each records the plan that wrote it) when they agree; otherwise those steps are listed without
rank and micro-step, and asking for a rank or micro-step there is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data import MixtureData, PackedData, open_store
from pretrain.data.loader import RankBatchSampler, build_train_loader
from pretrain.data.mixture import SINGLE, MixtureRows, data_changes, data_identity
from pretrain.data.order import ORDER_VERSION, data_horizon, removals_of, steps_reading
from pretrain.data.provenance import (
    NO_PROVENANCE,
    document_rows,
    find_source_document,
    has_provenance,
    row_spans,
)
from pretrain.errors import ConfigError, DataError
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import Recipe

PREVIEW_CHARS = 60
PREVIEW_TOKENS = 64  # decoded for the preview: ~60 characters of text need far fewer tokens
STORE_FILE = re.compile(r"^\d{5}\.train\.ds$")  # a split file of the store: the store form of --document
PLAN_KEYS = ("global_batch_size", "micro_batch_size", "grad_accum_steps", "world_size", "seq_len")


@dataclass
class SequenceRead:
    """One sequence of a global batch: where it sits in the step and where its tokens come from."""

    step: int
    rank: int | None  # None: the layout that ran this step is not known (see the module docstring)
    micro: int | None
    position: int  # within the micro-batch (or, rank None, within the global batch)
    source: str  # the mixture source's name; "data" for a single source
    row: int  # the row of that source's training split
    spans: list  # provenance.Span: the documents the row holds, in order
    preview: str = ""  # the first PREVIEW_CHARS characters of the decoded row
    tokens: Any = field(default=None, repr=False)  # the row's seq_len + 1 token ids, as the loader reads them
    text: str | None = None  # the whole row decoded (``--text``)

    def to_dict(self) -> dict[str, Any]:
        out = {"step": self.step, "rank": self.rank, "micro": self.micro, "position": self.position,
               "source": self.source, "row": self.row, "documents": [s.to_dict() for s in self.spans],
               "preview": self.preview}
        return out if self.text is None else {**out, "text": self.text}


def _plan(config: dict[str, Any], where: str) -> BatchPlan:
    try:
        return BatchPlan(**{k: int(config[f"plan/{k}"]) for k in PLAN_KEYS})
    except (KeyError, TypeError, ValueError, AssertionError):  # AssertionError: GBS != MBS x GAS x world
        raise ConfigError(f"{where} does not record the run's batch plan (plan/...); it was not written by this "
                          "version of pretrain: rerun the run's command to rewrite it") from None


def _layout(plan: BatchPlan) -> tuple[int, int, int]:
    return plan.world_size, plan.micro_batch_size, plan.grad_accum_steps


@dataclass(frozen=True)
class RunRecord:
    """What the lookup reads of a run directory (``checkpoint/rundir.read_run`` gathers it)."""

    run_dir: Path
    config_file: Path  # run_config.json, for messages
    recipe: Recipe  # recipe.resolved.yaml
    config: dict[str, Any]  # run_config.json
    checkpoint_plans: list[dict[str, Any]]  # the batch plan each checkpoint left in the run directory recorded
    trained_on: tuple[str, dict[str, Any]] | None  # the newest checkpoint's name and data identity (None: none yet)
    rollbacks: list[dict[str, Any]]  # the rollbacks of the run's timeline (their skipped global batches)
    launches: list[dict[str, Any]] = field(default_factory=list)  # launches.jsonl: each start, its step and plan


class RunData:
    """A run's training data as its loader reads it: opened from the run directory (``RunData.open``)."""

    def __init__(self, run_dir: Path, recipe: Recipe, plan: BatchPlan, num_steps: int, data: PackedData | MixtureData,
                 early_plan: BatchPlan | None, resume_step: int, rollbacks: list[dict[str, Any]],
                 launches: list[dict[str, Any]] = (), order_version: int = ORDER_VERSION):
        self.run_dir, self.recipe, self.plan, self.num_steps, self.data = run_dir, recipe, plan, num_steps, data
        self.early_plan, self.resume_step = early_plan, resume_step
        # (from_step, plan) of each launch, oldest first: step s ran on the last one that started before it
        self.launches = [(int(r["from_step"]), BatchPlan(**{k: int(r["plan"][k]) for k in PLAN_KEYS}))
                         for r in launches]
        # The run's own construction of the loader: the dataset it reads and the order behind its batch sampler.
        # What rollbacks (stability.rollback) and data.exclude left out is left out here too.
        loader, self.order = build_train_loader(data, recipe.data, plan, 0, recipe.train.seed, 0, pin_memory=False,
                                                skipped=removals_of(rollbacks), order_version=order_version)
        # data.on_exhausted=stop ends a run before its horizon, at the step training itself computes
        stop_step, _ = data_horizon(self.order, num_steps, recipe.data.on_exhausted)
        self.num_steps = stop_step if stop_step is not None else num_steps
        self.dataset = loader.dataset
        if isinstance(data, MixtureData):
            self.names, self.parts, self.offsets = data.train.names, data.train.parts, data.train.offsets
        else:
            self.names, self.parts, self.offsets = [SINGLE], [data.train], np.array([0, len(data.train)])
        self.tokenizer = data.tokenizer

    @classmethod
    def open(cls, record: RunRecord) -> RunData:
        config = record.config
        plan = _plan(config, str(record.config_file))
        num_steps = int(config.get("train/num_steps") or 0)
        early_plan, resume_step = _early_plan(config, plan, record.checkpoint_plans)
        data = _open_stores(record.recipe, config)
        _check_trained_on(record, data)
        # the run's sample order (run_config.json's data/order since it was recorded; a run begun before: numpy's)
        order_version = int(config.get("data/order/version") or 1)
        return cls(record.run_dir, record.recipe, plan, num_steps, data, early_plan, resume_step, record.rollbacks,
                   record.launches, order_version)

    # ---- step -> sequences --------------------------------------------------------------------------------

    def plan_at(self, step: int) -> BatchPlan | None:
        """The plan whose launch ran ``step`` (1-based): launches.jsonl's; for a run directory written before it was
        recorded, the latest launch's after its resume, else the checkpoints' if they agree; None where nothing says."""
        ran = [plan for from_step, plan in self.launches if from_step < step]
        if ran:
            return ran[-1]
        return self.plan if step > self.resume_step else self.early_plan

    def check_step(self, step: int) -> None:
        if not 1 <= step <= self.num_steps:
            raise ConfigError(f"--step {step}: the run {self.run_dir} has steps 1..{self.num_steps} (its horizon: "
                              "train.max_steps or max_tokens, or where data.on_exhausted=stop ends it); pass a step "
                              "in that range")

    def notes(self) -> list[str]:
        """One line per store that cannot name source documents (built before provenance was recorded)."""
        out = []
        for name, part in zip(self.names, self.parts, strict=True):
            if not has_provenance(part):
                store = part.files[0].parent.parent if part.files else Path("?")
                label = f"source {name!r}: " if name != SINGLE else ""
                out.append(f"note: {label}the token store at {store} "
                           + NO_PROVENANCE.format(manifest=store / "manifest.json"))
        return out

    def sequences(self, step: int, rank: int | None = None, micro: int | None = None,
                  with_tokens: bool = False, with_text: bool = False) -> list[SequenceRead]:
        """Every sequence of optimizer step ``step`` (1-based), narrowed to a rank and/or micro-step."""
        self.check_step(step)
        plan = self.plan_at(step)
        if plan is None:
            if rank is not None or micro is not None:
                raise ConfigError(
                    f"step {step} ran before the resume at step {self.resume_step}, and the run directory does not "
                    "record the layout that ran it (its checkpoints hold different world sizes or batch splits): "
                    "the step's sequences are known, not their ranks; drop --rank and --micro")
            indices = self.order.global_batch(step - 1)
            return [self._sequence(step, None, None, p, int(i), with_tokens, with_text) for p, i in enumerate(indices)]
        for name, value, limit in (("--rank", rank, plan.world_size), ("--micro", micro, plan.grad_accum_steps)):
            if value is not None and not 0 <= value < limit:
                raise ConfigError(f"{name} {value}: step {step} ran on {plan.world_size} process(es) with "
                                  f"{plan.grad_accum_steps} micro-step(s) each; pass {name} from 0 to {limit - 1}")
        out = []
        for r in range(plan.world_size) if rank is None else [rank]:
            micro_batches = RankBatchSampler(self.order, plan, r).micro_batch_indices(step - 1)
            for m in range(plan.grad_accum_steps) if micro is None else [micro]:
                out += [self._sequence(step, r, m, p, i, with_tokens, with_text)
                        for p, i in enumerate(micro_batches[m])]
        return out

    def _sequence(self, step: int, rank, micro, position: int, index: int, with_tokens: bool,
                  with_text: bool = False) -> SequenceRead:
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        row = index - int(self.offsets[source])
        tokens = self.dataset[index]
        text = self.tokenizer.decode(tokens[:PREVIEW_TOKENS].tolist())
        return SequenceRead(step, rank, micro, position, self.names[source], row, row_spans(self.parts[source], row),
                            text[:PREVIEW_CHARS], tokens if with_tokens else None,
                            self.tokenizer.decode(tokens.tolist()) if with_text else None)

    def document_text(self, source: str, file: str, document: int) -> str:
        """A training document's whole text, decoded from the store's tokens (its eos included)."""
        part = self.parts[self.names.index(source)]
        shard = [path.name for path in part.files].index(file)
        ends = np.memmap(Path(f"{part.files[shard]}.index"), dtype="<u8", mode="r")
        base = int(part.offsets[shard])
        start, stop = base + (int(ends[document - 1]) if document else 0), base + int(ends[document])
        return self.tokenizer.decode(part.tokens(start, stop).tolist())

    # ---- document -> steps --------------------------------------------------------------------------------

    def resolve_document(self, text: str) -> tuple[str, str, int]:
        """(source, split file, document index) of a document named in the store's form ``SOURCE:FILE:INDEX`` (as
        ``--step`` prints it in ``--json``) or the corpus's: ``[SOURCE:]FILE:LINE`` (a jsonl line, 1-based; a JSON
        record or parquet row, 0-based), ``[SOURCE:]FILE`` (a whole text file) or ``hf:NAME:ROW``. A lookup in each
        store's provenance; one ConfigError naming what was not found."""
        parts = text.rsplit(":", 2)
        if len(parts) == 3 and STORE_FILE.match(parts[1]) and parts[2].isdigit():
            return parse_document(text, self.names)
        named, rest = None, text
        head, sep, tail = text.partition(":")
        if sep and head in self.names and head != "hf":
            named, rest = head, tail
        if rest.startswith("hf:"):
            dataset, _, row = rest[3:].rpartition(":")
            if not dataset or not row.isdigit():
                raise ConfigError(f"--document {text!r}: write an hf: dataset's row as hf:NAME:ROW (0-based, empty "
                                  "rows counted), e.g. hf:roneneldan/TinyStories:1234")
            candidates = [n for n, p in zip(self.names, self.parts, strict=True)
                          if (p.provenance or {}).get("hf", {}).get("dataset") == dataset]
            file, index = "", int(row)
        else:
            file, _, number = rest.rpartition(":")
            file, index = (file, int(number)) if file and number.isdigit() else (rest, None)
            candidates = [n for n, p in zip(self.names, self.parts, strict=True) if not (p.provenance or {}).get("hf")]
        if named is not None:
            candidates = [n for n in candidates if n == named]
        for name in candidates:
            found = find_source_document(self.parts[self.names.index(name)], file, index)
            if found is not None:
                return name, found[0], found[1]
        for name in candidates:  # the validation split: named so, not "not found"
            val = self.data.sources[name].val if isinstance(self.data, MixtureData) else self.data.val
            found = find_source_document(val, file, index)
            if found is not None:
                label = f" of source {name!r}" if name != SINGLE else ""
                raise ConfigError(f"--document {text!r} is in the validation split{label} (document {found[1]} of "
                                  f"{found[0]}): training never read it; evaluation does")
        missing = [n for n in self.names if not has_provenance(self.parts[self.names.index(n)])]
        hint = (f"; the store(s) of {', '.join(missing)} were built before sources were recorded: name the document "
                "as SOURCE:FILE:INDEX (see --json), or rebuild them" if missing else "")
        where = ("a jsonl line is FILE:LINE (1-based), a JSON record or parquet row FILE:ROW (0-based), a text "
                 "file FILE alone, relative to the source's directory; empty lines hold no document")
        raise ConfigError(f"--document {text!r}: no training document of the run's source(s) "
                          f"{', '.join(candidates) or '(none of that kind)'} came from there ({where}){hint}")

    def document_reads(self, document: str) -> tuple[range, list[SequenceRead]]:
        """(The rows of its source that hold the document (``resolve_document``'s forms), every read of them in
        steps 1..num_steps.) The steps are those the rows' positions in the order fall in (``order.steps_reading``:
        inverted permutations, not one global batch per step)."""
        source, file, index = self.resolve_document(document)
        part = self.names.index(source)
        try:
            rows = document_rows(self.parts[part], file, index)
        except DataError as exc:
            raise ConfigError(f"--document {document}: source {source!r}: {exc}") from None
        wanted = np.arange(rows.start, rows.stop, dtype=np.int64) + int(self.offsets[part])
        reads = []
        for step in steps_reading(self.order, wanted, self.num_steps).tolist() if len(wanted) else []:
            reads += [s for s in self.sequences(step + 1) if s.source == source and s.row in rows]
        return rows, reads


def parse_document(text: str, names: list[str]) -> tuple[str, str, int]:
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        raise ConfigError(f"--document {text!r}: expected SOURCE:FILE:INDEX, e.g. {names[0]}:00000.train.ds:12 "
                          "(as `pretrain-data which --step N` prints them)")
    if parts[0] not in names:
        raise ConfigError(f"--document {text!r}: the run has no source {parts[0]!r}; its sources are "
                          f"{', '.join(names)}")
    return parts[0], parts[1], int(parts[2])


def _early_plan(config: dict[str, Any], plan: BatchPlan, checkpoint_plans: list[dict[str, Any]]
                ) -> tuple[BatchPlan | None, int]:
    """(The plan of steps up to the latest resume, None where unknown; that resume's step, 0 if none)."""
    resume_step = config.get("resume/step")
    if not isinstance(resume_step, int) or resume_step <= 0:
        return plan, 0
    layouts = {tuple(saved.get(k) for k in ("world_size", "micro_batch_size", "grad_accum_steps"))
               for saved in checkpoint_plans}
    return (plan if layouts <= {_layout(plan)} else None), resume_step


def _check_trained_on(record: RunRecord, data: PackedData | MixtureData) -> None:
    """The stores opened hold the tokens the run trained on (its newest checkpoint's data identity: shard
    checksums), else the answer would name other documents: one ConfigError. A run without a checkpoint yet
    has nothing to compare with."""
    if record.trained_on is None:
        return
    checkpoint, saved = record.trained_on
    opened = data_identity(data)
    changes = data_changes(saved, {name: (identity, None) for name, identity in opened.items()}, opened)
    if changes:
        raise ConfigError(f"the token store(s) {record.config_file} names are not the data the run "
                          f"trained on ({checkpoint}): {'; '.join(changes)}. The lookup reads the stores the run "
                          "read: restore them at those paths")


def _open_stores(recipe: Recipe, config: dict[str, Any]) -> PackedData | MixtureData:
    """Each store at the path the run recorded, opened from its manifest alone (no corpus, no tokenizer
    training), with the recipe's row length and data.train_subset, and verified, as the run opened it."""
    data_cfg = recipe.data
    names = [m.name for m in data_cfg.mixture] or [SINGLE]
    opened = {}
    for name in names:
        key = f"data/mixture/{name}/cache_dir" if data_cfg.mixture else "data/cache_dir"
        path = config.get(key)
        if not path:
            raise ConfigError(f"run_config.json records no store for {name!r} ({key}); rerun the run's command to "
                              "rewrite it")
        cfg = data_cfg.source_config(name) if data_cfg.mixture else data_cfg
        # verified as the run verifies a store it opens (every file's checksum up to VERIFY_ON_OPEN_MAX_BYTES, the
        # sizes beyond): a store changed at the same size is refused here as training refuses it
        opened[name] = open_store(cfg.model_copy(update={"store": path}), log=lambda _: None, checksums=None)
    if not data_cfg.mixture:
        return opened[SINGLE]
    first = opened[names[0]]
    return MixtureData(train=MixtureRows(names, [d.train for d in opened.values()]), sources=opened,
                       weights=data_cfg.mixture_weights(), tokenizer=first.tokenizer, stats={})
