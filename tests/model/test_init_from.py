"""model.init_from: a transformers causal LM saved with save_pretrained is the run's model at step 0, on every layout.

The sources are small models made here (llama with biases, tied embeddings and llama3 RoPE scaling; qwen3 with a
head_dim of its own; mistral with a sliding window shorter than the sequences; qwen3_moe), each with a BPE tokenizer
trained here. The step-0 validation loss of each run must
equal what ``AutoModelForCausalLM.from_pretrained`` computes on the same validation sequences (pretrain's own
validation loader), to 1e-5 relative; then the run trains on.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest

from pretrain.errors import ConfigError
from tests.helpers import (
    ROOT,
    accelerate_launch,
    check_ok,
    env,
    free_port,
    hub_cache_with_assets,
    make_recipe,
    run_cmd,
    train_here,
    train_losses,
    val_losses,
    write_tokenizer_json,
)

RECIPE = str(ROOT / "recipes" / "tiny-continue.yaml")
VOCAB = 320
# the smallest run that evaluates at step 0 and trains: 2 steps of 8 sequences of 64 tokens
ARGS = ["data.seq_len=64", "batch.global_batch_size=8", "batch.micro_batch_size=4", "train.max_steps=2",
        "lr_schedule.warmup_steps=1", "eval.every_steps=2", "eval.batches=2", "checkpoint.every_steps=2",
        "logging.every_steps=1", "logging.progress=plain"]
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 10000.0}
ARCHS = {
    "llama": {"intermediate_size": 96, "num_key_value_heads": 2, "tie_word_embeddings": True, "attention_bias": True,
              "rope_parameters": ROPE_SCALING},
    "qwen3": {"intermediate_size": 96, "num_key_value_heads": 2, "head_dim": 32},
    "mistral": {"intermediate_size": 96, "num_key_value_heads": 2, "sliding_window": 16},  # < seq_len: a real window
    # heads wider than hidden / heads, as Qwen3-30B-A3B's (128 on 2048 / 32): its config class has no head_dim field,
    # the attention reads the config.json's
    "qwen3_moe": {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 32},
}


def save_source(directory: Path, arch: str, tokenizer: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(sorted(ARCHS).index(arch))
    config = AutoConfig.for_model(arch, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                                  max_position_embeddings=128, bos_token_id=None, eos_token_id=0, pad_token_id=None,
                                  **ARCHS[arch])
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # away from the init's zero biases and unit norms: every tensor must come through
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(directory)
    shutil.copy(tokenizer, directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_from")
    tokenizer = write_tokenizer_json(root / "tok" / "tokenizer.json", "gpt2", vocab_size=VOCAB)
    return {arch: save_source(root / arch, arch, tokenizer) for arch in ARCHS}


def reference_val_loss(source: Path, out: Path, cache: dict[str, str] | None = None) -> float:
    """``from_pretrained``'s loss on the run's validation sequences (pretrain's loader, one process; ``cache``: the
    data cache of a run started by ``tests.helpers.env``)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from pretrain.data import open_data
    from pretrain.data.loader import build_val_loaders
    from pretrain.recipe.batching import plan_batches
    from pretrain.recipe.config import load_recipe

    cache_dir = [f"data.cache_dir={cache['PRETRAIN_CACHE_DIR']}"] if cache else []
    recipe = load_recipe(RECIPE, [f"model.init_from={source}", *ARGS, f"output_dir={out}", *cache_dir])
    data = open_data(recipe.data, log=lambda _: None)
    plan = plan_batches(recipe.batch, 1, recipe.data.seq_len)
    (batches,) = build_val_loaders(data, recipe.data, plan, 0, recipe.eval.batches, False).values()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch.input_ids).logits
            total += F.cross_entropy(logits.flatten(0, 1).double(), batch.targets.flatten(), reduction="sum").item()
            count += batch.targets.numel()
    return total / count


