import os
import warnings

import pytest
import torch

from memfit.core.precision import PRECISIONS
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
# a step that computes in bfloat16 or float16 runs 15-35x slower than in float32 on a CPU without bfloat16 units
# (an AMD EPYC with AVX2 only): those runs, and the float32 runs they are compared with, take a quarter of the tokens
HALF_SHAPE = {**SHAPE, "batch_size": 2, "seq_len": 128}
LOSS_SHAPE = {**SHAPE, "seq_len": 192}   # the losses fixture's five steps on the bundled text


def shape_for(techniques: tuple[str, ...], default: dict = SHAPE) -> dict:
    """`default`, or HALF_SHAPE when the techniques compute in half precision."""
    names = [spec.partition(":")[0] for spec in techniques]
    precision = next((PRECISIONS[name] for name in names if name in PRECISIONS), PRECISIONS["fp32"])
    return default if (precision.autocast_dtype or precision.param_dtype) == torch.float32 else HALF_SHAPE


@pytest.fixture(scope="session")
def measured():
    """measured(techniques, model=, task=, shape=): one real run with both estimates beside it, made once per
    session (many tests compare against the same baseline); at SHAPE's batch and sequence unless `shape` is given."""
    runs = {}

    def run(techniques: tuple[str, ...], model: str = "tiny-llama", task: str = "train", shape: dict = SHAPE):
        key = (techniques, model, task, shape["batch_size"], shape["seq_len"])
        if key not in runs:
            fields = {**shape, "model": model, "task": task} | ({"new_tokens": 8} if task == "inference" else {})
            runs[key] = measure(ResolvedWorkload(**fields, techniques=techniques), estimates=("traced", "analytic"))
        return runs[key]

    return run


@pytest.fixture(scope="session")
def losses():
    """losses(techniques, model=, shape=): five training steps on the bundled text, once per session."""
    runs = {}

    def run(techniques: tuple[str, ...], model: str = "tiny-llama", shape: dict = LOSS_SHAPE) -> list[float]:
        batch, seq = shape["batch_size"], shape["seq_len"]
        if (techniques, model, batch, seq) not in runs:
            workload = ResolvedWorkload(model=model, task="train", batch_size=batch, seq_len=seq, techniques=techniques)
            batches = text_batches(batch_size=batch, seq_len=seq, num_batches=5)
            runs[techniques, model, batch, seq] = train_run(workload, batches, lr=1e-3).losses
        return runs[techniques, model, batch, seq]

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


POINT = 0.01   # what an analytic estimate may drift from its recorded error before a test fails


def assert_analytic(run, measured_bytes: int | None = None, *, error: float = 0.0,
                    outcomes: tuple[int, ...] = ()) -> None:
    """The analytic estimate of a measured run within its error today (`error`, a fraction, recorded at the test
    where it is more than a rounding) plus one point. `outcomes`: other peaks the same run can reach (limits.md: an
    all-gather freed late, an old bucket set let go early), any of which the estimate may match."""
    actual = run.peak_bytes if measured_bytes is None else measured_bytes
    offs = [(predicted(run, "analytic") - peak) / peak for peak in (actual, *outcomes)]
    assert min(map(abs, offs)) < abs(error) + POINT, f"analytic {offs[0]:+.4f}, recorded {error:+.4f}"


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1)


def benchmark(name: str):
    """A script of benchmarks/ loaded as a module (its record readers and comparisons)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`memfit ARGV`'s exit code, standard output and standard error (argparse's refusals exit by SystemExit)."""
    from memfit.cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "llama_server_flags.txt")) as fh:
    LLAMA_FLAGS = {line for line in fh.read().split() if line.startswith("-")}   # llama-server's own flags
