"""The command line: JSON a tool can parse, tables for people, one-line errors with exit code 2."""
import json

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
    (["estimate", "llama-3-8b"], "unknown model"),
    (["estimate", "tiny-llama", "--batch-size", "0"], "batch-size"),
    (["estimate", "tiny-llama", "--batch-size", "two"], "invalid int"),
    (["estimate", "tiny-llama", "--precision", "fp4"], "unknown precision"),
    (["estimate", "tiny-llama", "--optimizer", "lion"], "unknown optimizer"),
    (["estimate", "tiny-llama", "--gpu", "h1000"], "unknown GPU"),
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
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("command", ["techniques", "models", "gpus"])
def test_piped_tables_keep_one_line_per_row(capsys, command):
    """In a log or CI (stdout not a terminal) a row is one line: its first and last cells on the same line."""
    code, out, _ = run(capsys, command)
    data = json.loads(run(capsys, command, "--json")[1])
    first_and_last = {"techniques": lambda: [(t["name"], t["risk"]) for t in data["techniques"]],
                      "models": lambda: [(m["name"], m["reference"] or "") for m in data["models"]],
                      "gpus": lambda: [(g["name"], ", ".join(g.get("aliases") or [])) for g in data["gpus"]]}
    rows = first_and_last[command]()
    lines = out.splitlines()
    assert code == 0 and rows
    for first, last in rows:
        assert any(f"│ {first} " in line and last in line for line in lines), (first, last)
