"""Context parallelism (FSDP2 x CP) on CPU: the shipped layout, every refusal before any process starts (exit 2, one
message), what the micro-step and the evaluation hand accelerate's maybe_context_parallel, and that CP ranks' losses
and gradients, averaged as FSDP2 averages them, are one process's. torch's ring attention runs on CUDA only, so the CP
run itself is tests/test_gpu.py's (2+ GPUs)."""

from __future__ import annotations

import types
from contextlib import contextmanager

import pytest
import torch

from pretrain.distributed import context_parallel
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.model.loss import chunked_causal_lm_loss
from pretrain.train.engine import Engine, Objective, loss_normaliser
from pretrain.train.evaluation import Evaluator
from tests.fakes import FakeAccelerator
from tests.helpers import FAST, ROOT, TINY, accelerate_environment, make_recipe

CONFIGS = ROOT / "accelerate_configs"
CP2 = str(CONFIGS / "fsdp2_cp2.yaml")
# a CP 2 launch of 2 processes on this machine (pretrain-launch's own options after the config)
CP2_ON_2 = ["--config_file", CP2, "--num_processes", "2", "--parallelism_config_dp_shard_size", "1"]


def test_shipped_cp_config_gives_the_data_parallel_size_and_each_ranks_data():
    launch = Launch.from_accelerate_config(CONFIGS / "fsdp2_cp2.yaml")
    assert (launch.cp_size, launch.world_size, launch.data_parallel_size) == (2, 8, 4)
    assert "x CP 2 (4-way data parallel)" in launch.describe()
    # cp next to tp, innermost in accelerate's mesh: the ranks of one CP pair (and of one CP x TP group) read one batch
    assert [Launch("fsdp", gpus_per_node=8, rank=r, cp_size=2).data_rank for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [Launch("fsdp", gpus_per_node=8, rank=r, cp_size=2, tp_size=2).data_rank for r in range(8)] == [0] * 4 + [1] * 4
    # the processes read the same launch from accelerate's environment (CP x TP too)
    both = ["--num_processes", "8", "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"]
    from_env = Launch.from_env(accelerate_environment(CONFIGS / "fsdp2_cp2.yaml", *both))
    assert from_env == Launch.from_accelerate_config(CONFIGS / "fsdp2_cp2.yaml", both)
    assert (from_env.cp_size, from_env.tp_size, from_env.data_parallel_size) == (2, 2, 2)


def fsdp_config(tmp_path, parallelism: str, version: int = 2, kind: str = "FSDP", processes: int = 8):
    path = tmp_path / "acc.yaml"
    path.write_text(f"distributed_type: {kind}\nnum_processes: {processes}\nfsdp_config:\n  fsdp_version: {version}\n"
                    f"parallelism_config:\n  {parallelism}\n")
    return path


@pytest.mark.parametrize("kind, version, parallelism, message", [
    ("FSDP", 1, "parallelism_config_cp_size: 2\n  parallelism_config_dp_shard_size: 4",
     "parallelism_config_cp_size = 2 needs fsdp_version: 2"),
    ("MULTI_GPU", 2, "parallelism_config_cp_size: 2", "parallelism_config_cp_size = 2 with DDP: context parallelism runs "
                                                     "under FSDP2 only"),
    ("DEEPSPEED", 2, "parallelism_config_cp_size: 2", "parallelism_config_cp_size = 2 with DeepSpeed"),
    ("FSDP", 2, "parallelism_config_cp_size: 3", "parallelism_config_cp_size = 3 must be a whole number that divides"),
    ("FSDP", 2, "parallelism_config_cp_size: 2\n  parallelism_config_dp_shard_size: 8",
     "dp_shard_size x cp_size (2) must be the world size (dp_shard_size 4)"),
])
def test_cp_layouts_accelerate_does_not_compose_are_refused_by_name(tmp_path, kind, version, parallelism, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Launch.from_accelerate_config(fsdp_config(tmp_path, parallelism, version, kind))


def test_cp_under_ddp_is_refused_in_the_processes_too():
    """A plain accelerate launch of a DDP config with a cp_size: accelerate would still split the sequences."""
    environment = {"WORLD_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"}
    with pytest.raises(ConfigError, match="with DDP: context parallelism runs under FSDP2 only"):
        Launch.from_env(environment)


# ---- pretrain-launch, in this process: exit 2 and one message before any process starts -------------------------------
@pytest.fixture
def started(monkeypatch):
    """What pretrain-launch would start (nothing, when it refuses)."""
    from pretrain.cli import launch as launch_cli

    calls = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: calls.append(argv) or 0)
    return calls


@pytest.fixture
def gpus(monkeypatch):
    """This CPU machine seen as an H100 node by pretrain-launch (its device checks ask torch.cuda). transformers'
    models are imported first: their import (torchao's kernels) would believe it too and ask the device."""
    import transformers.modeling_utils  # noqa: F401

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=81559 * 2**20))


