"""The tracker counts every storage once, in the right category; a dropped or doubled component fails."""
import gc
import weakref

import torch
from torch import nn

from memfit.estimators.traced import traced_estimate
from memfit.estimators.tracker import MemoryTracker
from memfit.measurement.run import measure_run
from memfit.steps.hooks import tensors_in
from memfit.techniques.resolve import ResolvedWorkload

IN, HID, OUT, BATCH = 64, 128, 10, 8
PARAM_BYTES = (IN * HID + HID + HID * OUT + OUT) * 4


def build_mlp():
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))


def mlp_inputs(batch_size, seq_len):
    return torch.randn(batch_size, IN)


MLP = dict(model="tests.test_tracker:build_mlp", inputs="tests.test_tracker:mlp_inputs")


def test_model_states_are_exact():
    estimate = traced_estimate(ResolvedWorkload(**MLP, batch_size=BATCH, seq_len=1))
    assert estimate.model_state_bytes == {
        "parameters": PARAM_BYTES,
        "gradients": PARAM_BYTES,
        "optimizer_states": 2 * PARAM_BYTES + 4 * 4,   # exp_avg, exp_avg_sq, and a float32 step per tensor
    }
    assert estimate.component_peaks["inputs"] == BATCH * IN * 4
    assert sum(estimate.at_peak.values()) == estimate.peak_bytes


def test_sgd_and_adafactor_states():
    sgd = traced_estimate(ResolvedWorkload(**MLP, batch_size=BATCH, seq_len=1, optimizer="sgd"))
    assert sgd.model_state_bytes["optimizer_states"] == PARAM_BYTES
    ada = traced_estimate(ResolvedWorkload(**MLP, batch_size=BATCH, seq_len=1, optimizer="adafactor"))
    factors = (HID + IN) + HID + (OUT + HID) + OUT   # row + column factors of matrices, full variance of biases
    assert ada.model_state_bytes["optimizer_states"] == factors * 4 + 4 * 4


def test_traced_equals_the_real_run():
    workload = ResolvedWorkload(**MLP, batch_size=BATCH, seq_len=1)
    traced, measured = traced_estimate(workload), measure_run(workload)
    assert traced.peak_bytes == measured.extra["tracked_peak_bytes"]     # every tensor, to the byte
    assert measured.extra["untracked_bytes"] < 64                         # the allocator saw only a few scalars more


def test_views_share_one_storage():
    tracker = MemoryTracker()
    with tracker:
        base = torch.empty(1000)
        views = [base[:10], base.view(10, 100), base[::2]]
        tracker.mark("activations", views)
        top, _, _ = tracker.trace().summary()
    assert top.total == 4000


def test_frees_are_seen_when_tensors_die():
    tracker = MemoryTracker()
    with tracker:
        a = torch.empty(256)
        b = torch.empty(512)
        del a
        c = torch.empty(128)
    trace = tracker.trace()
    top, _, _ = trace.summary()
    assert top.total == 1024 + 2048   # a and b together; c came after a was freed
    del b, c


def test_tensors_in_keeps_nothing_alive():
    """A recursive closure here once kept KV caches alive until the garbage collector ran."""
    gc.disable()
    try:
        tensor = torch.empty(10)
        ref = weakref.ref(tensor)
        found = tensors_in({"layers": [[tensor]]})
        assert found[0] is tensor
        del tensor, found
        assert ref() is None
    finally:
        gc.enable()


def test_estimate_json_round_trip():
    from memfit.estimators.breakdown import MemoryEstimate

    estimate = traced_estimate(ResolvedWorkload(**MLP, batch_size=BATCH, seq_len=1), modules=True)
    data = estimate.to_json()
    assert MemoryEstimate.from_json(data).to_json() == data
