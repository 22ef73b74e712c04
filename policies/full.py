from __future__ import annotations

from dataclasses import dataclass

from kvbench.policies.base import Policy, Schedule, register


@register
@dataclass
class Full(Policy):
    """Keeps every entry: the reference every other policy is measured against."""

    name = "full"
    colour = "#000000"
    schedule = Schedule.NONE
    family = "none"
