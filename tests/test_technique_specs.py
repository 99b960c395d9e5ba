"""A technique's specification: bad input refused in one line, every example parsed, round-tripped and with its
effect, a workload's techniques through JSON, a parameter typed wrong."""
import re

import pytest

import memfit
from memfit.core.errors import MemfitError
from memfit.estimators.effects import effect
from memfit.specs.workload import Workload
from memfit.techniques.base import REGISTRY, parse_technique
from memfit.techniques.resolve import ResolvedWorkload, resolve
from tests.conftest import SHAPE


def test_bad_input_is_one_error_and_changes_nothing():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, vocab_size=64))
    forwards = [layer.forward for layer in model.model.layers]
    for bad, fragment in ((["checkpointing", "nosuch"], "unknown technique"),
                          (["checkpointing", "checkpointing:every=2"], "given twice"),
                          (["adamw8bit", "adafactor"], "both set the optimizer"),
                          (["checkpointing:mode=fast"], "full, selective, selective-op, offload"),
                          (["cpu-offload", "adamw8bit"], "float32 states"),
                          (["checkpointing", "cpu-offload"], "pass your optimizer"),
                          (["truncate:max_len=x"], "not a valid int")):
        with pytest.raises(MemfitError, match=fragment):
            memfit.apply_(model, None, bad)
    assert [layer.forward for layer in model.model.layers] == forwards
    with pytest.raises(MemfitError, match="ZeRO-1/2"):
        ResolvedWorkload(model="tiny-llama", world_size=2, zero_stage=1, techniques=("adamw8bit",))
    with pytest.raises(MemfitError, match="inference"):
        ResolvedWorkload(model="tiny-llama", task="inference", techniques=("checkpointing",))
    with pytest.raises(MemfitError, match="bf16-mixed"):
        ResolvedWorkload(model="tiny-llama", techniques=("cpu-offload", "fp16-mixed"))
    with pytest.raises(MemfitError, match="other blocks"):
        ResolvedWorkload(model="tiny-gpt2", world_size=2, techniques=("tensor-parallel",))
    with pytest.raises(MemfitError, match="do not split over 3 ranks"):
        ResolvedWorkload(model="tiny-llama", world_size=3, techniques=("tensor-parallel",))
    for techniques, fragment in ((("pipeline-parallel:microbatches=3",), "does not split into 3"),
                                 (("pipeline-parallel:microbatches=1",), "at least as many micro-batches"),
                                 (("pipeline-parallel:schedule=zb",), "1f1b, gpipe"),
                                 (("pipeline-parallel", "fsdp2"), "pipeline-parallel:stages=S"),
                                 (("pipeline-parallel:stages=2",), "at least 2, below --world-size 2"),
                                 (("pipeline-parallel:stages=-1",), "stages must be 0")):
        with pytest.raises(MemfitError, match=fragment):
            ResolvedWorkload(model="tiny-llama", batch_size=4, world_size=2, techniques=techniques)
    with pytest.raises(MemfitError, match="leaves 2 copies of the model to train side by side"):
        ResolvedWorkload(model="tiny-llama", batch_size=4, world_size=4, techniques=("pipeline-parallel:stages=2",))
    with pytest.raises(MemfitError, match="at least as many micro-batches"):   # 1F1B over the stages, not the ranks
        ResolvedWorkload(model="tiny-llama", batch_size=4, world_size=8,
                         techniques=("pipeline-parallel:stages=4,microbatches=2", "fsdp2"))
    with pytest.raises(MemfitError, match="ties its embeddings"):
        ResolvedWorkload(model="tiny-qwen2", world_size=2, techniques=("pipeline-parallel",))
    with pytest.raises(MemfitError, match="drop chunked-ce"):   # --world-size N alone is DDP
        ResolvedWorkload(model="tiny-llama", world_size=2, techniques=("chunked-ce",))


# ... and the ones that by design change no tensor of the step
NO_TENSOR_EFFECT = {"expandable-segments": "changes the CUDA allocator's reserve",
                    "release-cache": "returns cached CUDA blocks between phases",
                    "prune-unstructured": "leaves its zeros in the same dense tensors"}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_technique_example_parses_round_trips_and_has_an_effect(name):
    """Each technique's examples (what it declares: a configuration and the workload it applies to) change the
    estimate, but for those that by design change no tensor."""
    cls = REGISTRY[name]
    for spec, where in cls.examples:
        workload = ResolvedWorkload(**{**SHAPE, "seq_len": 128, **where})   # `where` may set another shape
        method = "analytic" if workload.source.is_hf and "traced-only" not in cls.traits else "traced"
        base = memfit.estimate(workload, method=method)
        technique = parse_technique(spec)
        assert type(technique) is cls and parse_technique(technique.spec) == technique
        changed = effect(technique, base, workload, method=method).extra["effect"]
        assert (changed["saved_bytes"] == 0) == (name in NO_TENSOR_EFFECT), (spec, changed["saved_bytes"])


def test_a_workloads_techniques_round_trip_through_json():
    spec = parse_technique("sequence-chunks:window=64,stride=32").spec
    assert spec == "sequence-chunks:window=64,stride=32"
    data = ResolvedWorkload(**SHAPE, techniques=("checkpointing:every=2", "bf16-mixed")).to_json()
    assert data["precision"] == "bf16-mixed" and data["techniques"] == ["checkpointing:every=2"]
    again = ResolvedWorkload(**SHAPE, techniques=("bf16-mixed", "checkpointing:every=2"))
    assert resolve(Workload.from_json(data)) == again


@pytest.mark.parametrize("spec, fragment", [
    ("checkpointing:every", "'every' needs a value (every=..., default 1)"),
    ("checkpointing:evry=2", "'evry=2' is not a parameter of checkpointing"),
    ("nvme-offload:path", "'path' needs a value"),
])
def test_a_technique_parameter_typed_wrong_says_what_is_wrong(spec, fragment):
    with pytest.raises(MemfitError, match=re.escape(fragment)):
        parse_technique(spec)
