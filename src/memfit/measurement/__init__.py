"""Real runs: the workload's step on this machine's best device, with its measured peak and categories."""
from memfit.measurement.run import measure, measure_many

__all__ = ["measure", "measure_many"]
