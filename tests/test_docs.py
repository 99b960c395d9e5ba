"""The docs stay true: their result tables are the benchmarks' last results, their links lead somewhere, and the
README's example output is what memfit prints today."""
import importlib.util
import re
from pathlib import Path

from memfit import PlanRequest, plan
from memfit.specs.instances import get_instance

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _docs_sync():
    spec = importlib.util.spec_from_file_location("docs_sync", ROOT / "benchmarks" / "docs_sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_results_section_is_the_benchmarks_last_output():
    sync = _docs_sync()
    found = []
    for page in sync.PAGES:
        text = page.read_text()
        named = re.findall(r"<!-- results: ([\w.]+) -->", text)
        assert [name for name, _ in sync.sections(text)] == named, f"{page.name}: a results section lost its form"
        for name, body in sync.sections(text):
            assert body == sync.results_text(name), f"{page.name}: {name} differs; run python benchmarks/docs_sync.py"
            found.append(name)
    assert {"technique_table.txt", "estimator_accuracy.txt", "planner_oracle.txt", "accuracy_costs.txt",
            "published_gpu.txt"} <= set(found)


def test_local_links_lead_somewhere():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to {target}"


def test_the_readme_example_is_what_the_planner_prints_today():
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("```")[1].split()
    assert quickstart == ["./scripts/demo.sh", "./scripts/test.sh"]
    workstation = get_instance("rtx-4090-workstation")   # the demo's machine (scripts/demo.sh)
    result = plan(PlanRequest(model="llama-3.1-8b", gpu=workstation.gpu, seq_len=4096, global_batch=64,
                              instance=workstation, host_ram_bytes=workstation.host_ram_bytes))
    best = result.plans[0]
    first_row = re.search(r"│ 1 │ (.+?) │ +(\d+ × \d+) │", text)
    shown = first_row.group(1).strip()
    assert " + ".join(best.techniques).startswith(shown)
    assert first_row.group(2) == f"{best.micro_batch} × {best.grad_accum}"


def test_the_readmes_first_screen_fits_a_terminal():
    """Its first 60 lines (what memfit answers, one plan) are at most 100 columns wide."""
    lines = (ROOT / "README.md").read_text().splitlines()[:60]
    assert [line for line in lines if len(line) > 100] == []


def test_the_technique_table_has_a_row_for_every_registered_technique_and_its_example():
    """docs/techniques.md is written by hand; the registry says what it must cover: a row naming each technique, and
    each declared example's parameters among those the row's heading lists."""
    from memfit.techniques import REGISTRY

    rows = {}
    for line in (ROOT / "docs" / "techniques.md").read_text().splitlines():
        if line.startswith("| `"):
            heading = line.split(" | ")[0]
            for name in re.findall(r"`([a-z0-9-]+)", heading):
                rows[name] = heading
    for name, cls in REGISTRY.items():
        assert name in rows, f"docs/techniques.md has no row for {name}"
        for spec, _ in cls.examples:
            for key in re.findall(r"([a-z_]+)=", spec):
                assert f"{key}=" in rows[name], f"docs/techniques.md's {name} row does not list {key}= ({spec})"
