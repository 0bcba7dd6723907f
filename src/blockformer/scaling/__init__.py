"""Scaling studies: train a grid of model sizes x token budgets, fit scaling laws to it."""

from .fit import ChinchillaFit, KaplanFit, fit_chinchilla, fit_kaplan  # noqa: F401
