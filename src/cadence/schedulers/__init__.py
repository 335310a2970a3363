"""Schedulers choose each step's plan (choose) and learn from its outcome (observe)."""

from cadence.schedulers.base import Plan, Scheduler, SchedulerFactory, StepInfo, StepState
from cadence.schedulers.static import StaticScheduler

__all__ = ["Plan", "Scheduler", "SchedulerFactory", "StepInfo", "StepState", "StaticScheduler"]
