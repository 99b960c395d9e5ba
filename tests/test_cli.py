"""The command line: JSON a tool can parse, tables for people, one-line errors with exit code 2."""
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.cli.main import main

TINY = ["tiny-llama", "--batch-size", "2", "--seq-len", "64"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_models_and_gpus_json(capsys):
    code, out, _ = run(capsys, "models", "--json")
    models = {m["name"]: m for m in json.loads(out)["models"]}
    assert code == 0 and models["llama-3.1-8b"]["num_parameters"] == 8_030_261_248
    code, out, _ = run(capsys, "gpus", "--json")
    assert code == 0 and any(g["name"] == "h200-141gb" for g in json.loads(out)["gpus"])


def test_estimate_json_schema(capsys):
    code, out, _ = run(capsys, "estimate", *TINY, "--gpu", "rtx-4090", "--json")
    data = json.loads(out)
    assert code == 0 and data["schema"] == "memfit.estimate/1"
    for key in ("model", "num_parameters", "workload", "method", "device", "peak_bytes", "peak_phase", "at_peak",
                "component_peaks", "model_state_bytes", "overhead_bytes", "fits", "headroom_bytes", "elapsed_s"):
        assert key in data
    assert data["fits"] is True and data["device"] == "rtx-4090" and data["method"] == "traced"
    assert sum(data["at_peak"].values()) == data["peak_bytes"]


def test_estimate_table_modules_and_timeline(capsys, tmp_path):
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    code, out, _ = run(capsys, "estimate", *TINY, "--modules", "--timeline", str(png))
    assert code == 0 and "peak (tensors)" in out and "model.layers.*" in out and png.stat().st_size > 1000
    code, _, _ = run(capsys, "estimate", *TINY, "--timeline", str(js))
    timeline = json.loads(js.read_text())
    assert code == 0 and len(timeline["event"]) == len(timeline["bytes"]) and timeline["phases"]


def test_analytic_and_custom_module(capsys):
    code, out, _ = run(capsys, "estimate", "llama-3.1-70b", "--method", "analytic", "--precision", "bf16-mixed",
                       "--gpu", "h100", "--world-size", "8", "--zero", "3", "--json")
    data = json.loads(out)
    assert code == 0 and data["method"] == "analytic" and data["fits"] is False and data["zero_table"][3]["stage"] == 3
    code, out, _ = run(capsys, "estimate", "memfit.examples.convnet:build", "--inputs",
                       "memfit.examples.convnet:make_inputs", "--seq-len", "32", "--json")
    assert code == 0 and json.loads(out)["model"] == "memfit.examples.convnet:build"


def test_measure_command(capsys):
    code, out, _ = run(capsys, "measure", "tiny-bert", "--task", "inference", "--batch-size", "2", "--seq-len", "32")
    assert code == 0 and "measured / estimated" in out


def test_techniques_on_the_command_line(capsys):
    code, out, _ = run(capsys, "techniques", "--json")
    listed = json.loads(out)
    names = {t["name"] for t in listed["techniques"]}
    assert code == 0 and {"checkpointing", "adamw8bit", "chunked-ce", "fsdp2"} <= names
    stages = [o["stage"] for o in listed["order"]]
    assert stages.index("precision") < stages.index("activations") < stages.index("shard") and listed["rules"]
    code, out, _ = run(capsys, "measure", *TINY, "-t", "bf16-mixed", "-t", "checkpointing", "-t", "adamw8bit", "--json")
    data = json.loads(out)
    assert code == 0 and data["workload"]["precision"] == "bf16-mixed" and data["workload"]["optimizer"] == "adamw8bit"
    assert data["workload"]["techniques"] == ["checkpointing"]
    assert data["peak_bytes"] and all(data["estimates"][m]["peak_bytes"] for m in ("traced", "analytic"))
    code, out, _ = run(capsys, "estimate", *TINY, "-t", "checkpointing", "-t", "chunked-ce")
    assert code == 0 and "what each technique saves" in out


def test_savings_fall_back_to_traced_where_the_analytic_model_has_no_program(capsys):
    """int8-dynamic on BERT: the analytic model quantizes decoders only, so the savings table is traced."""
    code, out, _ = run(capsys, "estimate", "tiny-bert", "--task", "inference", "--batch-size", "2", "--seq-len", "64",
                       "-t", "int8-dynamic", "--json")
    savings = json.loads(out)["technique_savings"]
    assert code == 0 and savings[0]["method"] == "traced" and savings[0]["saved_bytes"] > 0


@pytest.mark.parametrize("argv, fragment", [
    (["estimate", "tiny-llama", "-t", "gradient-magic"], "unknown technique"),
    (["estimate", "tiny-llama", "-t", "checkpointing:every=0"], "positive integer"),
    (["estimate", "tiny-llama", "-t", "adamw8bit", "--world-size", "2", "--zero", "1"], "ZeRO-1/2"),
    (["estimate", "tiny-llama", "-t", "fsdp2"], "--world-size"),
    (["estimate", "tiny-llama", "-t", "fsdp2:mp=fp8", "--world-size", "2"], "mp='fp8'"),
    (["estimate", "llama-3-9b"], "unknown model"),
    (["estimate", "tiny-llama", "--batch-size", "0"], "batch-size"),
    (["estimate", "tiny-llama", "--batch-size", "two"], "invalid int"),
    (["estimate", "tiny-llama", "--precision", "fp4"], "unknown precision"),
    (["estimate", "tiny-llama", "--optimizer", "lion"], "unknown optimizer"),
    (["estimate", "tiny-llama", "--gpu", "h1000"], "unknown GPU"),
    (["estimate", "tiny-llama", "--gpu", "a100"], "a100-40gb (39.39 GiB) or a100-80gb"),
    (["estimate", "tiny-llama", "--gpu-memory", "20GiB"], "name one"),
    (["estimate", "tiny-llama", "--gpu", "l4", "--gpu-memory", "20"], "give a unit"),
    (["estimate", "tiny-llama", "--zero", "2"], "world-size"),
    (["estimate", "gpt2", "--seq-len", "5000"], "allow-long-seq"),
    (["estimate", "mypkg.models:build_net"], "--inputs"),
    (["estimate", "nosuchpkg.mod:build", "--inputs", "nosuchpkg.mod:inputs"], "cannot import"),
    (["estimate", "./nowhere/config.json"], "no model config"),
    (["estimate", "tiny-llama", "--timeline", "plot.gif"], "--timeline"),
    (["estimate", "tiny-llama", "--engine", "deepspeed"], "--zero 1, 2 or 3"),
    (["estimate", "tiny-llama", "--engine", "deepspeed", "--world-size", "2", "--zero", "2"], "bf16-mixed"),
    (["frobnicate"], "invalid choice"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, argv, fragment):
    code, lines = error_of(capsys, argv)
    assert code == 2 and len(lines) == 1 and fragment in lines[0]


def error_of(capsys, argv: list[str]) -> tuple[int, list[str]]:
    """The exit code and the non-empty lines on stderr of `memfit ARGV` (argparse's errors exit by SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["techniques", "models", "gpus"])
def test_piped_tables_fit_100_columns_and_keep_every_row(capsys, command):
    """In a log or CI (stdout not a terminal, no $COLUMNS) a table is 100 columns wide; every row's first cell is
    there in full."""
    code, out, _ = run(capsys, command)
    data = json.loads(run(capsys, command, "--json")[1])
    firsts = [item["name"] for item in data[command]]
    lines = out.splitlines()
    assert code == 0 and firsts and max(len(line) for line in lines) <= 100
    for first in firsts:
        assert any(f"│ {first} " in line for line in lines), first


def test_plan_tables_fit_the_columns_they_are_given(capsys, monkeypatch):
    """The plans table at 100 and 80 columns: nothing cut off; below 100 what a plan changes goes under its
    techniques."""
    for columns in (100, 80):
        monkeypatch.setenv("COLUMNS", str(columns))
        code, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--seq-len", "2048",
                           "--global-batch", "8")
        lines = [line for line in out.splitlines() if not line.startswith("run plan 1:")]   # a command to paste
        assert code == 0 and max(len(line) for line in lines) <= columns
        assert "tok/s/GPU" in out and ("changes" in out) and "run plan 1:" in out


@pytest.mark.parametrize("argv, fragment", [
    (["estimate", "tiny-llama", "--precison", "bf16"], "Did you mean: --precision?"),
    (["estimat", "tiny-llama"], "Did you mean: estimate?"),
    (["estimate", "tiny-llama", "--method", "tracd"], "Did you mean: traced?"),
    (["estimate", "tiny-llama", "-t", "checkpointing:mode=selectiv"], "Did you mean: selective, selective-op?"),
    (["plan", "tiny-llama", "--gpu", "rtx-4090", "--host-ram", "64"], "64GiB"),
    (["plan", "tiny-llama", "--gpu", "rtx-4090", "--batch-size", "4"], "--global-batch"),
    (["plan", "tiny-llama", "--gpu", "rtx-4090", "--zero", "2"], "--zero"),
    (["plan", "tiny-llama", "--gpu", "rtx-4090", "--exclude", "lorra"], "Did you mean: lora"),
    (["plan", "tiny-llama", "--gpu", "rtx-4090", "-t", "lora", "--exclude", "lora"], "drop one"),
    (["plan", "tiny-llama", "--gpu", "rtx-4090", "--method", "exact"], "analytic or traced"),
    (["plan", "tiny-llama", "--gpu", "rtx-4090", "--precision", "bf16", "-t", "fp16-mixed"], "disagree"),
    (["explain-oom", "-", "--world-size", "2"], "pass --model"),
])
def test_flags_the_commands_share_and_refuse(capsys, monkeypatch, argv, fragment):
    monkeypatch.setattr("sys.stdin", io.StringIO(OOM))
    code, lines = error_of(capsys, argv)
    assert code == 2 and len(lines) == 1 and fragment in lines[0], lines


OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       "23.68 GiB of which 1.88 GiB is free. Including non-PyTorch memory, this process has 21.79 GiB memory in use. "
       "Of the allocated memory 20.50 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but "
       "unallocated.")


def test_explain_oom_takes_the_workload_flags_of_estimate(capsys, tmp_path):
    """The failed workload as estimate takes it: ranks, ZeRO, engine (here DeepSpeed's ZeRO-3 over 2 GPUs)."""
    log = tmp_path / "oom.log"
    log.write_text(OOM)
    code, out, _ = run(capsys, "explain-oom", str(log), "--model", "llama-3.1-8b", "--seq-len", "1024", "--precision",
                       "bf16-mixed", "--world-size", "2", "--zero", "3", "--engine", "deepspeed", "--json")
    data = json.loads(out)
    assert code == 0 and data["step_bytes"] > 0 and data["fixes"]


def test_version_and_help_answer_without_loading_torch():
    """`memfit --help` and `--version` import no command (the commands load torch)."""
    script = ("import sys, contextlib, io\nfrom memfit.cli.main import main\n"
              "for argv in (['--help'], ['--version']):\n"
              "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
              "        try: main(argv)\n"
              "        except SystemExit as e: assert e.code == 0\n"
              "    assert out.getvalue()\n"
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_version_names_the_installed_libraries_memfit_models(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit):
        main(["--version"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("memfit ") and f"torch {version('torch')}, checked with" in out
    assert f"transformers {version('transformers')}, checked with" in out


def test_gpu_memory_sets_the_total_every_command_sizes_against(capsys):
    """--gpu-memory: a MIG slice or another driver's total, in estimate, plan and explain-oom alike."""
    common = ["llama-3.1-8b", "--task", "inference", "--seq-len", "1024", "--gpu", "a100-80gb", "--gpu-memory",
              "9.75GiB", "--json"]
    code, out, _ = run(capsys, "estimate", *common, "--method", "analytic")
    data = json.loads(out)
    assert code == 0 and data["device_memory_bytes"] == int(9.75 * 2**30) and data["fits"] is False
    code, out, _ = run(capsys, "plan", *common)
    assert code == 0 and json.loads(out)["request"]["gpu_memory_bytes"] == int(9.75 * 2**30)


def test_a_library_failure_is_one_line_naming_the_library_and_the_command(capsys, monkeypatch):
    import torch

    from memfit.cli import estimate as estimate_command

    def fails(args):
        return torch.functional.split(torch.zeros(2), [5])   # raises inside torch's own Python code

    monkeypatch.setattr(estimate_command, "run", fails)
    monkeypatch.delenv("MEMFIT_DEBUG", raising=False)
    code = main(["estimate", "tiny-llama"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("memfit: error: torch failed (RuntimeError:")
    assert "`memfit estimate tiny-llama`" in lines[0]
    monkeypatch.setenv("MEMFIT_DEBUG", "1")
    with pytest.raises(RuntimeError):
        main(["estimate", "tiny-llama"])


def test_an_estimate_says_when_a_library_is_outside_the_versions_its_rules_model():
    from memfit.core.versions import version_notes

    assert version_notes("estimate", {"torch": "2.12.1+cu126", "transformers": "5.20.0"}) == []
    newer, older = version_notes("estimate", {"torch": "2.14.0", "transformers": "5.10.1"})
    assert newer.startswith("torch 2.14.0 is installed") and "SDPA's kernel choice" in newer
    assert "transformers 5.10.1" in older and "5.17 to 5.24" in older
    assert "memory profiler" in version_notes("measure", {"torch": "2.11.0", "transformers": None})[0]


def test_the_package_accepts_the_oldest_versions_its_rules_were_checked_on():
    """A user's training environment keeps its torch and transformers (pip resolves them as installed): the ranges
    in pyproject.toml take the oldest versions core/versions.py was checked on."""
    import tomllib
    from packaging.requirements import Requirement

    from memfit.core.versions import MODELLED

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    ranges = {r.name: r.specifier for r in map(Requirement, project["dependencies"])}
    for rule in MODELLED:
        assert ranges[rule.library].contains(rule.oldest + ".0") and ranges[rule.library].contains(rule.newest + ".0")


def test_plan_constraints_hold_in_every_plan(capsys):
    """-t lora --precision bf16-mixed: every plan runs LoRA in bf16-mixed; --exclude keeps a technique out."""
    code, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--seq-len", "1024", "--global-batch",
                       "8", "-t", "lora", "--precision", "bf16-mixed", "--exclude", "checkpointing", "--json")
    data = json.loads(out)
    assert code == 0 and data["feasible"] and data["request"]["techniques"] == ["lora"]
    for plan in data["plans"]:
        assert plan["workload"]["precision"] == "bf16-mixed" and "lora" in plan["workload"]["techniques"]
        assert not any(t.startswith("checkpointing") for t in plan["workload"]["techniques"])
        # LoRA's perplexity cost was measured on a 5M-parameter model: the plan says so, and that 8B is extrapolated
        assert plan["ppl_increase"] and "tiny-llama" in plan["ppl_source"] and "x its parameters" in plan["ppl_source"]
