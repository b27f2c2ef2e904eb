"""The record budget: auto adds to each step's stats (bench reads them: predicted vs realized gain)."""
from __future__ import annotations

import math


def step_record(budget, tree_size: int, emitted: int, seconds: float, realized: float) -> dict:
    """`budget`: an AutoBudget after its step; `realized`: the step's gain over ar by the cost model."""
    costs = budget.costs
    ar = costs.all_ar_rate()
    predicted = costs.rate(budget.expected, budget.nodes, budget.draft_s) / ar
    ar_s = costs.all_ar_s()
    measured = emitted * ar_s / seconds if seconds > 0 else None
    return {"drafted": budget.gate.drafting, "budget": budget.nodes, "expected_accepted": round(budget.expected, 3),
            "predicted_gain": round(predicted, 3), "measured_gain": _round(measured),
            "modelled_gain": round(realized, 3),
            # the step's time and an ar step's, by the cost table (bench --plan-costs: a projection)
            "modelled_s": round(budget.draft_s + costs.verify_s(tree_size - 1), 6), "ar_s": round(ar_s, 6)}


def _round(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 3)
