"""The sweep's picture: tokens/s and peak memory against MBS, with the recommendation marked."""

from __future__ import annotations

from pathlib import Path

from pretrain.plan.sweep.runner import MBSResult


def plot(results: list[MBSResult], analysis: dict, path: Path, title: str, max_memory_gib: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    measured = [r for r in results if r.measured]
    failed = [r for r in results if not r.measured]
    fig, (ax_tps, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax in (ax_tps, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro batch size (sequences per process)")
        ax.grid(True, which="both", alpha=0.3)
        ticks = [r.mbs for r in results]
        ax.set_xticks(ticks, [str(t) for t in ticks])
    xs = [r.mbs for r in measured]
    num_runs = max((len(r.runs) for r in measured), default=1)
    label = "median step" + (f", fastest of {num_runs} runs" if num_runs > 1 else "")
    ax_tps.plot(xs, [r.tokens_per_s for r in measured], "o-", label=f"tokens/s ({label})")
    ax_tps.set_ylabel("tokens/s (all processes)")
    ax_tps.set_title("Throughput")
    ax_mem.plot(xs, [r.peak_gib for r in measured], "s-", color="tab:orange", label="peak memory (rank 0)")
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title("Peak memory")
    over = [r for r in measured if r.status == "over_memory_limit"]
    if over:
        ax_mem.plot([r.mbs for r in over], [r.peak_gib for r in over], "x", color="tab:red", markersize=10,
                    label="over the memory limit")
    if max_memory_gib is not None:
        ax_mem.axhline(max_memory_gib, color="tab:red", linestyle="--", label=f"--max-memory-gib {max_memory_gib:g}")
    for r in failed:
        for ax in (ax_tps, ax_mem):
            ax.axvline(r.mbs, color="tab:red", alpha=0.6, linestyle=":", label=f"MBS {r.mbs}: {r.status}")
    rec = analysis.get("recommendation")
    if rec is not None:
        ax_tps.axvline(rec["micro_batch_size"], color="tab:green", alpha=0.6,
                       label=f"recommended MBS {rec['micro_batch_size']}")
    for ax in (ax_tps, ax_mem):
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
