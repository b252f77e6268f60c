"""Which divergences, with which options, the loss tests check against their float64 references.

Every registered divergence is checked (a new one is picked up by its name, so adding a divergence touches its
function and its reference, no test's list); :data:`OPTIONS` adds the non-default options a divergence is checked
with instead of its defaults.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_gkd.losses.registry import Divergence, get_divergence, registered_divergences

OPTIONS: dict[str, list[dict]] = {
    "jsd": [{"beta": 0.3}],
    "kl_rkl": [{"rkl_ratio": 0.25}],
    "tcad": [{}, {"divergence": "reverse_kl", "coverage_coef": 0.5}, {"divergence": "jsd", "alpha": 0.3}],
}


def divergence_cases(where: Callable[[Divergence], bool] = lambda divergence: True) -> list[tuple[str, dict]]:
    """``(loss_type, options)`` for every registered divergence that ``where`` accepts, with each of its
    :data:`OPTIONS` (its defaults where it has none there)."""
    return [(name, dict(options)) for name in registered_divergences() if where(get_divergence(name))
            for options in OPTIONS.get(name, [{}])]
