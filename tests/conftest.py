import os
import warnings

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore")

EXAMPLES = {
    "convnet": ("memfit.examples.convnet:build", "memfit.examples.convnet:make_inputs"),
    "lstm": ("memfit.examples.lstm:build", "memfit.examples.lstm:make_inputs"),
    "frozen_encoder": ("memfit.examples.frozen_encoder:build", "memfit.examples.frozen_encoder:make_inputs"),
}


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1)
