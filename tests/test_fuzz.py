"""Bad input, generated: every one ends in one line on stderr and exit 2 (a MemfitError naming the problem), never a
traceback. A fixed-seed sample runs here; `python scripts/fuzz.py` runs hundreds of each (MEMFIT_FUZZ_EXAMPLES).

The inputs are what users hand memfit: OOM messages cut off or mangled in a log, snapshot files that are not
quite snapshots (or pickles that try to run a command), technique specs, and estimate/plan flags.
"""
import contextlib
import io
import json
import os
import pickle
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.cli.main import main
from memfit.core.errors import MemfitError
from memfit.measurement.oom import load_snapshot, parse_oom_message, summarize_snapshot
from memfit.techniques.base import REGISTRY, parse_technique

EXAMPLES = int(os.environ.get("MEMFIT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="MEMFIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))

MESSAGES = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 19.68 GiB. GPU 0 has a total capacity of 23.68 GiB "
    "of which 11.88 GiB is free. Including non-PyTorch memory, this process has 11.79 GiB memory in use. Of the "
    "allocated memory 11.44 GiB is allocated by PyTorch, and 43.59 MiB is reserved by PyTorch but unallocated.",
    "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU 1 has a total capacity of 93.02 GiB of "
    "which 1.18 GiB is free. Process 2752205 has 91.82 GiB memory in use. Of the allocated memory 90.63 GiB is "
    "allocated by PyTorch, and 120.54 MiB is reserved by PyTorch but unallocated.",
    "RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB "
    "already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)",
)
ODD_NUMBERS = ("nan", "inf", "-5", "1.2.3", "..", "", "1e400", "99999999999999999999999", "0", "٣", " ")
ODD_UNITS = ("GiB", "MiB", "KiB", "TiB", "B", "bytes", "GB", "Gib", "", "PiB")


@st.composite
def oom_texts(draw) -> str:
    text = draw(st.sampled_from(MESSAGES))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(("cut", "unit", "number", "insert", "wrap")))
        if kind == "cut":
            text = text[:draw(st.integers(0, len(text)))]
        elif kind == "unit":
            unit = draw(st.sampled_from(ODD_UNITS[:4]))
            text = text.replace(unit, draw(st.sampled_from(ODD_UNITS)), 1)
        elif kind == "number":
            numbers = [w for w in text.split() if w[:1].isdigit()]
            if numbers:
                text = text.replace(draw(st.sampled_from(numbers)), draw(st.sampled_from(ODD_NUMBERS)
                                                                          | st.text(max_size=6)), 1)
        elif kind == "insert":
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.text(max_size=12)) + text[at:]
        else:
            text = text.replace(" ", "\n", draw(st.integers(0, 20)))
    return text


def _valid_snapshot() -> dict:
    frames = [{"filename": "torch/optim/adamw.py", "name": "_init_group", "line": 1}]
    return {"segments": [{"device": 0, "total_size": 4096, "blocks": [
                {"size": 2048, "state": "active_allocated", "frames": frames}, {"size": 2048, "state": "inactive"}]}],
            "device_traces": [[{"action": "alloc", "addr": 0, "size": 2048, "frames": frames},
                               {"action": "free_requested", "addr": 0}, {"action": "alloc", "addr": 8, "size": 512},
                               {"action": "oom", "size": 8192, "device_free": 100}]]}


plain = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                         st.sampled_from(("segments", "blocks", "size", "state", "frames", "action", "addr",
                                          "device_traces", "total_size", "device", "device_free", "category",
                                          "filename", "name")), inner, max_size=4), max_leaves=12)


@st.composite
def snapshots(draw):
    """A real snapshot's structure with one part replaced by something else, or random plain data."""
    if draw(st.booleans()):
        return draw(plain)
    data = _valid_snapshot()
    node, key = data, "segments"
    for _ in range(draw(st.integers(0, 4))):   # walk down to a random node
        value = node[key]
        if isinstance(value, dict) and value:
            node, key = value, draw(st.sampled_from(sorted(value)))
        elif isinstance(value, list) and value:
            node, key = value, draw(st.integers(0, len(value) - 1))
    node[key] = draw(plain)
    return data


class _RunsACommand:
    def __reduce__(self):
        return (os.system, ("touch fuzz-pwned",))


