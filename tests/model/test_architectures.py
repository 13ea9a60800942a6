"""The architecture matrix: every causal LM pretrain claims (dense and mixture-of-experts), trained, resumed,
exported and measured.

One module-scoped run per architecture (the tiny recipe's data and tokenizer at FAST's 2 x 64 shape, in this
process: no interpreter start per run) is shared by its checks: it trains 5 steps, a copy of its step-3
checkpoint resumes to step 5 on the same losses, its final_model and a pretrain-export of its last checkpoint
reload through AutoModelForCausalLM + AutoTokenizer with the trained logits and generate, and pretrain's
parameter and FLOPs figures equal the built model's and FlopCounterMode's.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, counted_flops_per_token, train_here, train_losses, write_tokenizer_json

pytestmark = pytest.mark.slow

STEPS, CHECKPOINT_STEP = 5, 3
# arch -> its overrides beyond FAST. Every arch gets grouped-query attention where its config has it (2 kv heads
# of 4), so the kv projections' shapes are exercised; GPT-2 and GPT-NeoX have none.
ARCHS = {
    "llama": ["model.num_kv_heads=2"],
    "mistral": ["model.num_kv_heads=2"],
    "qwen2": ["model.num_kv_heads=2"],
    "qwen3": ["model.num_kv_heads=2"],
    "gemma": ["model.num_kv_heads=2"],
    # transformers has no SDPA path for Gemma-2's logit soft-capping
    "gemma2": ["model.num_kv_heads=2", "model.attention=eager"],
    "gemma3_text": ["model.num_kv_heads=2"],
    "olmo2": ["model.num_kv_heads=2"],
    "phi3": ["model.num_kv_heads=2"],
    "gpt_neox": ["model.num_kv_heads=null"],
    "gpt2": ["model.num_kv_heads=null", "model.intermediate_size=null"],
    # mixture-of-experts: 4 experts of 64 features, 2 per token (an MoE's MLP width is the experts')
    **{arch: ["model.num_kv_heads=2", "model.intermediate_size=null", "model.moe.num_experts=4",
              "model.moe.experts_per_token=2", "model.moe.expert_intermediate_size=64"]
       for arch in ("olmoe", "qwen3_moe", "mixtral")},
}
# FAST on 32-token sequences, one micro-batch per step: the cheapest run that still trains and checkpoints.
ARGS = [*FAST, "data.seq_len=32", "batch.global_batch_size=8", "batch.micro_batch_size=8", "eval.at_start=false",
        "eval.batches=1", f"train.max_steps={STEPS}",
        f"checkpoint.every_steps={CHECKPOINT_STEP}", "checkpoint.keep_last=0"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Intra-op threads would cost more than they save on these tiny matmuls, and on cores shared with other work
    they wait for each other: measured, a run takes 0.6 s on one thread and 5-13 s on two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class ArchRun:
    arch: str
    recipe: object
    straight: Path  # 5 steps in one go
    resumed: Path  # the step-3 checkpoint of ``straight``, resumed to step 5
    model: torch.nn.Module  # the trained model, as the trainer left it
    tokenizer: object  # the tokenizer it was trained with
    num_params: int  # what the run counted (run_config.json's model/num_params)


def train_arch(arch: str, out: Path, *extra: str):
    recipe, trainer, _ = train_here([*ARGS, f"model.arch={arch}", *ARCHS[arch], *extra, f"output_dir={out}"])
    return recipe, trainer


@pytest.fixture(scope="module", params=list(ARCHS))
def run(request, tmp_path_factory) -> ArchRun:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    # transformers' AutoTokenizer always rebuilds a qwen2 tokenizer with Qwen2's own split, which pretrain's
    # GPT-2-style BPE does not use (the run refuses that pairing at set-up): qwen2 trains on a Qwen2-style one.
    extra = [f"data.tokenizer={write_tokenizer_json(root / 'tokenizer.json', 'qwen2')}"] if arch == "qwen2" else []
    recipe, trainer = train_arch(arch, root / "straight", *extra)
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    # A run killed after step 3: its output_dir holds the step-3 checkpoint and nothing after it.
    resumed = root / "resumed"
    checkpoint = f"step_{CHECKPOINT_STEP:08d}"
    shutil.copytree(root / "straight" / "checkpoints" / checkpoint, resumed / "checkpoints" / checkpoint)
    _, again = train_arch(arch, resumed, *extra)
    assert again.resumed is not None and again.step == STEPS, "the copy of the step-3 checkpoint was not resumed"
    num_params = json.loads((root / "straight" / "run_config.json").read_text())["model/num_params"]
    return ArchRun(arch, recipe, root / "straight", resumed, model, trainer.tokenizer, num_params)


def test_trains_5_steps_with_a_falling_loss(run):
    losses = train_losses(run.straight)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    # Five steps at FAST's shape are noisy (gemma's loss at this size wanders within 0.03 of ln V): a step after
    # the first below it says the updates train the model; a broken update path leaves every step above it.
    assert min(losses[s] for s in range(2, STEPS + 1)) < losses[1], losses


def test_resumes_exactly(run):
    expected, resumed = train_losses(run.straight), train_losses(run.resumed)
    assert sorted(resumed) == list(range(CHECKPOINT_STEP + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=1e-6, abs=1e-6), (step, loss, expected[step])


def sample_ids(tokenizer) -> torch.Tensor:
    """Two rows of real training-like text (the tiny recipe's corpus is Python source)."""
    text = ["import os\nimport sys\n\ndef main(argv):\n    return 0\n", "class Point:\n    def __init__(self, x):\n"]
    rows = [tokenizer(t).input_ids[:12] for t in text]
    assert all(len(r) == 12 for r in rows)
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> tuple[Path, Path]:
    """final_model, and pretrain-export of the run's last checkpoint."""
    from pretrain.cli.export import export

    out = tmp_path_factory.mktemp(f"{run.arch}-export") / "model"
    export(run.straight / "checkpoints" / f"step_{STEPS:08d}", out, log=lambda _: None)
    return run.straight / "final_model", out


@pytest.mark.parametrize("which", ["final_model", "pretrain-export"])
def test_exported_model_reloads_with_the_trained_logits_and_generates(run, exported, which):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = exported[0] if which == "final_model" else exported[1]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == type(run.model).__name__
    ids = sample_ids(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, run.model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    generated = model.generate(ids[:1], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 4)
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_exported_tokenizer_gives_the_training_ids(run, exported):
    """AutoTokenizer of the export encodes text to the ids the model was trained on (issue 26 part 2: qwen2's
    config makes it load a Qwen2Tokenizer with other ids)."""
    from transformers import AutoTokenizer

    text = "import os\n\n\ndef main(argv):\n    return len(argv)  # done\n"
    for path in exported:
        assert AutoTokenizer.from_pretrained(path)(text).input_ids == run.tokenizer(text).input_ids, path


def test_exported_config_stops_at_eos_with_the_kv_cache_on(run, exported):
    """The exported config's EOS is the tokenizer's end-of-text token (generation stops there) and its KV cache is
    on (training turns it off) (issue 26 part 2)."""
    from transformers import AutoConfig

    for path in exported:
        config = AutoConfig.from_pretrained(path)
        assert (config.eos_token_id, config.use_cache) == (run.tokenizer.eos_token_id, True), path


def test_parameter_count_matches_the_built_model(run):
    """The run's count is the built model's (unique tensors, a tied head once), and the exported model holds
    exactly those; where pretrain has a closed form (the estimator's and planner's figure, no transformers),
    it gives the same number."""
    from transformers import AutoModelForCausalLM

    from pretrain.recipe.shape import COUNTED_ARCHS, ModelShape

    built = sum(p.numel() for p in run.model.parameters())
    assert run.num_params == built
    reloaded = AutoModelForCausalLM.from_pretrained(run.straight / "final_model", dtype=torch.float32)
    assert sum(p.numel() for p in reloaded.parameters()) == built
    if run.arch in COUNTED_ARCHS:
        assert ModelShape.from_recipe(run.recipe).num_params == built


def test_head_dim_is_the_recipe_shape(run):
    """hidden_size / num_heads (64 / 4) per head, as the recipe states it: an architecture whose config defaults
    to its own head size (qwen3 128, gemma 256) would build a different model than the recipe's shape says."""
    config = run.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == run.recipe.model.hidden_size // run.recipe.model.num_heads


def test_flops_per_token_match_the_flop_counter(run):
    """pretrain's FLOPs per token (MFU's numerator, run_config's perf/flops_per_token) against PyTorch's
    FlopCounterMode on the trained model rebuilt with eager attention (the counter does not see CPU SDPA)."""
    from transformers import AutoModelForCausalLM

    from pretrain.model.measure import measure
    from pretrain.recipe.shape import MATMUL_ARCHS, flops_per_token

    run_config = json.loads((run.straight / "run_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(run.straight / "final_model", dtype=torch.float32,
                                                 attn_implementation="eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the counter does not see torch._grouped_mm
    seq_len = run.recipe.data.seq_len
    counted = counted_flops_per_token(model, model.config.vocab_size, 1, seq_len)
    # The closed form where pretrain has one, else the figure measured on the meta device (what the run logs).
    figure = (flops_per_token(model.config, seq_len) if run.arch in MATMUL_ARCHS
              else measure(model.config, seq_len).flops_per_token("none")).model_flops
    assert figure == pytest.approx(counted, rel=0.02)
    assert run_config["perf/flops_per_token"] == pytest.approx(figure, rel=1e-9)
