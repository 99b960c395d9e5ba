"""A differential test: small random modules, traced against their measured run on the CPU.

Hypothesis draws a stack of layers (linear maps with activations, norms, residual adds done in place, views and
reshapes, a custom autograd Function, frozen layers, buffers, an output tied to an input weight) and a batch; the
traced estimate of the training step must be within 1 % of the measured peak. A failure prints the drawn model.
The suite draws a fixed-seed sample; a longer search: MEMFIT_DIFFERENTIAL_EXAMPLES=500 pytest tests/test_differential.py
"""
import json
import os
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.measurement import measure
from memfit.techniques.resolve import ResolvedWorkload

LAYERS = ("linear", "gelu_linear", "layernorm", "residual_inplace", "reshape", "custom_function", "frozen_linear",
          "buffer_scale")

FACTORY = '''
import json

import torch
from torch import nn


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class Layer(nn.Module):
    def __init__(self, kind, width):
        super().__init__()
        self.kind = kind
        if kind in ("linear", "gelu_linear", "residual_inplace", "frozen_linear"):
            self.linear = nn.Linear(width, width)
            self.linear.requires_grad_(kind != "frozen_linear")
        if kind == "layernorm":
            self.norm = nn.LayerNorm(width)
        if kind == "buffer_scale":
            self.register_buffer("scale", torch.ones(width))

    def forward(self, x):
        kind = self.kind
        if kind in ("linear", "frozen_linear"):
            return self.linear(x)
        if kind == "gelu_linear":
            return self.linear(torch.nn.functional.gelu(x))
        if kind == "layernorm":
            return self.norm(x)
        if kind == "residual_inplace":
            y = self.linear(x)
            y.add_(x)
            return y
        if kind == "reshape":
            b, w = x.shape
            return x.view(b, 2, w // 2).transpose(1, 2).reshape(b, w)
        if kind == "custom_function":
            return Square.apply(x)
        return x * self.scale


class Net(nn.Module):
    def __init__(self, spec):
        super().__init__()
        width, features = spec["width"], features_of(spec)
        self.inp = nn.Linear(features, width)
        self.layers = nn.ModuleList(Layer(kind, width) for kind in spec["layers"])
        self.out = nn.Linear(width, features, bias=False)
        if spec["tied"]:
            self.out.weight = self.inp.weight

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def features_of(spec):
    return spec["width"] if spec["tied"] else spec["features"]   # a tied output maps width back to width


def build():
    with open("spec.json") as fh:
        return Net(json.load(fh))


def inputs(batch_size, seq_len):
    with open("spec.json") as fh:
        return torch.randn(batch_size, features_of(json.load(fh)))
'''

specs = st.fixed_dictionaries({
    "width": st.sampled_from([16, 32, 64]),
    "features": st.sampled_from([16, 32, 64]),
    "layers": st.lists(st.sampled_from(LAYERS), min_size=1, max_size=5),
    "tied": st.booleans(),
    "batch": st.integers(1, 64),
})


@pytest.fixture(scope="module")
def factory_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("differential")
    (folder / "diffnet.py").write_text(textwrap.dedent(FACTORY))
    return folder


@settings(max_examples=int(os.environ.get("MEMFIT_DIFFERENTIAL_EXAMPLES", "12")), deadline=None,
          derandomize="MEMFIT_DIFFERENTIAL_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=specs)
def test_random_modules_are_traced_as_they_run(spec, factory_folder, monkeypatch):
    monkeypatch.chdir(factory_folder)
    (factory_folder / "spec.json").write_text(json.dumps(spec))
    workload = ResolvedWorkload(model="./diffnet.py:build", inputs="./diffnet.py:inputs", batch_size=spec["batch"],
                                seq_len=1)
    measured = measure(workload, estimates=("traced",))
    ratio = measured.extra["ratios"]["measured/traced"]
    assert abs(ratio - 1) < 0.01, f"{spec}: measured/traced {ratio:.4f}"