@pytest.fixture(scope="module")
def one_process_runs(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    runs = {}
    for arch, source in sources.items():
        _, trainer, console = train_here([f"model.init_from={source}", *ARGS, f"output_dir={root / arch}"], RECIPE)
        runs[arch] = (root / arch, trainer, console)
    return runs


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_one_process_starts_from_the_checkpoints_model(arch, sources, one_process_runs):
    out, trainer, console = one_process_runs[arch]
    assert val_losses(out)[0] == pytest.approx(reference_val_loss(sources[arch], out), rel=1e-5)
    assert f"init_from: {len(dict(trainer.model.named_parameters()))} tensors from {sources[arch]}" in console
    losses = train_losses(out)
    assert sorted(losses) == [1, 2] and all(loss == loss for loss in losses.values())
    assert trainer.lr == pytest.approx(1e-3) and trainer.step == 2  # the recipe's schedule, from step 0


# ---- every layout ----------------------------------------------------------------------------------------------
LAYOUTS = {  # name: (accelerate config, launch options, source arch)
    "DDP 2": ("cpu_ddp.yaml", [], "llama"),
    "FSDP2 2": ("fsdp.yaml", ["--num_processes", "2"], "qwen3_moe"),
    "ZeRO-2 2": ("zero2.yaml", ["--num_processes", "2"], "qwen3"),
    "ZeRO-3 2": ("zero3.yaml", ["--num_processes", "2"], "llama"),
    "TP 2 x FSDP 2": ("fsdp2_tp2.yaml", ["--num_processes", "4", "--parallelism_config_dp_shard_size", "2"], "llama"),
    # each rank holds (and reads) 2 of the 4 experts; the EP degree is the recipe's
    "FSDP2 x EP 2": ("fsdp2_ep.yaml", ["--num_processes", "2"], "qwen3_moe"),
}
RECIPE_ARGS = {"FSDP2 x EP 2": ["model.moe.ep_size=2"]}


@pytest.fixture(scope="module")
def layout_runs(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    runs = {}
    for name, (config, options, arch) in LAYOUTS.items():
        out = root / re.sub(r"\W+", "_", name)
        proc = accelerate_launch(config, [f"model.init_from={sources[arch]}", *ARGS, *RECIPE_ARGS.get(name, []),
                                          f"output_dir={out}"],
                                 recipe=RECIPE, extra=["--main_process_port", str(free_port()), *options],
                                 extra_env={"OMP_NUM_THREADS": "1"})
        check_ok(proc)
        runs[name] = (out, proc.stdout)
    return runs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_starts_from_the_checkpoints_model(name, sources, layout_runs):
    out, _ = layout_runs[name]
    arch = LAYOUTS[name][2]
    assert val_losses(out)[0] == pytest.approx(reference_val_loss(sources[arch], out, env()), rel=1e-5)
    assert sorted(train_losses(out)) == [1, 2]


SIZE = r"([\d.]+ [KMGT]?i?B)"
READ = re.compile(rf"\[rank (\d+)\] init_from: (\d+) tensors from .* this rank read {SIZE} of {SIZE}, at most {SIZE} at once")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def size_bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


@pytest.mark.parametrize("name", ["FSDP2 2", "ZeRO-3 2", "FSDP2 x EP 2"])
def test_sharded_ranks_read_their_share_plus_at_most_one_tensor(name, sources, layout_runs):
    """Each rank copies out of the files its shard of every tensor (an MoE's experts: only those in its rows):
    about half of the checkpoint, never the whole, and at most one tensor at a time."""
    from safetensors import safe_open

    _, stdout = layout_runs[name]
    arch = LAYOUTS[name][2]
    with safe_open(sources[arch] / "model.safetensors", framework="pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
    largest = max(4 * math.prod(s) for s in sizes)
    if arch == "qwen3_moe":  # the fused experts (num_experts x 2 x width x hidden), in the files' fp32
        largest = max(largest, 4 * 4 * 2 * 32 * 64)
    found = {int(m[1]): [size_bytes(x) for x in m.groups()[2:]] for m in READ.finditer(stdout)}
    assert sorted(found) == [0, 1], stdout[-3000:]
    total = found[0][1]
    for read, whole, at_once in found.values():
        assert whole == total
        assert read <= (total / 2 + largest) * 1.01, (read, total, largest)  # 1%: the log's 2 decimals
        assert at_once <= largest * 1.01
    assert sum(read for read, _, _ in found.values()) < (total + 2 * largest) * 1.01  # the shares add up to the checkpoint


# ---- round trip ------------------------------------------------------------------------------------------------
def test_export_then_init_from_gives_identical_logits_and_keeps_the_sources_files(sources, one_process_runs):
    import torch
    from transformers import AutoTokenizer

    from pretrain.model.build import build_model

    out, trainer, _ = one_process_runs["llama"]
    final = out / "final_model"
    recipe = make_recipe(f"model.init_from={final}", "data.seq_len=64")
    model = build_model(recipe.model, VOCAB, 64, seed=0, log=lambda _: None).eval()
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trained(ids).logits)
    config = json.loads((final / "config.json").read_text())
    source = json.loads((sources["llama"] / "config.json").read_text())
    assert config["rope_parameters"] == source["rope_parameters"]
    assert config["eos_token_id"] == 0 and config["tie_word_embeddings"] and config["attention_bias"]
    assert AutoTokenizer.from_pretrained(final).chat_template == CHAT_TEMPLATE


# ---- the recipe ------------------------------------------------------------------------------------------------
def test_the_checkpoints_shape_fills_the_recipe_and_a_conflict_names_each_key(sources):
    recipe = make_recipe(f"model.init_from={sources['qwen3']}", "data.seq_len=64")
    assert (recipe.model.arch, recipe.model.hidden_size, recipe.model.head_dim, recipe.model.vocab_size) == ("qwen3", 64, 32, VOCAB)
    assert recipe.data.tokenizer == str(sources["qwen3"])  # the checkpoint's own tokenizer
    moe = make_recipe(f"model.init_from={sources['qwen3_moe']}", "data.seq_len=64").model.moe
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size) == (4, 2, 32)
    assert make_recipe(f"model.init_from={sources['qwen3']}", "model.hidden_size=64", "data.seq_len=64")  # agrees
    with pytest.raises(ConfigError) as err:
        make_recipe(f"model.init_from={sources['qwen3']}", "model.hidden_size=128", "model.num_layers=4", "data.seq_len=64")
    assert "model.hidden_size = 128, but" in str(err.value) and "has 64" in str(err.value)
    assert "model.num_layers = 4, but" in str(err.value)
    with pytest.raises(ConfigError, match="data.seq_len = 256 is longer than .* max_position_embeddings \\(128\\)"):
        make_recipe(f"model.init_from={sources['qwen3']}", "data.seq_len=256")


def test_a_resumable_output_dir_wins_over_init_from(sources, one_process_runs, tmp_path):
    out, _, _ = one_process_runs["qwen3"]
    shutil.copytree(out, tmp_path / "run")
    _, trainer, console = train_here([f"model.init_from={sources['qwen3']}", *ARGS, "train.max_steps=3",
                                      f"output_dir={tmp_path / 'run'}"], RECIPE)
    assert "not read: this run resumes its own checkpoint at step 2" in console
    assert trainer.step == 3


BAD = "model.init_from={}"


def bad_input(tmp_path: Path, source: Path, case: str) -> Path:
    bad = tmp_path / case
    shutil.copytree(source, bad)
    if case == "pickle":
        (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    elif case == "index_outside":
        (bad / "model.safetensors").unlink()
        (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.embed_tokens.weight": "../outside.safetensors"}}))
    elif case == "not_causal":
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    elif case == "small_vocab":
        shutil.copy(write_tokenizer_json(tmp_path / "big" / "tokenizer.json", "gpt2", vocab_size=400), bad)
    return bad


@pytest.mark.parametrize(("case", "message"), [
    ("pickle", "holds pickle weights only \\(pytorch_model.bin\\), which pretrain never unpickles"),
    ("index_outside", "names '../outside.safetensors', which is not inside"),
    ("not_causal", "is not a causal language model"),
    ("small_vocab", "its embedding has 320 rows, fewer than the tokenizer's vocabulary \\(400\\)"),
])
def test_bad_checkpoints_are_one_message_and_exit_2(case, message, sources, tmp_path):
    bad = bad_input(tmp_path, sources["llama"], case)
    proc = run_cmd([sys.executable, "pretrain/run.py", "--recipe", RECIPE, BAD.format(bad), *ARGS,
                    f"output_dir={tmp_path / 'out'}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(message, proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_missing_directory_and_an_unreachable_hub_id_are_refused_before_anything_starts(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="no such directory"):
        make_recipe(f"model.init_from={tmp_path / 'nowhere'}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ConfigError, match="not in this machine's Hugging Face cache and the hub cannot be reached"):
        make_recipe("model.init_from=some-org/some-model")


@pytest.mark.parametrize("name", ["FSDP2 2", "ZeRO-3 2"])
def test_a_pretrain_checkpoint_of_any_layout_starts_a_new_run_from_its_weights(name, layout_runs, tmp_path):
    """A 2-process FSDP2 (DCP shards, an MoE) or ZeRO-3 checkpoint as model.init_from of a one-process run: written
    once as a transformers view beside it (weights and tokenizer), the new run's step-0 loss is the source's at
    that step, and a second run reuses the view."""
    out, _ = layout_runs[name]
    checkpoint = out / "checkpoints" / "step_00000002"
    _, _, console = train_here([f"model.init_from={checkpoint}", *ARGS, f"output_dir={tmp_path / 'a'}"], RECIPE)
    assert f"writing {checkpoint}'s weights and tokenizer as a transformers model in {checkpoint}.hf" in console
    assert val_losses(tmp_path / "a")[0] == pytest.approx(val_losses(out)[2], rel=1e-5)
    _, _, console = train_here([f"model.init_from={checkpoint}", *ARGS, f"output_dir={tmp_path / 'b'}"], RECIPE)
    assert "writing" not in console and val_losses(tmp_path / "b")[0] == val_losses(tmp_path / "a")[0]
    if name == "FSDP2 2":  # a view changed in place (the same size) is never read: written again from the checkpoint
        weights = Path(f"{checkpoint}.hf") / "model.safetensors"
        with open(weights, "r+b") as f:
            f.seek(weights.stat().st_size // 2)
            f.write(b"\xff" * 16)
        _, _, console = train_here([f"model.init_from={checkpoint}", *ARGS, f"output_dir={tmp_path / 'c'}"], RECIPE)
        assert re.search(rf"init_from: {re.escape(str(checkpoint))}.hf is damaged \(\S*model.safetensors.*; writing it "
                         "again", console), console
        assert val_losses(tmp_path / "c")[0] == val_losses(tmp_path / "a")[0]


def test_the_shipped_recipes_dry_run_reads_the_config_alone_offline(tmp_path):
    """recipes/continue-qwen3-1.7b.yaml on 8 H100 under FSDP: the parameter count, the memory plan and the load's
    figures from Qwen3-1.7B's config.json in the hub cache (no weights there, the hub offline)."""
    hub = hub_cache_with_assets(tmp_path / "hub")
    proc = run_cmd([sys.executable, "pretrain/run.py", "--recipe", "recipes/continue-qwen3-1.7b.yaml", "--dry-run",
                    "--config_file", "accelerate_configs/fsdp.yaml", "--num-processes", "8", "--gpu", "H100-80GB",
                    f"output_dir={tmp_path / 'run'}"], extra_env={"HF_HUB_CACHE": str(hub)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "model            qwen3, 1,720,574,976 parameters (vocab 151,936)" in out
    # bf16 in the files: 2 B x 1,720,574,976 = 3.20 GiB; FSDP over 8 ranks: 0.40 GiB each; the largest tensor, the
    # tied 151,936 x 2,048 embedding, 1/8 of it at once
    assert ("load             3.20 GiB of bfloat16 weights; each rank reads 1/8 of each tensor: 0.40 GiB per rank, at "
            "most 0.072 GiB of host memory at once beside its parameters (the largest tensor's share)") in out
    assert "total (peak)" in out and "verdict    fits: 6.2 GiB headroom on the H100-80GB" in out


@pytest.mark.parametrize(("error", "status", "message"), [
    ("GatedRepoError", 403, "is a gated model: accept its licence on its hub page"),
    ("RepositoryNotFoundError", 404, "no such model on the Hugging Face hub"),
])
def test_a_gated_or_unknown_hub_model_is_one_message(error, status, message, tmp_path, monkeypatch):
    """The hub's answer for a model whose licence is not accepted (or that does not exist), as hf_hub_download
    raises it, is one message saying what to do (no network here: the download is replaced by its refusal)."""
    import httpx
    import huggingface_hub
    import huggingface_hub.constants as constants
    from huggingface_hub import errors

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def refuse(*_, **__):
        response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api"))
        raise getattr(errors, error)(f"{status}", response=response)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    with pytest.raises(ConfigError, match=message):
        make_recipe("model.init_from=meta-llama/Llama-3.2-1B")


def test_a_new_bpe_tokenizer_and_quantized_weights_are_refused(sources, tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer = bpe with model.init_from"):
        make_recipe(f"model.init_from={sources['qwen3']}", "data.seq_len=64", "data.tokenizer=bpe")
    quantized = tmp_path / "fp8"
    shutil.copytree(sources["qwen3"], quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConfigError, match="holds fp8 weights"):
        make_recipe(f"model.init_from={quantized}", "data.seq_len=64")


def test_an_interrupted_download_is_one_message(sources, tmp_path):
    """An index naming a shard that is not there (a download or copy cut short) is refused before anything starts."""
    from pretrain.model.pretrained import check_weight_files

    cut = tmp_path / "cut"
    shutil.copytree(sources["llama"], cut)
    (cut / "model.safetensors").rename(cut / "model-00001-of-00002.safetensors")
    (cut / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match="names model-00002-of-00002.safetensors, which is not there"):
        check_weight_files(str(cut))
