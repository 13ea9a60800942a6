"""Activations: the tensors autograd saves for backward in one micro-step, and the logits and loss."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.distributed.layout import Launch
from pretrain.plan.memory.terms import Term, gib, num
from pretrain.plan.memory.workload import PRECISION_BYTES, Workload
from pretrain.recipe.recompute import checkpointed_blocks, normalize
from pretrain.recipe.shape import ModelShape, liger_chunk_tokens, loss_chunk_tokens

TANH_GELU_EAGER = {"gelu_new", "gelu_fast", "gelu_python_tanh"}
"""Activations that transformers computes op by op (tanh approximation): they save 3 more tensors."""


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd saves for backward in one micro-step, split the way the validation measures them."""

    saved_bytes: int
    """Tensors saved for backward by the forward pass (the transformer blocks and the rest), logits excluded."""
    recompute_bytes: int
    """Activation checkpointing only: one block's activations, rebuilt during backward."""
    logits_saved_bytes: int
    """The loss's gradient buffer, saved for backward in the logits' dtype (MBS x seq x vocab x b B,
    pretrain/model/loss.py)."""
    logits_peak_bytes: int
    """All logits-sized tensors alive at once, inside the loss's forward: the logits, the gradient buffer
    and one fp32 chunk (pretrain.recipe.shape.loss_chunk_tokens(vocab) tokens, or the micro-batch if fewer)."""
    per_layer_bytes: int
    """One block's saved tensors without checkpointing."""
    lines: tuple[str, ...]

    @property
    def activation_bytes(self) -> int:
        return self.saved_bytes + self.recompute_bytes


