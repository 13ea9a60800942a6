"""Shape facts measured from the model itself, for an architecture without a closed form in ``pretrain.recipe.shape``.

Any model transformers can build as a causal LM gets its parameters counted on a meta-device build and its matmul
FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` over one forward on the meta device: the method
tests/train/test_metrics.py validates the closed forms with, so the two agree where both exist (tested). Nothing is
allocated and no weight is drawn. The FLOPs keep ``shape.CONVENTION``: the counter sees every matmul (the LM head
too, tied or not) and no embedding lookup, bias or norm; eager attention makes QK^T and AV plain matmuls over the
full seq_len x seq_len scores; training = 3 x the forward.

Closed forms stay the fast path (no torch import for pretrain-estimate and pretrain-plan); this module imports
torch and transformers and is asked only when ``shape`` has no formula.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from pretrain.errors import ConfigError
from pretrain.recipe.recompute import checkpointed_blocks
from pretrain.recipe.recompute import normalize as normalize_policy
from pretrain.recipe.shape import FlopsPerToken


@dataclass(frozen=True)
class MeasuredShape:
    """What one meta-device build and one meta forward of ``seq_len`` tokens say about a model."""

    arch: str
    num_params: int
    """Unique parameters (a tied embedding counts once)."""
    matmul_params: int
    """N of the convention: 2-D weights outside embedding tables, the LM head counted even when tied."""
    forward_flops_per_token: float
    head_flops_per_token: float
    """The LM head's share of the forward (2 V d): not part of a block, so never recomputed."""
    num_layers: int

    def flops_per_token(self, activation_checkpointing: str = "none") -> FlopsPerToken:
        """Training FLOPs per token: 3 x the counted forward; a checkpointed block's forward once more for
        ``hardware_flops`` (its share of the blocks' forward, the down projection included: the closed forms
        subtract it where non-reentrant checkpointing skips it, so this is an upper bound by that one matmul)."""
        model = 3 * self.forward_flops_per_token
        policy = normalize_policy(activation_checkpointing)
        recomputed = 0.0
        if policy != "selective" and self.num_layers:
            block_forward = (self.forward_flops_per_token - self.head_flops_per_token) / self.num_layers
            recomputed = checkpointed_blocks(policy, self.num_layers) * block_forward
        return FlopsPerToken(model, model + recomputed, self.matmul_params, convention=MEASURED_CONVENTION)


MEASURED_CONVENTION = (
    "model FLOPs/token = 3 x one forward's matmul FLOPs, counted by FlopCounterMode on the meta device (no closed form "
    "for this architecture; the same convention: every matmul, the LM head, attention over the full seq_len)")


def _meta_model(config: PreTrainedConfig) -> PreTrainedModel:
    """The causal LM of ``config`` with every parameter and buffer on the meta device, eager attention (plain matmuls
    the counter sees). The class is called directly: ``from_config`` would partition it under a live ZeRO-3 config."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        raise ConfigError(f"model_type = {config.model_type!r} has no causal-LM class in transformers")
    config = config.__class__.from_dict({**config.to_dict(), "use_cache": False})
    config._attn_implementation = "eager"
    with torch.device("meta"):
        return model_class(config)


def measure(config: PreTrainedConfig, seq_len: int) -> MeasuredShape:
    """Parameters and forward matmul FLOPs per token of ``config``'s causal LM on sequences of ``seq_len`` tokens."""
    try:
        model = _meta_model(config)
        num_params = sum(p.numel() for p in model.parameters())
        embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        head = model.get_output_embeddings()
        head_params = head.weight.numel() if head is not None else 0
        matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embedding_weights)
        if head is not None and id(head.weight) in embedding_weights:
            matmul += head_params  # tied: the table is also the LM head's V x d matmul
        input_ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
        # an explicit mask: without one transformers looks for packed sequences in the position ids, reading a
        # value a meta tensor does not have
        attention_mask = torch.ones(1, seq_len, dtype=torch.long, device="meta")
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a foreign model's meta forward means "not measurable"
        raise ConfigError(f"model_type = {config.model_type!r}: no closed form, and its FLOPs could not be measured on "
                          f"the meta device ({type(exc).__name__}: {exc})") from None
    num_layers = getattr(config, "num_hidden_layers", None) or 0
    return MeasuredShape(config.model_type, num_params, matmul, counter.get_total_flops() / seq_len,
                         2 * head_params, num_layers)
