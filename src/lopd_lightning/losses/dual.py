"""The dual variable beta of LOPD's margin constraint, updated by projected dual ascent.

The composer minimises L_distill under the constraint Delta(phi) >= m (the privileged margin); its
Lagrangian weight beta multiplies (m - Delta) in the composer objective and follows

    beta <- max(0, beta + eta_beta (m - Delta))

after every step, Delta averaged over ranks: beta grows while the margin is short of m and decays to 0
once it is met. A small stateful controller, in the spirit of verl's adaptive KL controller
(``AdaptiveKLController``: a ``value`` and an ``update``), checkpointed with the module's method state.

Map to the method (docs/METHOD.md):

* :class:`DualAscent`: section 5, the dual ascent on beta (``dual_lr`` eta_beta, ``beta_init`` beta_0).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

__all__ = ["DualAscent"]


class DualAscent:
    """beta, the weight of (m - Delta) in the composer objective, and its projected dual-ascent update.

    Args:
        init: beta_0 >= 0 (paper: 0); LOPD's ``beta_init``.
        lr: eta_beta >= 0, the ascent's step size (paper: 0.5); LOPD's ``dual_lr``.

    Raises:
        ValueError: ``init`` or ``lr`` negative or NaN (:meth:`check`).

    Attributes:
        value: the current beta (a float; >= 0 after the first update).
        lr: eta_beta.

    Source: LOPD paper, docs/METHOD.md section 5, "Dual ascent".
    """

    def __init__(self, init: float = 0.0, lr: float = 0.5) -> None:
        self.check(init, lr)
        self.value = float(init)
        self.lr = float(lr)

    @staticmethod
    def check(init: float, lr: float) -> None:
        """Refuse a negative (or NaN) beta_0 or eta_beta, naming LOPD's config keys.

        beta is a Lagrange multiplier of an inequality constraint, so it lives in [0, inf) (the update
        projects onto it); a negative step size would descend the dual and push beta the wrong way.

        Raises:
            ValueError: ``init < 0`` (``model.init_args.beta_init``) or ``lr < 0`` (``model.init_args.dual_lr``).
        """
        if not float(init) >= 0.0:
            raise ValueError(f"model.init_args.beta_init must be >= 0 (beta_0, the dual variable's start: a "
                             f"multiplier of the margin constraint is never negative), got {init}")
        if not float(lr) >= 0.0:
            raise ValueError(f"model.init_args.dual_lr must be >= 0 (eta_beta, the dual ascent's step size; 0 keeps "
                             f"beta at beta_init), got {lr}")

    def update(self, delta: float | Tensor, margin: float, *, active: bool = True) -> float:
        """One step ``beta <- max(0, beta + lr (margin - delta))``; the new beta.

        Args:
            delta: Delta, the step's margin averaged over ranks (a float or a 0-d tensor).
            margin: m, the target (a ``MarginSchedule`` callback may move it between steps).
            active: False leaves beta unchanged: LOPD passes False when no teacher saw latents on any
                rank (Delta carries no signal then) or when the step's update was skipped.

        Returns:
            beta after the step; unchanged when not ``active`` or when ``delta`` is not finite (NaN or
            inf: a diverged step must not move beta).
        """
        if not active:
            return self.value
        delta = float(delta)
        if not math.isfinite(delta):
            return self.value
        self.value = max(0.0, self.value + self.lr * (float(margin) - delta))
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """``{"beta": value}``: the key LOPD checkpoints have always used (its method state)."""
        return {"beta": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore beta from :meth:`state_dict` (or any mapping with a ``"beta"`` entry: LOPD's method state)."""
        self.value = float(state["beta"])

    def __repr__(self) -> str:
        return f"DualAscent(value={self.value!r}, lr={self.lr!r})"
