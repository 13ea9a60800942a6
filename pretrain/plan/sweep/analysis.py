"""What a sweep's measurements mean: where throughput stops scaling and which MBS / GAS to use."""

from __future__ import annotations

from pretrain.plan.sweep.runner import MBSResult
from pretrain.recipe.batching import neighbouring_multiples

SCALING_THRESHOLD = 1.2  # tokens/s gain from doubling MBS below which throughput has stopped scaling
NEAR_BEST = 0.95  # an MBS within this fraction of the best tokens/s is as good as the best


def nearest_multiples(value: int, unit: int) -> list[int]:
    """The multiples of unit closest to value (one, or two when value lies exactly between them)."""
    options = neighbouring_multiples(value, unit)
    closest = min(abs(value - v) for v in options)
    return [v for v in options if abs(value - v) == closest]


def analyse(results: list[MBSResult], global_batch_size: int, world: int) -> dict:
    """Scaling factors (set on the results), where scaling stops, and the recommended MBS / GAS."""
    measured = [r for r in results if r.measured]
    previous = None
    for r in measured:
        if previous is not None and previous.mbs * 2 == r.mbs:
            r.scaling = r.tokens_per_s / previous.tokens_per_s
        previous = r
    stops = next((r for r in measured if r.scaling is not None and r.scaling < SCALING_THRESHOLD), None)
    analysis: dict = {
        "scaling_threshold": SCALING_THRESHOLD,
        "scaling_stops_at_mbs": stops.mbs // 2 if stops else None,
        "near_best_fraction": NEAR_BEST,
        "global_batch_size": global_batch_size,
        "world_size": world,
        "recommendation": None,
    }
    usable = [r for r in measured if r.status == "ok"]
    if not usable:
        analysis["message"] = "no MBS ran within the limits, so there is nothing to recommend"
        return analysis
    best = max(r.tokens_per_s for r in usable)
    near_best = [r for r in usable if r.tokens_per_s >= NEAR_BEST * best]
    per_rank = global_batch_size // world if global_batch_size % world == 0 else None
    dividing = [r for r in near_best if per_rank is not None and per_rank % r.mbs == 0]
    if dividing:
        pick = dividing[0]
        gas = per_rank // pick.mbs
        analysis["recommendation"] = _recommendation(pick, best, global_batch_size, gas)
        analysis["message"] = (
            f"recommended: MBS {pick.mbs} ({pick.tokens_per_s:,.0f} tokens/s, {pick.tokens_per_s / best:.0%} of the "
            f"best; the smallest MBS within {NEAR_BEST:.0%} of it) with GAS {gas} for the recipe's GBS {global_batch_size} = {pick.mbs} x {gas} x world {world}: "
            f"batch.global_batch_size={global_batch_size} batch.micro_batch_size={pick.mbs}"
        )
        return analysis
    pick = near_best[0]
    suggested = nearest_multiples(global_batch_size, pick.mbs * world)
    fallback = [r for r in usable if per_rank is not None and per_rank % r.mbs == 0]
    analysis["recommendation"] = {**_recommendation(pick, best, global_batch_size, None),
                                  "suggested_global_batch_sizes": suggested}
    gbs_options = " or ".join(f"{g} (GAS {g // (pick.mbs * world)})" for g in suggested)
    message = (
        f"no MBS reaching {NEAR_BEST:.0%} of the best tokens/s divides the recipe's GBS {global_batch_size} / world "
        f"{world}; MBS {pick.mbs} ({pick.tokens_per_s:,.0f} tokens/s) needs a GBS that is a multiple of "
        f"{pick.mbs * world}: the nearest is {gbs_options}"
    )
    if fallback:
        alt = max(fallback, key=lambda r: r.tokens_per_s)
        message += (f"; or keep GBS {global_batch_size} with MBS {alt.mbs} (GAS {per_rank // alt.mbs}, "
                    f"{alt.tokens_per_s / best:.0%} of the best)")
    analysis["message"] = message
    return analysis


def _recommendation(pick: MBSResult, best: float, global_batch_size: int, gas: int | None) -> dict:
    """The recommended MBS; ``gas`` None when no near-best MBS divides the recipe's GBS on this world."""
    return {
        "micro_batch_size": pick.mbs,
        "gradient_accumulation_steps": gas,
        "global_batch_size": global_batch_size,
        "tokens_per_s": pick.tokens_per_s,
        "fraction_of_best": pick.tokens_per_s / best,
        "divides_global_batch_size": gas is not None,
    }


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: list[MBSResult]) -> str:
    header = ("MBS", "tokens/s", "step time (s)", "peak GiB", "scaling", "status")
    rows = [header]
    for r in results:
        rows.append((str(r.mbs), fmt(r.tokens_per_s, ",.0f"), fmt(r.step_time_s, ".4f"), fmt(r.peak_gib, ".2f"),
                     "-" if r.scaling is None else f"{r.scaling:.2f}x", r.status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i < 5 else cell for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
