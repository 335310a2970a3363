"""Schedulers choose the draft tree every step (choose) and learn from its outcome (observe)."""

from cadence.schedulers.base import Scheduler, StepInfo
from cadence.schedulers.static import StaticScheduler

__all__ = ["Scheduler", "StepInfo", "StaticScheduler"]
