"""pretrain-data: the data a run read at a step and the source of each document (which), what it left out (quarantine).

which: the data a run read at an optimizer step, or the steps that read a document; quarantine: the documents a run
left out (stability.rollback.skip=documents, data.exclude).

    pretrain-data which --run runs/tiny --step 40 [--rank R] [--micro M] [--text] [--json]
    pretrain-data which --run runs/tiny --document corpus/part-0001.jsonl:17 [--text] [--json]
    pretrain-data which --run runs/tiny --document json:00000.train.ds:12      (the store's coordinates)
    pretrain-data quarantine --run runs/tiny [--add corpus/part-0001.jsonl:17 | --remove data:00000.train.ds:12]
"""

from __future__ import annotations

import argparse
import json
import sys

from pretrain.cli.options import count
from pretrain.errors import EXIT_USAGE, ConfigError


def _documents(sequence, only: tuple[str, int] | None = None) -> str:
    """Each document of a sequence as its source (FILE:LINE, FILE, hf:NAME:ROW), or its store coordinates
    (FILE.ds:INDEX) where the store does not record sources, with the token range the sequence holds."""
    return " ".join(f"{s.origin if s.origin is not None else f'{s.file}:{s.document}'}"
                    f"[{s.start}:{s.stop}/{s.document_tokens}]" for s in sequence.spans
                    if only is None or (s.file, s.document) == only)


