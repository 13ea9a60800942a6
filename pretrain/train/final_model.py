"""``checkpoint.save_final_model``: the trained model and its tokenizer as one transformers directory, checked before
training (a tokenizer that would not load back is found now, not after the run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pretrain.data import sample_val_texts
from pretrain.distributed.agreement import from_rank0
from pretrain.errors import ConfigError
from pretrain.model.build import save_pretrained_model
from pretrain.model.export_checks import check_tokenizer_round_trip
from pretrain.recipe.config import Recipe


class FinalModel:
    """The export at the end of the run (``output_dir/final_model``)."""

    def __init__(self, accelerator, recipe: Recipe, tokenizer, config, log: Callable[[str], None]):
        self.accelerator = accelerator
        self.tokenizer = tokenizer
        self.path = Path(recipe.output_dir) / "final_model"
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
        acc = self.accelerator
        state_dict = acc.get_state_dict(model)  # gathers ZeRO-3 / FSDP shards: every rank takes part
        if acc.is_main_process:
            save_pretrained_model(acc.unwrap_model(model), state_dict, self.tokenizer, self.path, self.val_texts)
            self.log(f"export: transformers model and tokenizer in {self.path}")
        acc.wait_for_everyone()
