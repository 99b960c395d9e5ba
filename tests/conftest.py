import os
import warnings

import pytest

from memfit.measurement import measure
from memfit.measurement.training import text_batches, train_run
from memfit.techniques.resolve import ResolvedWorkload

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("MEMFIT_RANK_TIMEOUT_S", "600")   # a torchrun launch of the suite takes 1-3 minutes
warnings.filterwarnings("ignore")

EXAMPLES = {
    "convnet": ("memfit.examples.convnet:build", "memfit.examples.convnet:make_inputs"),
    "lstm": ("memfit.examples.lstm:build", "memfit.examples.lstm:make_inputs"),
    "frozen_encoder": ("memfit.examples.frozen_encoder:build", "memfit.examples.frozen_encoder:make_inputs"),
}


# the shape of the real CPU runs the technique tests measure: a step of a few seconds with a clear peak
SHAPE = {"model": "tiny-llama", "task": "train", "batch_size": 4, "seq_len": 256}


@pytest.fixture(scope="session")
def measured():
    """measured(techniques, model=, task=): one real run with both estimates beside it, made once per session
    (many tests compare against the same baseline)."""
    runs = {}

    def run(techniques: tuple[str, ...], model: str = "tiny-llama", task: str = "train"):
        if (techniques, model, task) not in runs:
            shape = {**SHAPE, "model": model, "task": task} | ({"new_tokens": 8} if task == "inference" else {})
            runs[techniques, model, task] = measure(ResolvedWorkload(**shape, techniques=techniques),
                                                    estimates=("traced", "analytic"))
        return runs[techniques, model, task]

    return run


@pytest.fixture(scope="session")
def losses():
    """losses(techniques, model=): five training steps on the bundled text, once per session."""
    runs = {}

    def run(techniques: tuple[str, ...], model: str = "tiny-llama") -> list[float]:
        if (techniques, model) not in runs:
            workload = ResolvedWorkload(model=model, task="train", batch_size=4, seq_len=192, techniques=techniques)
            batches = text_batches(batch_size=4, seq_len=192, num_batches=5)
            runs[techniques, model] = train_run(workload, batches, lr=1e-3).losses
        return runs[techniques, model]

    return run


def predicted(result, method: str) -> int:
    """The peak memfit's `method` ("traced", "analytic") predicted for a measured run."""
    return result.extra["estimates"][method]["peak_bytes"]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def host_predicted_as_measured(run) -> None:
    """A measured run's host RAM as its estimates predicted it: traced within 3 %, analytic within 10 %."""
    for method, tolerance in (("traced", 0.03), ("analytic", 0.10)):
        assert rel(run.extra["estimates"][method]["host_bytes"], run.host_bytes) < tolerance, method


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1)