def _one_line(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # quoted, newlines and tabs escaped


def _where(sequence) -> str:
    if sequence.rank is None:
        return f"step {sequence.step} (rank ?)"
    return f"step {sequence.step} rank {sequence.rank} micro {sequence.micro}"


def which(args: argparse.Namespace) -> int:
    from pretrain.checkpoint.rundir import read_run
    from pretrain.data.lookup import RunData  # torch and transformers: after the arguments are read

    if (args.step is None) == (args.document is None):
        raise ConfigError("pretrain-data which takes one of --step N or --document FILE:LINE (or SOURCE:FILE:INDEX)")
    if args.document is not None and (args.rank is not None or args.micro is not None):
        raise ConfigError("--rank and --micro narrow --step; --document lists every rank and micro-step")
    run = RunData.open(read_run(args.run))
    notes = run.notes()
    if args.step is not None:
        sequences = run.sequences(args.step, args.rank, args.micro, with_text=args.text)
        if args.json:
            print(json.dumps([s.to_dict() for s in sequences], indent=1))
            return 0
        for note in notes:
            print(note)
        p = run.plan_at(args.step)
        split = (f"rank/micro: world {p.world_size}, MBS {p.micro_batch_size}, GAS {p.grad_accum_steps}" if p else
                 f"rank/micro: not recorded before the resume at step {run.resume_step}")
        print(f"step {args.step} of {args.run}: {len(sequences)} of {run.plan.global_batch_size} sequences of "
              f"{run.plan.seq_len + 1} tokens (seed {run.recipe.train.seed}; {split}); documents as "
              "FILE:LINE[start:stop/length] (tokens of the document; --json adds the store's coordinates)")
        print(f"  {'rank/micro':>10} {'#':>3}  {'source:row':<18} documents  " + ("" if args.text else "\"preview\""))
        for s in sequences:
            rank = "?" if s.rank is None else f"{s.rank}/{s.micro}"
            line = f"  {rank:>10} {s.position:>3}  {f'{s.source}:{s.row}':<18} {_documents(s)}"
            print(line if args.text else f"{line}  {_one_line(s.preview)}")
            if args.text:
                print(s.text, end="" if s.text.endswith("\n") else "\n")
        return 0
    source, file, index = run.resolve_document(args.document)
    rows, reads = run.document_reads(f"{source}:{file}:{index}")
    text = run.document_text(source, file, index) if args.text else None
    if args.json:
        origin = next((s.origin for r in reads for s in r.spans if (s.file, s.document) == (file, index)), None)
        print(json.dumps({"document": args.document, "source": source, "file": file, "index": index,
                          "origin": origin.to_dict() if origin is not None else None,
                          "rows": [rows.start, rows.stop], "reads": [s.to_dict() for s in reads],
                          **({"text": text} if text is not None else {})}, indent=1))
        return 0
    for note in notes:
        print(note)
    named = f"{args.document} ({source}:{file}:{index} in the store)"
    if not rows:
        print(f"{named}: in no row of its source (tokens past the last whole row are never read)")
    else:
        print(f"{named}: rows {rows.start}..{rows.stop - 1} of its source; read {len(reads)} time(s) in steps "
              f"1..{run.num_steps}")
    for s in reads:
        print(f"  {_where(s)} #{s.position}: row {s.row} {_documents(s, (file, index))}")
    if text is not None:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


def quarantine(args: argparse.Namespace) -> int:
    """List a run's quarantine.json, or add / remove one document (atomically)."""
    from pretrain.data import quarantine as lists

    if args.add is not None and args.remove is not None:
        raise ConfigError("pretrain-data quarantine takes one of --add or --remove")
    path = lists.list_path(args.run)
    if args.add is not None:
        from pretrain.checkpoint.rundir import read_run
        from pretrain.data.lookup import RunData  # torch and transformers: after the arguments are read
        from pretrain.errors import DataError

        run = RunData.open(read_run(args.run))
        source, file, index = run.resolve_document(args.add)  # the source's form (FILE:LINE) or the store's
        data = run.data
        try:
            tokens = len(lists.document_samples(data, source, file, index))
        except DataError as exc:
            raise ConfigError(f"--add {args.add}: {exc}") from None
        added = lists.add_entries(args.run, [lists.entry(data, source, file, index, rollback=None,
                                                         loss_per_token=None, tokens=None, added="by hand")])
        print(f"{args.add}: {'added to' if added else 'already in'} {path} ({tokens} training row(s))")
        return 0
    listed = lists.read_list(args.run, missing_ok=args.remove is None)
    if args.remove is not None:
        lists.parse_document(args.remove)
        kept = [e for e in listed["documents"] if lists.key(e) != args.remove]
        if len(kept) == len(listed["documents"]):
            raise ConfigError(f"--remove {args.remove}: not in {path}; it lists "
                              f"{', '.join(lists.key(e) for e in listed['documents']) or 'nothing'}")
        lists.write_list(args.run, {**listed, "documents": kept})
        print(f"{args.remove}: removed from {path}")
        return 0
    if args.json:
        print(json.dumps(listed, indent=1))
        return 0
    print(f"{path}: {len(listed['documents'])} quarantined document(s)")
    for e in listed["documents"]:
        loss = e.get("loss_per_token")
        why = (f"rollback {e['rollback']}, {loss:.3g} nats/token over {e.get('tokens')} tokens"
               if e.get("rollback") is not None and loss is not None else e.get("added") or "")
        origin = (e.get("origin") or {}).get("name")
        print(f"  {origin or lists.key(e)}  ({lists.key(e)} in the store; {why})" if origin else f"  {lists.key(e)}  {why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain-data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    w = commands.add_parser("which", help="the data of an optimizer step, or the steps that read a document",
                            description="Where each sequence of an optimizer step came from (source, store file, "
                            "document, token offsets, a preview), or every step that read a document. Reads the "
                            "run directory and the token stores it names; nothing is trained or loaded on a GPU.")
    w.add_argument("--run", required=True, help="the run's output_dir (holds run_config.json, recipe.resolved.yaml)")
    w.add_argument("--step", type=count(), help="optimizer step, numbered as in metrics.jsonl (1 = the first)")
    w.add_argument("--rank", type=count(0), help="only this data-parallel rank's micro-batches (under tensor or context parallelism: the global rank "
                                         "// (tp x cp); the ranks of one group read the same)")
    w.add_argument("--micro", type=count(0), help="only this micro-step (0 .. GAS - 1)")
    w.add_argument("--document", metavar="FILE:LINE",
                   help="list the steps that read any token of this document: an input file and its line (jsonl, "
                   "1-based) or record / row (JSON list, parquet; 0-based), a text file alone, hf:NAME:ROW, each "
                   "optionally after SOURCE: (a mixture's source name); or the store's SOURCE:FILE.ds:INDEX (a "
                   "single source is named 'data')")
    w.add_argument("--text", action="store_true", help="print each sequence's whole decoded text (with --document: "
                   "the document's)")
    w.add_argument("--json", action="store_true", help="print JSON for scripts")
    q = commands.add_parser("quarantine", help="a run's quarantined documents: list, add, remove",
                            description="The documents a run quarantined (output_dir/quarantine.json, written by "
                            "stability.rollback.skip=documents; data.exclude reads it): listed, or one added or "
                            "removed. Each edit replaces the file atomically.")
    q.add_argument("--run", required=True, help="the run's output_dir (or a quarantine.json)")
    q.add_argument("--add", metavar="FILE:LINE", help="quarantine this document: as --document of which takes it (an "
                   "input file and line, hf:NAME:ROW, or the store's SOURCE:FILE:INDEX)")
    q.add_argument("--remove", metavar="SOURCE:FILE:INDEX", help="take this document off the list")
    q.add_argument("--json", action="store_true", help="print JSON for scripts")
    args = parser.parse_args(argv)
    try:
        return quarantine(args) if args.command == "quarantine" else which(args)
    except ConfigError as exc:  # DataError is one: a store gone or damaged
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