def pretrain_launch(capsys, *args: str) -> tuple[int, str]:
    from pretrain.cli.launch import main

    code = main(list(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("overrides, fragments", [
    (["data.document_masking=true"],
     ["data.document_masking = true cannot run context parallel: its per-document position ids and the block-causal "
      "mask built from them are not split along the sequence by CP's load balancer", "set data.document_masking=false"]),
    (["data.seq_len=66"], ["data.seq_len 66 is not divisible by 2 x cp_size = 4", "use a multiple of 4 (64, 68)"]),
    (["model.attention=eager"], ["model.attention = eager: context parallelism replaces SDPA with ring attention"]),
    (["model.arch=mistral", "model.tie_embeddings=false"],
     ["model.arch = mistral has sliding-window attention in every layer (its config's sliding_window = 4096)",
      "accelerate refuses such a model at prepare", "model.config_overrides: {sliding_window: null}"]),
    (["model.arch=gpt2", "model.tie_embeddings=false"],
     ["model.arch = gpt2 names no attention module '*.self_attn', where accelerate's CP hooks attach"]),
])
def test_what_cp_cannot_split_is_refused_before_any_process(capsys, started, gpus, overrides, fragments):
    code, err = pretrain_launch(capsys, *CP2_ON_2, "--recipe", TINY, *FAST, *overrides)
    assert code == 2 and started == [], err
    assert err.startswith("error: ") and err.count("error: ") == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_cp_on_cpu_is_refused_naming_torchs_error(capsys, started, monkeypatch):
    expected = ("runs on CUDA GPUs only: torch's ring attention (context_parallel) has no sharding strategy for the CPU "
                f"SDPA kernel, so a CPU launch fails inside its first forward with `{context_parallel.CPU_ERROR}`")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine, whatever it has
    code, err = pretrain_launch(capsys, *CP2_ON_2, "--recipe", TINY, *FAST)
    assert code == 2 and started == [] and expected in err, err
    # a CPU launch from a GPU machine too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code, err = pretrain_launch(capsys, *CP2_ON_2, "--cpu", "--recipe", TINY, *FAST)
    assert code == 2 and started == [] and expected in err, err
    # and --dry-run, planning CPU processes (no GPU named), as pretrain-launch does (issue 36: it answered exit 0)
    from pretrain.run import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--dry-run", "--config_file", CP2, "--recipe", TINY, *FAST, "batch.micro_batch_size=2"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


def test_cp_that_reached_cpu_processes_stops_before_the_process_group(tmp_path, monkeypatch):
    """A plain `accelerate launch` (no pretrain-launch) of the CP config on CPU: refused by the accelerator's builder,
    before any process group or Accelerator exists."""
    from pretrain.distributed.accelerator import build_accelerator
    from pretrain.train.preflight import check_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    launch = Launch("fsdp", gpus_per_node=2, cp_size=2)
    run_plan = check_run(make_recipe(*FAST), launch)  # the recipe can run CP: only the device cannot
    with pytest.raises(ConfigError, match="runs on CUDA GPUs only"):
        build_accelerator(run_plan.recipe, run_plan, tmp_path, [])


def test_a_cp_launch_the_recipe_can_run_passes_every_check(capsys, started, gpus):
    code, err = pretrain_launch(capsys, *CP2_ON_2, "--gpu", "H100-80GB", "--recipe", TINY, *FAST)
    assert code == 0, err
    [command] = started
    assert command[command.index("--config_file") + 1] == CP2 and "--parallelism_config_dp_shard_size" in command


# ---- the micro-step and the evaluation under CP, against one process -------------------------------------------------
SEQ, BATCH, VOCAB = 16, 2, 11


class FakeCPAccelerator(FakeAccelerator):
    """One CP rank of ``cp_size`` as the loop sees it: maybe_context_parallel records its arguments and splits the
    buffers in place as torch's context_parallel does (torch's own head-tail load balancer, then rank r's 1/cp);
    reduce returns this rank's value (the test adds the ranks up)."""

    def __init__(self, rank: int, cp_size: int):
        super().__init__()
        self.rank, self.cp_size, self.calls, self.reduced = rank, cp_size, [], []

    @contextmanager
    def maybe_context_parallel(self, buffers, buffer_seq_dims, no_restore_buffers):
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

        self.calls.append((list(buffers), list(buffer_seq_dims), set(no_restore_buffers)))
        order = _HeadTailLoadBalancer(buffers[0].shape[1], self.cp_size, "cpu")._generate_indices()[0]
        for buffer in buffers:
            shard = buffer[:, order].chunk(self.cp_size, dim=1)[self.rank].clone()
            buffer.resize_(shard.shape)
            buffer.copy_(shard)
        yield

    def reduce(self, tensor, reduction):
        self.reduced.append(tensor.clone())
        return tensor

    def log(self, metrics, step):
        pass


class PositionModel(torch.nn.Module):
    """Logits from each token and its position in the whole sequence (RoPE's dependence, in small): a shard that
    counted its positions from 0, or targets split apart from their inputs, gives another loss and other gradients.
    Its loss is pretrain's chunked loss, called as transformers' models call it."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=generator))
        self.positions = torch.nn.Parameter(torch.randn(SEQ, VOCAB, generator=generator))
        self.seen: list[dict] = []

    def forward(self, input_ids, labels, shift_labels, num_items_in_batch, position_ids=None):
        self.seen.append({"input_ids": input_ids.clone(), "shift_labels": shift_labels.clone(),
                          "position_ids": None if position_ids is None else position_ids.clone(),
                          "num_items_in_batch": num_items_in_batch})
        if position_ids is None:  # transformers' default: 0..n-1 of what it is given
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        logits = self.tokens[input_ids] + self.positions[position_ids]
        return types.SimpleNamespace(loss=chunked_causal_lm_loss(logits, labels, VOCAB, num_items_in_batch,
                                                                 shift_labels=shift_labels))


def rows() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def batch_of(tokens: torch.Tensor):
    from pretrain.data.loader import Batch

    return Batch(tokens[:, :-1].clone(), tokens[:, 1:].clone())


class RecordingEngine(Engine):
    """The engine's micro-step with the update's parts left out: the backward alone."""

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm(self, max_norm):
        return None

    def judge(self, grad_norm):
        return None

    def update(self, verdict):
        pass


def micro_step(launch: Launch, accelerator, model) -> torch.Tensor:
    """Engine.micro_step on one micro-batch (GAS 1), the update left out; the model's gradient after it."""
    objective = Objective(1, loss_normaliser(BATCH * SEQ, launch, grad_accum_steps=1), grad_clip=1.0,
                          cp_size=launch.cp_size)
    engine = RecordingEngine(accelerator, model, None, None, None, False, objective)
    model.zero_grad()
    loss, _, _ = engine.micro_step(batch_of(rows()), torch.zeros(()))
    return loss, [p.grad.clone() for p in model.parameters()]


def test_cp_ranks_see_their_part_of_every_sequence_at_its_global_positions_and_average_to_one_process():
    """The micro-step under CP 2 (one data-parallel rank, GAS 1) against one process: what it hands
    maybe_context_parallel (the inputs, the shifted targets and position ids, split along dimension 1, not restored),
    what each rank's model sees (its two chunks of every row, their global positions, their own targets), and the loss
    and gradients, averaged over the two ranks as FSDP2 averages over dp_shard x cp: one process's."""
    model = PositionModel()
    one = Launch("fsdp", gpus_per_node=1)
    full_loss, full_grads = micro_step(one, FakeCPAccelerator(0, 1), model)
    assert model.seen[-1]["position_ids"] is None  # no CP, nothing added
    assert model.seen[-1]["num_items_in_batch"] == BATCH * SEQ

    cp = Launch("fsdp", gpus_per_node=2, cp_size=2)
    losses, grads, positions = [], [], []
    for rank in range(2):
        accelerator = FakeCPAccelerator(rank, 2)
        loss, rank_grads = micro_step(cp, accelerator, model)
        losses.append(loss)
        grads.append(rank_grads)
        [(buffers, dims, no_restore)] = accelerator.calls
        seen = model.seen[-1]
        assert dims == [1, 1, 1] and no_restore == set(buffers) and len(buffers) == 3
        assert [b.shape for b in buffers] == [(BATCH, SEQ // 2)] * 3  # split in place: what the model was given
        chunk = SEQ // 4
        expected = [*range(rank * chunk, (rank + 1) * chunk), *range((3 - rank) * chunk, (4 - rank) * chunk)]
        assert seen["position_ids"].tolist() == [expected] * BATCH  # head-tail: chunks r and 3-r, global positions
        tokens = rows()
        assert torch.equal(seen["input_ids"], tokens[:, :-1][:, expected])
        assert torch.equal(seen["shift_labels"], tokens[:, 1:][:, expected])  # each input's own next token
        assert seen["num_items_in_batch"] == BATCH * SEQ / 2  # N / (dp x cp x GAS)
        positions += expected
    assert sorted(positions) == list(range(SEQ))  # every position on exactly one rank
    torch.testing.assert_close(sum(losses) / 2, full_loss, rtol=1e-6, atol=0)
    for rank0, rank1, full in zip(*grads, full_grads, strict=True):
        torch.testing.assert_close((rank0 + rank1) / 2, full, rtol=1e-5, atol=1e-7)


def test_evaluation_under_cp_sums_each_token_once_at_its_global_position():
    """The Evaluator under CP 2: each rank's loss sum and target count over its part; the ranks' totals (the sum
    reduction) are one process's."""
    model = PositionModel()

    def totals(rank: int, cp_size: int) -> torch.Tensor:
        accelerator = FakeCPAccelerator(rank, cp_size)
        val = {"": [batch_of(rows())]}  # a loader's fresh batch: CP splits it in place
        evaluator = Evaluator(accelerator, val, every_steps=0, num_steps=1, at_start=False,
                              console=types.SimpleNamespace(print=lambda line: None), cp_size=cp_size)
        evaluator.evaluate(model, 1)
        assert len(accelerator.calls) == (cp_size > 1)
        return accelerator.reduced[0]

    one = totals(0, 1)
    assert one[0, 1] == BATCH * SEQ
    torch.testing.assert_close(totals(0, 2) + totals(1, 2), one, rtol=1e-6, atol=0)


def test_document_masking_arguments_never_reach_a_cp_forward():
    """Refused before launch (above); the loop's own guard if a CP launch ever got per-document positions."""
    tokens = rows()
    with pytest.raises(ConfigError, match="set data.document_masking=false"):
        context_parallel.forward_inputs(tokens[:, :-1], tokens[:, 1:], {"position_ids": tokens[:, :-1]}, 2)


# ---- the planner chooses CP layouts now that the launch runs them ---------------------------------------------------
def test_the_planner_may_choose_cp_layouts():
    from pretrain.plan import planner

    assert planner.cp_runs()