def cli(*argv: str) -> tuple[int, str, str]:
    """memfit's exit code, stdout and stderr; any exception but the ones the CLI turns into exit codes escapes
    (a crash, which fails the test with its traceback: MEMFIT_DEBUG keeps it)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch.dict(os.environ, {"MEMFIT_DEBUG": "1"}):
        try:
            code = main(list(argv))
        except SystemExit as exc:   # argparse's own errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def assert_clean(code: int, out: str, err: str) -> None:
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("memfit: error:"), err
    else:
        json.loads(out)
    assert "Traceback" not in err


@FUZZ
@given(oom_texts())
def test_oom_messages(text):
    try:
        message = parse_oom_message(text)
    except MemfitError:
        return
    assert message.tried_bytes >= 0 and message.shortfall_bytes >= 0


@FUZZ
@given(snapshots())
def test_snapshots(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("snap") / "s.pickle"
    path.write_bytes(pickle.dumps(data))
    try:
        summary = summarize_snapshot(load_snapshot(str(path)))
    except MemfitError:
        return
    assert summary.reserved_bytes >= 0 and all(v >= 0 for v in summary.by_category.values())
    assert_clean(*cli("explain-oom", str(path), "--json"))


@FUZZ
@given(st.binary(max_size=64) | st.builds(lambda data, cut: pickle.dumps(data)[:cut], plain, st.integers(0, 40)))
def test_snapshot_bytes(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("raw") / "s.pickle"
    path.write_bytes(raw)
    with contextlib.suppress(MemfitError):
        load_snapshot(str(path))


def test_a_snapshot_that_would_run_a_command_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps({"segments": [], "hook": _RunsACommand()}))
    code, out, err = cli("explain-oom", "evil.pickle")
    assert_clean(code, out, err)
    assert code == 2 and "refuses" in err and not (tmp_path / "fuzz-pwned").exists()


names = sorted(REGISTRY) if REGISTRY else [parse_technique("bf16").name]
keys = st.sampled_from(("every", "mode", "rank", "alpha", "targets", "chunks", "window", "stride", "ratio", "part",
                        "format", "double_quant", "microbatches", "schedule", "reshard", "bucket_view", "teacher",
                        "layers", "max_len", "sparsity", "blocks", "x", ""))
values = st.sampled_from(ODD_NUMBERS + ("true", "maybe", "selective", "(", "q_proj|", "nf4", "2", "0.5")) | st.text(
    max_size=6)


@st.composite
def technique_specs(draw) -> str:
    name = draw(st.sampled_from(sorted(REGISTRY)) | st.text(max_size=8))
    params = draw(st.lists(st.tuples(keys, values), max_size=3))
    spec = name + (":" + ",".join(f"{k}={v}" for k, v in params) if params else "")
    return spec if draw(st.booleans()) else spec.replace("=", draw(st.sampled_from(("", "==", ":"))), 1)


@FUZZ
@given(technique_specs())
def test_technique_specs(spec):
    with contextlib.suppress(MemfitError):
        parse_technique(spec)


SMALL_MODELS = ("tiny-llama", "tiny-bert", "tiny-gpt2", "tiny-t5", "tiny-vit", "tiny-qwen2", "llama-3.1-8b")
numbers = st.sampled_from(("-1", "0", "1", "2", "3", "8", "64", "99999999999", "1.5", "x", "", "nan"))
flags = st.lists(st.one_of(
    st.tuples(st.sampled_from(("--batch-size", "--seq-len", "--new-tokens", "--world-size", "--zero", "--reduce-bucket",
                               "--plan-index")), numbers),
    st.tuples(st.just("--task"), st.sampled_from(("train", "inference", "", "Train"))),
    st.tuples(st.just("--precision"), st.sampled_from(("fp32", "bf16", "bf16-mixed", "fp16-mixed", "fp16", "fp8", ""))),
    st.tuples(st.just("--optimizer"), st.sampled_from(("adamw", "sgd", "adamw8bit", "lion", ""))),
    st.tuples(st.just("--engine"), st.sampled_from(("pytorch", "deepspeed", "jax"))),
    st.tuples(st.just("--gpu"), st.sampled_from(("t4", "h100-sxm-80gb", "h1000", ""))),
    st.tuples(st.just("-t"), technique_specs()),
), max_size=5)


@FUZZ
@given(st.sampled_from(SMALL_MODELS) | st.text(max_size=10).filter(lambda s: ":" not in s), flags)
def test_estimate_arguments(model, pairs):
    argv = ["estimate", model, "--method", "analytic", "--json"] + [x for pair in pairs for x in pair]
    assert_clean(*cli(*argv))


# every technique's declared examples (techniques/*.py `examples`), a few variants beside them
VALID_SPECS = tuple(sorted({spec for cls in REGISTRY.values() for spec, _ in cls.examples} | {
    "checkpointing:every=2", "truncate:max_len=32", "sequence-chunks:window=16,stride=8", "fsdp2:reshard=false",
    "pipeline-parallel:microbatches=2", "sliding-window:window=16"}))
@FUZZ
@given(st.sampled_from(SMALL_MODELS), st.lists(st.sampled_from(VALID_SPECS), max_size=4, unique=True),
       st.sampled_from(((), ("--world-size", "2"), ("--world-size", "4", "--batch-size", "4"),
                        ("--world-size", "2", "--zero", "3", "--engine", "deepspeed", "--precision", "bf16-mixed"))),
       st.sampled_from(((), ("--task", "inference", "--new-tokens", "4"), ("--gpu", "a100-80gb"))))
def test_technique_combinations(model, specs, parallel, extra):
    """Valid techniques in any combination: each runs through the estimator or is refused with its reason."""
    argv = ["estimate", model, "--method", "analytic", "--seq-len", "64", "--json", *parallel, *extra]
    assert_clean(*cli(*argv, *[x for spec in specs for x in ("-t", spec)]))


@settings(FUZZ, max_examples=max(3, EXAMPLES // 5))
@given(st.sampled_from(("tiny-llama", "tiny-bert", "tiny-gpt2", "tiny-qwen2")),
       st.lists(st.sampled_from(VALID_SPECS), max_size=3, unique=True),
       st.sampled_from(((), ("--world-size", "2"), ("--task", "inference", "--new-tokens", "4"), ("--gpu", "l4"),
                        ("--world-size", "2", "--gpu", "h100"))))
def test_traced_technique_combinations(model, specs, extra):
    """The same through the traced estimator (the real step on fake tensors), on tiny models."""
    argv = ["estimate", model, "--method", "traced", "--seq-len", "32", "--batch-size", "2", "--json", *extra]
    assert_clean(*cli(*argv, *[x for spec in specs for x in ("-t", spec)]))


plan_flags = st.lists(st.one_of(
    st.tuples(st.sampled_from(("--gpus", "--global-batch", "--batch-size", "--seq-len", "--new-tokens", "--top")),
              numbers),
    st.tuples(st.sampled_from(("--margin", "--max-ppl-increase")), st.sampled_from(
        ("5%", "0", "60%", "-1%", "nan", "inf", "x", "0.02", "2%%"))),
    st.tuples(st.just("--host-ram"), st.sampled_from(("0", "64GiB", "-5GiB", "1e400", "nan", "x", "1 TiB"))),
    st.tuples(st.sampled_from(("--allow", "--objective", "--task")), st.sampled_from(
        ("lossy", "lossless", "fastest", "smallest", "balanced", "inference", "train", "x"))),
), max_size=4)


@FUZZ
@given(st.sampled_from(("tiny-llama", "tiny-bert", "tiny-gpt2", "nope", "")), st.sampled_from(("t4", "l4", "x")),
       plan_flags)
def test_plan_arguments(model, gpu, pairs):
    argv = ["plan", model, "--gpu", gpu, "--json", "--seq-len", "64"] + [x for pair in pairs for x in pair]
    if "--gpus" in argv and argv[argv.index("--gpus") + 1] == "99999999999":
        return   # a planning run over 1e11 GPUs is valid input, not a bad one, and slow
    assert_clean(*cli(*argv))


@pytest.mark.parametrize("argv", [
    ["estimate", "tiny-llama", "--method", "traced", "--seq-len", "16", "-t", "checkpointing:blocks=("],
    ["estimate", "tiny-llama", "--method", "traced", "--seq-len", "16", "-t", "checkpointing:blocks=nothing"],
    ["estimate", "tiny-llama", "--method", "traced", "--seq-len", "16", "-t", "lora:targets=nothing"],
    ["estimate", "memfit.examples.convnet:build", "--seq-len", "16"],
    ["estimate", "memfit.examples.convnet:nothing", "--inputs", "memfit.examples.convnet:make_inputs"],
])
def test_traced_estimate_arguments(argv):
    assert_clean(*cli(*argv, "--json"))


serve_flags = st.lists(st.one_of(
    st.tuples(st.sampled_from(("--tensor-parallel", "--pipeline-parallel", "--data-parallel", "--max-model-len",
                               "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--chunked-prefill-size",
                               "--cuda-graph-max-bs", "--max-batch-prefill-tokens")), numbers),
    st.tuples(st.sampled_from(("--gpu-memory-utilization", "--mem-fraction-static", "--cpu-offload-gb",
                               "--cuda-memory-fraction")),
              st.sampled_from(("0.9", "0", "1", "1.5", "-0.1", "nan", "inf", "x", ""))),
    st.tuples(st.sampled_from(("--gpu-memory", "--kv-cache-memory", "--other-memory")),
              st.sampled_from(("24GiB", "0", "-5GiB", "1e400GiB", "nan", "x", "100MiB", "80GB"))),
    st.tuples(st.just("--engine-version"), st.sampled_from(("0.6.4", "0.21.0", "0.32.0", "9.9", "v0.8", "x", ""))),
    st.tuples(st.just("--kv-cache-dtype"), st.sampled_from(("auto", "fp8", "fp8_e5m2", "int4", ""))),
    st.tuples(st.just("--quantization"), st.sampled_from(("awq", "gptq", "fp8", "bitsandbytes", "mxfp4", "gguf", ""))),
    st.tuples(st.just("--gpu"), st.sampled_from(("t4", "h100", "l4", "h1000", ""))),
    st.tuples(st.just("--entrypoint"), st.sampled_from(("server", "offline", "x"))),
    st.tuples(st.sampled_from(("--input-len", "--output-len", "--max-concurrency", "--seed")), numbers),
    st.tuples(st.just("--num-prompts"), st.sampled_from(("1", "7", "0", "-3", "x", "99999999999"))),
    st.tuples(st.just("--request-rate"), st.sampled_from(("inf", "4", "0", "-1", "nan", "x"))),
    st.tuples(st.just("--dataset"), st.sampled_from(("random", "sharegpt", "x"))),
    st.tuples(st.just("--speculative-config"), st.sampled_from(('{"method": "eagle"}', ""))),
    st.tuples(st.just("--random-prefix-len"), st.sampled_from(("0", "64", "-1", "x"))),
    st.just(("--no-enable-prefix-caching",)),
), max_size=5)


@FUZZ
@given(st.sampled_from(("llama-3.1-8b", "deepseek-v3", "gemma-3-12b", "gpt-oss-20b", "qwen3-30b-a3b", "tiny-bert",
                        "memfit.examples.convnet:build", "")), st.sampled_from(("vllm", "sglang", "tgi", "x")),
       serve_flags)
def test_serve_arguments(model, engine, pairs):
    """`memfit estimate --task serve`: every engine setting, valid or not, is an estimate or one line and exit 2."""
    argv = ["estimate", model, "--task", "serve", "--engine", engine, "--json"] + [x for pair in pairs for x in pair]
    assert_clean(*cli(*argv))


serve_plan_flags = st.lists(st.one_of(
    st.tuples(st.sampled_from(("--max-model-len", "--concurrency", "--input-len", "--output-len", "--gpus", "--top")),
              numbers),
    st.tuples(st.sampled_from(("--max-ttft-ms", "--max-tpot-ms", "--min-output-tokens-per-s")),
              st.sampled_from(("50", "0", "-1", "nan", "x"))),
    st.tuples(st.just("--gpu"), st.sampled_from(("h100", "l4", "rtx-4090", "h1000", ""))),
    st.tuples(st.just("--instance"), st.sampled_from(("any", "g6.xlarge", "p5", "nope", ""))),
    st.tuples(st.just("--price"), st.sampled_from(("g6.xlarge=1.5", "g6.xlarge=-1", "x=1", "bad"))),
    st.tuples(st.just("--allow"), st.sampled_from(("lossy", "lossless", "x"))),
    st.tuples(st.just("--objective"), st.sampled_from(("cheapest", "fastest", "x"))),
    st.tuples(st.just("--export"), st.sampled_from(("vllm", "sglang", "kubernetes", "x"))),
), max_size=4)


@settings(FUZZ, max_examples=max(3, EXAMPLES // 3))
@given(st.sampled_from(("llama-3.1-8b", "qwen3-30b-a3b", "tiny-llama", "nope", "")),
       st.sampled_from(("vllm", "sglang", "tgi", "x")), serve_plan_flags)
def test_serve_plan_arguments(model, engine, pairs):
    """`memfit plan --task serve`: any load, machine and service level is a plan, a refusal, or one line and exit 2."""
    argv = ["plan", model, "--task", "serve", "--engine", engine, "--max-model-len", "4096", "--concurrency", "4",
            "--json"] + [x for pair in pairs for x in pair]
    assert_clean(*cli(*argv))


llamacpp_flags = st.lists(st.one_of(
    st.tuples(st.sampled_from(("-c", "-ngl", "-b", "-ub", "-np", "--gpus", "--n-cpu-moe")), numbers),
    st.tuples(st.sampled_from(("-ctk", "-ctv")), st.sampled_from(("f16", "q8_0", "q4_0", "bf16", "q9", ""))),
    st.tuples(st.just("-fa"), st.sampled_from(("on", "off", "auto", "yes", ""))),
    st.tuples(st.just("-ts"), st.sampled_from(("3,1", "1", "0,0", "1,,2", "-1,2", "x", ""))),
    st.tuples(st.just("--quant"), st.sampled_from(("Q4_K_M", "q8_0", "IQ2_XXS", "MXFP4_MOE", "Q9", ""))),
    st.tuples(st.just("--engine-version"), st.sampled_from(("2024-03-18", "2025-08", "2026-13", "b2459", ""))),
    st.sampled_from((("-kvu",), ("-nkvo",), ("-cmoe",))),
), max_size=5)


@settings(FUZZ, max_examples=max(3, EXAMPLES // 2))
@given(st.sampled_from(("llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma-3-12b", "tiny-llama",
                        "missing.gguf", "")), llamacpp_flags)
def test_llamacpp_arguments(model, pairs):
    """`memfit estimate --engine llama.cpp`: any model and llama.cpp setting is an estimate or one line, exit 2."""
    argv = ["estimate", model, "--task", "serve", "--engine", "llama.cpp", "--json"]
    assert_clean(*cli(*argv, *[x for pair in pairs for x in pair]))


@settings(FUZZ, max_examples=max(3, EXAMPLES // 4))
@given(st.sampled_from(("llama-3.2-1b", "qwen2.5-0.5b", "tiny-bert", "nope")),
       st.sampled_from(("rtx-3060", "t4", "h1000")), st.sampled_from(("32GiB", "1GiB", "0", "x")),
       st.sampled_from(("4096", "0", "-1", "x")), st.sampled_from(("quality", "fastest", "x")))
def test_llamacpp_plan_arguments(model, gpu, ram, ctx, objective):
    """`memfit plan --engine llama.cpp`: any machine and context is plans, a refusal, or one line and exit 2."""
    assert_clean(*cli("plan", model, "--engine", "llama.cpp", "--gpu", gpu, "--host-ram", ram, "-c", ctx,
                      "--objective", objective, "--json"))


SERVING_FAILURES = (
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
    "the engine.",
    "ValueError: The model's max seq len (29000) is larger than the maximum number of tokens that can be stored in KV "
    "cache (23648).",
    "ValueError: Free memory on device (10.5/23.58 GiB) on startup is less than desired GPU memory utilization (0.9, "
    "21.22 GiB).",
)


@FUZZ
@given(st.sampled_from(SERVING_FAILURES), st.integers(0, 200), st.text(max_size=12),
       st.sampled_from(("llama-3.1-8b", "tiny-llama", "nope", "")), serve_flags)
def test_serving_failures(tmp_path_factory, message, cut, noise, model, pairs):
    """`memfit explain-oom LOG --task serve`: a mangled log, any model and settings: fixes or one line, exit 2."""
    path = tmp_path_factory.mktemp("log") / "vllm.log"
    path.write_text(message[:cut] + noise + message[cut:])
    argv = ["explain-oom", str(path), "--task", "serve", "--engine", "vllm", "--model", model, "--json"]
    assert_clean(*cli(*argv, *[x for pair in pairs for x in pair]))
