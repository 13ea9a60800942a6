"""``checkpoint.save_final_model``: the trained model and its tokenizer as one transformers directory, checked before
training (a tokenizer that would not load back is found now, not after the run).

Written by every rank in parallel, not gathered onto rank 0: save_pretrained's shard plan (``hf_save.shard_plan``,
``checkpoint.final_model_shard_size``) is made from the model's full shapes on every rank alike, and shard k belongs
to rank k mod world. The ranks go through the plan's tensors in order, each tensor gathered by all of them (FSDP2's
and TP's DTensors: ``full_tensor``; ZeRO-3: ``GatheredParameters``; a replicated parameter: the rank's own copy),
kept only by its shard's rank; a completed shard goes to that rank's writer thread while the gathering goes on, so
the ranks write at once, each holding at most the shard it writes and the one it gathers. The only wait is for the
last shards; then rank 0 writes the index (each shard's names read back from its header), the config and the
tokenizer, and renames the directory into place.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pretrain.data import sample_val_texts
from pretrain.distributed.agreement import from_rank0
from pretrain.errors import ConfigError
from pretrain.model.export_checks import check_tokenizer_round_trip
from pretrain.recipe.config import Recipe


class FinalModel:
    """The export at the end of the run (``output_dir/final_model``)."""

    def __init__(self, accelerator, recipe: Recipe, tokenizer, config, log: Callable[[str], None]):
        self.accelerator = accelerator
        self.tokenizer = tokenizer
        self.path = Path(recipe.output_dir) / "final_model"
        from huggingface_hub.serialization._base import parse_size_to_int

        self.shard_size = parse_size_to_int(recipe.checkpoint.final_model_shard_size)
        self.log = log
        self.val_texts = self.check(recipe, config)

    def check(self, recipe: Recipe, config) -> list[str]:
        """The final model's tokenizer check (pretrain.model.export_checks), now rather than after training: rank 0
        encodes a validation sample both ways; a tokenizer that will not load back with the training ids is
        one ConfigError on every rank. Returns the sample (rank 0's; [] elsewhere) for the export to check again."""
        texts, problem = [], None
        if self.accelerator.is_main_process:
            texts = sample_val_texts(recipe.data)
            try:
                check_tokenizer_round_trip(config, self.tokenizer, texts)
            except ConfigError as exc:
                problem = str(exc)
        problem = from_rank0(problem)
        if problem is not None:
            raise ConfigError(f"{problem} (checkpoint.save_final_model=false trains without the final export)")
        return texts

    def save(self, model) -> None:
        import shutil
        import time
        from concurrent.futures import ThreadPoolExecutor

        from pretrain.model import hf_save
        from pretrain.model.export_checks import ready_for_generation, save_verified_tokenizer

        acc, start = self.accelerator, time.perf_counter()
        module = acc.unwrap_model(model)
        tensors = full_tensors(module)
        plan = hf_save.shard_plan(module, {n: spec for n, (spec, _) in tensors.items()}, self.shard_size)
        files = list(plan.filename_to_tensors)
        tmp = self.path.with_name(f".tmp-{self.path.name}")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()  # the directory exists before any rank writes into it
        rank, world = acc.process_index, acc.num_processes
        with ThreadPoolExecutor(1, thread_name_prefix="final-model") as writer:
            pending = None
            for k, filename in enumerate(files):
                mine = k % world == rank
                shard = {}
                for name in plan.filename_to_tensors[filename]:
                    value = gathered(tensors[name][1], keep=mine)  # a collective: every rank, in the plan's order
                    if mine:
                        shard[name] = value
                if mine:
                    if pending is not None:
                        pending.result()  # one shard written while the next is gathered
                    pending = writer.submit(hf_save.write_shard, module, shard, tmp / filename)
                del shard
            if pending is not None:
                pending.result()
        acc.wait_for_everyone()  # every shard written: each rank's last write, one shard, is all this waits for
        if acc.is_main_process:
            ready_for_generation(module, self.tokenizer)
            hf_save.write_config(module, tmp)
            hf_save.write_index(module, tmp, plan)
            save_verified_tokenizer(self.tokenizer, tmp, self.val_texts)
            if self.path.exists():
                shutil.rmtree(self.path)
            tmp.rename(self.path)
            self.log(f"export: transformers model and tokenizer in {self.path} ({len(files)} shard(s) written by "
                     f"{min(world, len(files))} rank(s) in parallel, {time.perf_counter() - start:.1f}s)")
        acc.wait_for_everyone()


def full_tensors(module) -> dict[str, tuple]:
    """Each state-dict entry of ``module`` (unwrapped: FSDP2's and TP's DTensors, ZeRO-3's partitioned parameters):
    (its full shape and dtype as ``hf_save.Spec``, the tensor), tied aliases left out."""
    from pretrain.model.hf_save import Spec

    named = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    aliases = {n for n, _ in module.named_parameters(remove_duplicate=False)} - {n for n, _ in module.named_parameters()}
    out = {}
    for name in module.state_dict(keep_vars=True):
        if name in aliases or name not in named:
            continue
        tensor = named[name]
        shape = tuple(getattr(tensor, "ds_shape", None) or tensor.shape)
        out[name] = (Spec(shape, tensor.dtype), tensor)
    return out


def gathered(tensor, keep: bool = True):
    """The full value of one tensor on CPU (None unless ``keep``); a collective for a sharded one (every rank calls
    it, in one order), nothing at all for a replicated one that is not kept."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        full = tensor.full_tensor()
        return full.detach().cpu() if keep else None
    if hasattr(tensor, "ds_id"):  # DeepSpeed ZeRO-3: gathered for the copy, partitioned again after
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor]):
            return tensor.detach().cpu().clone() if keep else None
    return tensor.detach().cpu().clone() if keep else None