def activation_memory(shape: ModelShape, micro_batch_size: int, seq_len: int, precision: str,
                      attention: str = "sdpa", checkpointing: str = "none", device: str = "cuda",
                      document_masking: bool = False, tp_size: int = 1) -> ActivationEstimate:
    """Saved-for-backward bytes of one micro-batch, from the per-block formula of the architecture.

    b is the activation dtype's size (2 in bf16/fp16: DeepSpeed runs the model in that dtype; 4 in fp32),
    T = MBS x seq tokens, d hidden, q = heads x head_dim, k = kv_heads x head_dim, f MLP width, h heads.
    ``device`` matters for dropout only: CUDA saves a 1-byte mask and its fused SDPA kernels apply attention
    dropout themselves; on CPU dropout saves a mask in the activation dtype and SDPA with attention
    dropout falls back to the math kernel (s^2 terms, like eager). ``document_masking`` (data.document_masking)
    makes transformers build one boolean MBS x 1 x s x s block-causal mask for sdpa, which every layer's SDPA
    keeps for backward; flash_attention_2 takes per-document lengths instead, and eager builds its float mask
    either way.

    ``checkpointing`` is the policy (pretrain/recipe/recompute.py): a checkpointed block keeps its input (b T d)
    instead of its saved tensors, and one block's tensors are rebuilt at a time in backward; ``selective``
    also keeps, in every block, the outputs of the ops it saves (matmuls, the attention kernel).

    ``tp_size`` > 1: the block's attention and MLP tensors are those of one TP rank (heads / TP, f / TP: the colwise
    outputs and what is computed from them); the norms, the residual stream and the rowwise outputs stay whole
    (transformers' TP plans have no sequence parallelism: pretrain/plan/memory/parallel.py). Context parallelism
    is the caller's ``seq_len``: one CP rank's share of the sequence.
    """
    policy = normalize(checkpointing)  # booleans too: true = full
    checkpointed = checkpointed_blocks(policy, shape.num_layers)
    b = PRECISION_BYTES[precision]
    mask = 1 if device == "cuda" else b
    B, s = micro_batch_size, seq_len
    T = B * s
    d, f, h, L, V = shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_layers, shape.vocab_size
    q, k = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    lines = [f"T = MBS x seq = {B} x {s} = {num(T)} tokens, b = {b} B ({precision}), d = {d}, f = {f}, h = {h}"]
    eager = attention == "eager" or (device != "cuda" and shape.attn_dropout > 0)
    probs = B * h * s * s
    attn_dropout = probs * (mask + b) if eager and shape.attn_dropout > 0 else 0
    if shape.family == "llama":
        norm = 4 * T * d + 4 * T + 2 * b * T * d
        norm_text = "RMSNorm 4Td (fp32 input) + 4T (1/rms) + 2bTd (normalised, weighted)"
        if eager:
            softmax_bytes = 4 + (b if b != 4 else 0)  # softmax in fp32, then cast back for the matmul with v
            attn = 4 * b * T * q + softmax_bytes * probs
            attn_text = f"eager attention 4bTq (q, repeated k, v, output) + {softmax_bytes} B x MBS h s^2 (probabilities)"
        else:
            attn = b * (2 * T * q + 2 * T * k) + 4 * T * h
            attn_text = "attention b(2Tq + 2Tk) (q, k, v, output) + 4Th (fp32 logsumexp), no s^2 term"
        mlp_units = 4 + 3 * (shape.hidden_act in TANH_GELU_EAGER)
        mlp = mlp_units * b * T * f
        mlp_text = f"gated MLP {mlp_units}bTf (gate, up, act(gate), product)"
        if shape.num_experts:
            # Only the top-k experts a token is routed to see it: k times a dense expert's tensors, plus each
            # expert's gathered input and weighted output (2bTd per routed copy) and the router's logits and
            # fp32 probabilities (b + 4 B per token and expert).
            k, E = shape.experts_per_token, shape.num_experts
            mlp = k * (mlp_units * b * T * f + 2 * b * T * d) + (b + 4) * T * E
            mlp_text = (f"MoE: top-{k} experts x ({mlp_units}bTf gate, up, act(gate), product + 2bTd gathered input, "
                        f"weighted output) + (b + 4)T x {E} router logits, probabilities")
        if tp_size > 1:
            attn, mlp = -(-attn // tp_size), -(-mlp // tp_size)
            attn_text, mlp_text = f"({attn_text}) / TP {tp_size}", f"({mlp_text}) / TP {tp_size}"
        dropout = attn_dropout
        # computed once before the blocks; kept for backward (or, checkpointed, for the recompute)
        rope = 2 * s * shape.head_dim * b
        # eager's 4D float mask (MBS x 1 x s x s): the checkpointed blocks keep it for their recompute
        causal_mask = B * s * s * b if eager and checkpointed else 0
        extras_text = "ids and labels 16T, RoPE cos/sin 2 s head_dim b, final RMSNorm" + (
            ", causal mask MBS s^2 b" if causal_mask else "")
        extras = 16 * T + rope + norm + causal_mask
    else:
        norm = 2 * b * T * d + 8 * T
        norm_text = "LayerNorm 2bTd (input, output) + 8T (fp32 mean, rstd)"
        if eager:
            attn = 4 * b * T * d + b * probs
            attn_text = "eager attention 4bTd (q, k, v, output) + b MBS h s^2 (probabilities)"
        else:
            attn = 4 * b * T * d + 4 * T * h
            attn_text = "attention 3bTd (fused qkv) + bTd (output) + 4Th (fp32 logsumexp), no s^2 term"
        mlp_units = 2 + 3 * (shape.hidden_act in TANH_GELU_EAGER)
        mlp = mlp_units * b * T * f
        mlp_text = f"MLP {mlp_units}bTf ({'fc output, tanh, 1 + tanh, x/2, ' if mlp_units == 5 else 'fc output, '}act output)"
        dropout = 2 * T * d * mask * (shape.resid_dropout > 0) + attn_dropout
        # eager builds a 4D float mask (MBS x 1 x s x s) that the checkpointed blocks keep as an input
        causal_mask = B * s * s * b if eager and checkpointed else 0
        extras = 16 * T + 8 * s + T * d * mask * (shape.embd_dropout > 0) + norm + causal_mask
        extras_text = "ids and labels 16T, position ids 8s, final LayerNorm" + (
            f", embedding dropout mask {mask}Td" if shape.embd_dropout > 0 else "") + (
            ", causal mask MBS s^2 b" if causal_mask else "")
    if document_masking and attention == "sdpa" and not eager:
        extras += B * s * s
        extras_text += ", document mask MBS s^2 (bool)"
    if dropout:
        lines.append(f"dropout masks per block: {gib(dropout)} ({mask} B per element"
                     + (", attention: mask and dropped probabilities" if attn_dropout else "") + ")")
    per_layer = 2 * norm + attn + mlp + dropout
    lines += [
        f"per block: 2 x {norm_text}",
        f"         + {attn_text}",
        f"         + {mlp_text}",
        f"         = 2 x {num(norm)} + {num(attn)} + {num(mlp)}{f' + {num(dropout)}' if dropout else ''} = {num(per_layer)} B",
    ]
    kept, recompute_text = b * T * d, "bTd (the block input)"
    recompute = per_layer
    if policy == "selective":
        selected, selected_text, recompute = _selective(shape, b, T, s, B, eager, norm, attn, mlp, dropout, tp_size)
        kept += selected
        recompute_text += f" + {selected_text}"
    if checkpointed == 0:
        saved = L * per_layer + extras
        recompute = 0
        lines.append(f"{L} blocks x {gib(per_layer)} + {extras_text} {gib(extras)}")
    else:
        full = L - checkpointed
        saved = checkpointed * kept + full * per_layer + extras
        lines.append(
            f"checkpointing {policy}: {checkpointed} checkpointed block(s) x {recompute_text} = {num(kept)} B"
            + (f" + {full} block(s) x {num(per_layer)} B" if full else "")
            + f" + {extras_text} {gib(extras)}; plus one block recomputed in backward {gib(recompute)}"
        )
    logits_saved = b * T * V
    logits_peak = 2 * b * T * V + 4 * min(T, loss_chunk_tokens(V)) * V
    return ActivationEstimate(saved, recompute, logits_saved, logits_peak, per_layer, tuple(lines))


def _selective(shape: ModelShape, b: int, T: int, s: int, B: int, eager: bool, norm: int, attn: int, mlp: int,
               dropout: int, tp_size: int = 1) -> tuple[int, str, int]:
    """Selective checkpointing of one block: (bytes of the op outputs it keeps, how they were counted, bytes
    rebuilt when the block is recomputed in backward). Kept: every matmul's output (q, k, v or the fused
    qkv, o, the MLP's two or three), and the attention kernel's (output and fp32 logsumexp) or, for eager
    attention, the two batched matmuls' (scores MBS h s^2, output). Rebuilt: what backward needs beyond
    those: the norms, RoPE'd q and k, the activation function and the gate product, softmax and dropout."""
    d, f, h = shape.hidden_size, shape.intermediate_size, shape.num_heads
    q, k = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if tp_size > 1:  # one TP rank's heads and MLP width; o and down are all-reduced to whole
        f, h, q, k = f // tp_size, h // tp_size, q // tp_size, k // tp_size
    scores = B * h * s * s
    if shape.family == "llama":
        projections, text = b * T * (q + 2 * k + d + 2 * f + d), "b T(q + 2k + d + 2f + d) (q, k, v, o, gate, up, down)"
        mlp_rebuilt = mlp - 2 * b * T * f
    else:
        projections, text = b * T * (3 * d + d + f + d), "b T(3d + d + f + d) (qkv, proj, fc, proj)"
        mlp_rebuilt = mlp - b * T * f
    if eager:
        kernel, kernel_text = b * scores + b * T * q, "eager b MBS h s^2 + bTq (scores, output)"
        attn_rebuilt = attn - b * scores
    else:
        kernel, kernel_text = b * T * q + 4 * T * h, "bTq + 4Th (attention output, logsumexp)"
        attn_rebuilt = attn - b * T * q - 4 * T * h - (b * T * k if shape.family == "llama" else 3 * b * T * d)
    rebuilt = 2 * norm + max(attn_rebuilt, 0) + mlp_rebuilt + dropout
    return projections + kernel, f"selective {text} + {kernel_text}", rebuilt


def activation_terms(acts: ActivationEstimate, shape: ModelShape, workload: Workload,
                     layout: Launch) -> tuple[Term, Term]:
    """The estimate's activations and logits terms."""
    b = PRECISION_BYTES[workload.precision]
    V = shape.vocab_size
    T = workload.micro_batch_size * workload.seq_len
    activations = Term(
        "activations", "activations", acts.activation_bytes,
        f"saved for backward {gib(acts.saved_bytes)}"
        + (f" + one block recomputed {gib(acts.recompute_bytes)}" if acts.recompute_bytes else "")
        + " (formula below)")
    if workload.loss == "liger":
        return activations, liger_term(shape, workload, layout)
    chunk = min(T, loss_chunk_tokens(V))
    logits = Term(
        "logits", "logits and loss", acts.logits_peak_bytes,
        f"T x V x ({b} B logits + {b} B the loss's gradient buffer) + one fp32 chunk of {num(chunk)} tokens "
        f"= {num(T)} x {num(V)} x {2 * b} + {num(chunk)} x {num(V)} x 4")
    return activations, logits


def liger_term(shape: ModelShape, workload: Workload, layout: Launch) -> Term:
    """Liger-Kernel's fused linear cross-entropy in place of the logits term. No logits tensor exists: its
    forward (liger-kernel 0.8.5 ``fused_linear_cross_entropy_forward``) computes the loss and both gradients
    one chunk of tokens at a time and keeps, until backward, the gradient of the hidden states (T x H) and of
    the LM-head weight (V x H), each in its input's dtype, beside one chunk of logits in the compute dtype and
    an fp32 loss per token. The weight and the residual stream are fp32 where autocast computes (one process,
    DDP), the compute dtype where the engine holds low-precision parameters (DeepSpeed, FSDP2's param_dtype)."""
    b = PRECISION_BYTES[workload.precision]
    w = 4 if layout.engine == "ddp" else b
    V, H = shape.vocab_size, shape.hidden_size
    T = workload.micro_batch_size * workload.seq_len
    chunk = liger_chunk_tokens(T, V, H)
    total = T * H * w + V * H * w + chunk * V * b + 4 * T
    return Term(
        "logits", "fused linear CE (Liger)", total,
        f"no logits: T x H x {w} B (hidden-state gradient) + V x H x {w} B (LM-head gradient) + one chunk of "
        f"{num(chunk)} tokens x V x {b} B + T x 4 B (loss per token) = {num(T)} x {num(H)} x {w} + {num(V)} x "
        f"{num(H)} x {w} + {num(chunk)} x {num(V)} x {b} + {num(T)} x 4")
