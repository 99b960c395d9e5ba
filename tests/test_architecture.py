"""One technique, one place: a technique's name is written in at most three source files, code outside the
techniques never compares against one, and a technique registered from outside memfit (this module) takes part
in the rules, the planner, the cost model and explain-oom without an edit to memfit."""
import ast
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from memfit import get_gpu
from memfit.cli.main import main
from memfit.core.errors import MemfitError
from memfit.estimators.analytic import analytic_estimate
from memfit.planner import PlanRequest, plan
from memfit.planner.cost import step_time
from memfit.techniques import REGISTRY, Technique, parse_technique, register
from memfit.techniques.base import TRAITS
from memfit.techniques.resolve import ResolvedWorkload, without_technique

SOURCE = Path(__file__).resolve().parent.parent / "src" / "memfit"


def _string_constants(path: Path) -> list[ast.Constant]:
    """Every string in the module but its docstrings and a technique's `examples` (workloads it applies to, which
    may name the precision or layout they need)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skipped.add(id(first.value))
        target = getattr(node, "target", None) or next(iter(getattr(node, "targets", ())), None)
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name) and target.id == "examples" \
                and value is not None:
            skipped |= {id(n) for n in ast.walk(value)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in skipped]


def test_a_technique_name_is_written_in_at_most_three_source_files():
    strings = {path: [c.value for c in _string_constants(path)] for path in SOURCE.rglob("*.py")}
    spread = {}
    for name in REGISTRY:
        word = re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])")
        spread[name] = sorted(str(p.relative_to(SOURCE)) for p, values in strings.items()
                              if any(word.search(v) for v in values))
    assert {name: files for name, files in spread.items() if len(files) > 3} == {}


def test_no_code_outside_the_techniques_compares_against_a_technique_name():
    names = set(REGISTRY)
    found = []
    for path in SOURCE.rglob("*.py"):
        if path.parent.name == "techniques":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            values = [c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)]
            found += [f"{path.relative_to(SOURCE)}:{node.lineno}" for v in values if v in names]
    assert found == []


def test_every_registered_technique_is_exported_by_its_class_name():
    """`from memfit.techniques import X` works for every technique `-t` takes (the list is kept by hand)."""
    import memfit.techniques as techniques

    missing = sorted(cls.__name__ for cls in REGISTRY.values() if getattr(techniques, cls.__name__, None) is not cls)
    assert missing == []
    assert {cls.__name__ for cls in REGISTRY.values()} <= set(techniques.__all__)


def test_every_registered_technique_declares_its_own_examples():
    """Each class declares where it applies (a subclass too: its parent's examples are the parent's), and each
    example parses to that class: the technique tests, fuzzing and the golden cases run them."""
    for name, cls in REGISTRY.items():
        if name == HalfMlp.name:
            continue   # the toy registered by a test below
        assert cls.__dict__.get("examples"), f"{cls.__name__} declares no examples"
        for spec, fields in cls.examples:
            assert type(parse_technique(spec)) is cls and isinstance(fields, dict), spec


@pytest.mark.parametrize("declared, problem", [
    ({"stage": "somewhere"}, "stage 'somewhere' is not one of"),
    ({"search_axis": "speed"}, "search_axis 'speed' is not one of"),
    ({"risk": "risky"}, "risk 'risky'"),
    ({"traits": frozenset({"glows"})}, "unknown traits ['glows']"),
    ({"name": "Half MLP"}, "lower-case words"),
    ({"time_factor": 0}, "time_factor 0"),
    ({"workload_field": "batch_size"}, "workload_field 'batch_size'"),
])
def test_registration_checks_every_declaration(declared, problem):
    """A technique declaring what memfit does not know fails where it registers, naming the declaration."""
    bad = type("Bad", (HalfMlp,), {"name": "toy-bad", **declared})
    with pytest.raises(TypeError, match=re.escape(problem)):
        register(bad)
    assert "toy-bad" not in REGISTRY and "Half MLP" not in REGISTRY


def test_techniques_never_ask_whether_they_are_traced():
    """A traced run's stand-ins live with the tracer (estimators/stand_ins.py), registered by name: no technique
    branches on fake tensors itself, and every stand-in a technique asks for is registered."""
    import memfit.estimators  # noqa: F401  (registers the stand-ins)
    from memfit.steps.stand_ins import STAND_INS

    asked = set()
    for path in (SOURCE / "techniques").glob("*.py"):
        text = path.read_text()
        assert "is_fake" not in text, path.name
        asked |= set(re.findall(r'stand_in\("([\w-]+)"', text))
    assert asked and asked <= set(STAND_INS)


def test_every_rule_names_a_technique_or_a_known_trait():
    for cls in REGISTRY.values():
        for key in cls.conflicts_with:
            assert key in REGISTRY or key in TRAITS, (cls.name, key)


@dataclass(frozen=True, kw_only=True)
class HalfMlp(Technique):
    """A toy technique, registered from this test: MLPs half as wide, twice as fast to compute (its declared
    factor), not with adapters (its rule), tried by the planner and offered by explain-oom."""

    name = "toy-half-mlp"
    summary = "a test's toy: MLPs half as wide"
    risk = "lossless"
    stage = "prune"
    time_factor = 0.5
    conflicts_with = {"adapters": ("the toy halves the MLPs {other} adapts", "drop -t {other}")}
    oom_fixes = ("toy-half-mlp",)
    search_axis = "weights"

    @classmethod
    def search_values(cls, request, workload):
        return [cls.name] if request.task == "train" else []

    def analytic_spec(self, spec, workload):
        return dataclasses.replace(spec, intermediate=spec.intermediate // 2)


@pytest.fixture
def toy():
    """The toy registered for one test (as a plugin registers its techniques on import), then removed."""
    register(HalfMlp)
    yield HalfMlp
    REGISTRY.pop(HalfMlp.name, None)


SHAPE = dict(model="llama-3.1-8b", task="train", seq_len=2048, precision="bf16-mixed")


def test_a_toy_technique_takes_part_everywhere_without_an_edit_to_memfit(toy, capsys, tmp_path):
    # its rule refuses a combination, with its reason
    with pytest.raises(MemfitError, match="the toy halves the MLPs lora adapts"):
        ResolvedWorkload(**SHAPE, techniques=("toy-half-mlp", "lora"))
    # its declared saving and time factor change a plan's numbers
    request = PlanRequest(model="llama-3.1-8b", gpu=get_gpu("a100-80gb"), seq_len=2048, global_batch=8)
    best = plan(request).plans[0]
    assert "toy-half-mlp" in best.techniques   # half the compute: the fastest
    twin = without_technique(best.workload(request), toy())   # the same plan without it
    twin_estimate = analytic_estimate(twin, request.gpu)
    twin_time = step_time(twin, twin_estimate, request.gpu, grad_accum=best.grad_accum, num_gpus=1)
    assert best.time.parts["compute"] == pytest.approx(0.5 * twin_time.parts["compute"])
    assert best.estimate.peak_bytes < twin_estimate.peak_bytes
    # its OOM fix is listed with its predicted saving
    log = tmp_path / "oom.log"
    log.write_text("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
                   "1.25 GiB is free. Including non-PyTorch memory, this process has 77.88 GiB memory in use. Of the "
                   "allocated memory 74.02 GiB is allocated by PyTorch, and 3.21 GiB is reserved by PyTorch but "
                   "unallocated.")
    assert main(["explain-oom", str(log), "--model", "llama-3.1-8b", "--seq-len", "2048", "--precision",
                 "bf16-mixed", "--gpu", "a100-80gb", "--json"]) == 0
    fixes = {f["fix"]: f for f in json.loads(capsys.readouterr().out)["fixes"]}
    assert fixes["toy-half-mlp"]["saved_bytes"] > 0 and fixes["toy-half-mlp"]["basis"].startswith("analytic")


def test_what_techniques_share_is_decided_before_any_applies():
    """The mesh and who keeps offloaded states are decided once from the whole set (compose.decide_layout), so no
    technique's apply_ depends on another's having run first."""
    from memfit.core.precision import get_precision
    from memfit.steps.setup import StepSetup
    from memfit.techniques.compose import decide_layout

    def decided(*specs: str, world_size: int = 4) -> StepSetup:
        setup = StepSetup(model=None, precision=get_precision("fp32"), device_type="cpu")  # type: ignore[arg-type]
        decide_layout(setup, [parse_technique(s) for s in specs], world_size)
        return setup

    assert decided("tensor-parallel:size=2", "fsdp2").mesh_axes == (("dp", 2), ("tp", 2))
    assert decided("pipeline-parallel:stages=2", "fsdp2", world_size=8).mesh_axes == (("pp", 2), ("dp", 4))
    assert decided("fsdp2").mesh_axes == ()
    assert decided("cpu-offload", "fsdp2").layout_offloads and decided("fsdp2", "cpu-offload").layout_offloads
    assert not decided("cpu-offload").layout_offloads and not decided("cpu-offload", "ddp").layout_offloads
