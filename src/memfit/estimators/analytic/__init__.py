"""The analytic estimator: closed forms, evaluated by running each family's symbolic program (engine.py, ops.py,
families/) under the techniques' declarations (simulate.py), extrapolated in depth (estimate.py)."""
from memfit.estimators.analytic.estimate import analytic_estimate, count_parameters, regions_of
from memfit.estimators.analytic.host import offload_host_bytes
from memfit.estimators.analytic.simulate import simulate

__all__ = ["analytic_estimate", "count_parameters", "offload_host_bytes", "regions_of", "simulate"]
