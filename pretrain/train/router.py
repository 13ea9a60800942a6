"""Mixture of experts in training: the router's outputs of each micro-step, kept on the device until a
logging step reads them.

transformers' MoE causal LMs (olmoe, qwen3_moe, mixtral) compute the load-balancing loss themselves when
the forward is asked for ``output_router_logits`` and add ``router_aux_loss_coef`` x it to the loss they
return, after the model's ``loss_function`` (pretrain's chunked or transformers' plain loss): the objective
gets it exactly once, per micro-batch, as transformers defines it. The trainer asks for it in its training
forward only (``forward_kwargs``), and takes the weighted term back out of the loss it logs and gates on, so
``train/loss`` stays the cross-entropy of every other architecture. These models are dropless: every token
reaches its top-k experts (no capacity factor), so there is no dropped or overflow share to log.
"""

from __future__ import annotations

import statistics

import torch


class RouterStats:
    """Per optimizer step: the load-balancing loss (summed over micro-steps) and, per layer, how many
    token-to-expert assignments each expert received. Device tensors only: no synchronization until
    ``metrics`` (a logging step)."""

    def __init__(self, config):
        self.coef = float(config.router_aux_loss_coef)
        self.top_k = int(config.num_experts_per_tok)
        self.aux_sum: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None  # num_layers x num_experts
        self.micro_steps = 0

    @classmethod
    def for_model(cls, config) -> RouterStats | None:
        """Stats for an MoE config (one with ``router_aux_loss_coef`` and a top-k), None for a dense one."""
        if getattr(config, "num_experts_per_tok", None) is None or not hasattr(config, "router_aux_loss_coef"):
            return None
        return cls(config)

    forward_kwargs = {"output_router_logits": True}
    """What the training forward passes so that transformers computes (and adds) the load-balancing loss."""

    def record(self, output) -> torch.Tensor:
        """Keep one micro-step's aux loss and expert counts; returns the weighted aux term transformers added
        to ``output.loss`` (detached), for the caller to take out of the loss it logs."""
        aux = output.aux_loss.detach().float()
        with torch.no_grad():
            logits = torch.stack([layer.detach() for layer in output.router_logits])  # L x tokens x E
            picked = logits.topk(self.top_k, dim=-1).indices.reshape(logits.shape[0], -1)
            counts = torch.zeros(logits.shape[0], logits.shape[-1], device=logits.device)
            counts.scatter_add_(1, picked, torch.ones_like(picked, dtype=counts.dtype))
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        self.counts = counts if self.counts is None else self.counts + counts
        self.micro_steps += 1
        return aux * self.coef

    def metrics(self, accelerator) -> dict[str, float]:
        """The step's router metrics, summed over every rank, and the stats reset. Collective: every rank calls
        it on the same steps."""
        if self.counts is None:
            return {}
        # Expensive device-to-host synchronization: only on logging steps.
        aux_mean = accelerator.reduce(self.aux_sum, reduction="mean").item() / self.micro_steps
        counts = accelerator.reduce(self.counts, reduction="sum").cpu()
        self.aux_sum, self.counts, self.micro_steps = None, None, 0
        share = counts / counts.sum(dim=1, keepdim=True)
        metrics = {"train/router_aux_loss": aux_mean}
        cvs = []
        for layer, layer_share in enumerate(share.tolist()):
            cv = statistics.pstdev(layer_share) / statistics.fmean(layer_share)  # 0 = perfectly balanced
            cvs.append(cv)
            metrics[f"moe/load_max_share/layer_{layer}"] = max(layer_share)
            metrics[f"moe/load_min_share/layer_{layer}"] = min(layer_share)
            metrics[f"moe/load_cv/layer_{layer}"] = cv
        metrics["moe/load_cv_max"] = max(cvs)
        return metrics
