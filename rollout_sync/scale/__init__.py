"""Dry runs at scale: plan a whole sync from shapes alone on one CPU, with its traffic and a time model.

``spec`` parses and checks the model and layouts, ``dry_run`` builds the maps, plans and measures,
``traffic`` holds the traffic and time model, ``rounds`` the executor schedule of busy ranks, ``report``
and ``plot`` present the results. The command is ``rollout-sync plan`` (``rollout_sync.cli``).
"""

from .dry_run import DryRunConfig, dry_run
from .spec import RolloutLayout, TrainerLayout, parse_rollout, parse_trainer
from .traffic import Bandwidth, Topology

__all__ = [
    "Bandwidth",
    "DryRunConfig",
    "RolloutLayout",
    "Topology",
    "TrainerLayout",
    "dry_run",
    "parse_rollout",
    "parse_trainer",
]
