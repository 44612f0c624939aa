"""lopd_lightning: Latent On-Policy Self-Distillation (LOPD) and its baselines as Lightning modules.

The method is specified in docs/METHOD.md (LOPD paper, Zhang et al. 2026); see docs/ARCHITECTURE.md for the
map from each equation to the function that computes it.
"""

__version__ = "0.1.0.dev0"
