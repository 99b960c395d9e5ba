"""The planner: the fastest combination of techniques and batch shape that fits the user's GPUs."""
from memfit.planner.planning import plan
from memfit.planner.request import PlanRequest
from memfit.planner.result import PlanResult, load_plan

__all__ = ["PlanRequest", "PlanResult", "load_plan", "plan"]
