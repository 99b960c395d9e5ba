"""Real llama.cpp runs here: tiny GGUF models of several architectures, written with the gguf package, quantized by
llama.cpp's own quantizer and loaded by llama.cpp (llama-cpp-python's build, CPU) at several context sizes,
ubatches, KV cache types, flash-attention settings and slot counts; what llama.cpp's load log reports for each
buffer, recorded with each quantized file's tensor table.

    bash scripts/setup_llamacpp.sh                                   # once: ./.venv-llama (about 5 minutes)
    .venv-llama/bin/python benchmarks/llamacpp_cpu_run.py --record   # -> benchmarks/results/llamacpp_cpu_run.json
    python benchmarks/llamacpp_cpu_check.py                          # memfit's buffers against the record

The record is what tests/test_llamacpp.py compares memfit with; with ./.venv-llama present, the tests also load a
few of the cases again (this script's --case) and compare with the live run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "llamacpp_cpu_run.json")

# the architectures written (llama.cpp's names and hyperparameters; tensor shapes follow from them)
MODELS = {
    "gqa": dict(arch="llama", n_embd=256, n_layer=4, n_head=8, n_head_kv=2, n_ff=512, n_vocab=1000),
    "mha": dict(arch="llama", n_embd=256, n_layer=3, n_head=4, n_head_kv=4, n_ff=768, n_vocab=1200),
    "tied": dict(arch="llama", n_embd=256, n_layer=2, n_head=4, n_head_kv=1, n_ff=512, n_vocab=800, tied=True),
    "qwen2": dict(arch="qwen2", n_embd=256, n_layer=3, n_head=8, n_head_kv=2, n_ff=512, n_vocab=1500, tied=True),
    "qwen3": dict(arch="qwen3", n_embd=256, n_layer=3, n_head=4, n_head_kv=2, n_ff=512, n_vocab=900, tied=True),
    # 16 layers: the recipe's more-bits layers (first and last eighth, every third between); an FFN of 320, whose
    # rows do not split into the K types' 256-blocks (their fallbacks)
    "deep": dict(arch="llama", n_embd=256, n_layer=16, n_head=4, n_head_kv=1, n_ff=320, n_vocab=512),
    # heads of 128: a quantized cache stores them rotated by 128 x 128 matrices (K) and 64 x 64 ones (V)
    "head128": dict(arch="llama", n_embd=256, n_layer=2, n_head=2, n_head_kv=1, n_ff=512, n_vocab=700),
    # Gemma 3: heads of 128 beside an embedding of 256, five sliding-window layers (window 256) in six
    "gemma3": dict(arch="gemma3", n_embd=256, n_layer=7, n_head=4, n_head_kv=2, n_ff=512, n_vocab=900, tied=True,
                   head_dim=128, n_swa=256),
    # Gemma 2: heads of 128, every other layer over a window of 256, its attention's and output's logits soft-capped
    "gemma2": dict(arch="gemma2", n_embd=256, n_layer=6, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1100, tied=True,
                   head_dim=128, n_swa=256),
    # gpt-oss: every other layer over a window of 128, attention sinks, biases everywhere, 8 experts, 2 a token
    "gptoss": dict(arch="gpt-oss", n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=256, n_vocab=900, head_dim=64,
                   n_swa=128, n_expert=8, n_expert_used=2, n_ff_exp=256),
    # mixtures of experts: Mixtral's 8 experts, 2 a token (llama.cpp's llama graph), Qwen3-MoE's many (qwen3moe)
    "mixtral": dict(arch="llama", n_embd=256, n_layer=3, n_head=8, n_head_kv=2, n_ff=512, n_vocab=1000, n_expert=8,
                    n_expert_used=2),
    "qwen3moe": dict(arch="qwen3moe", n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=768, n_vocab=900, tied=True,
                     n_expert=16, n_expert_used=4, n_ff_exp=256),
}
# (model, quantization, settings): each a load; the settings are llama.cpp's context parameters
CASES = [
    ("gqa", "F32", dict(n_ctx=1000)),
    ("gqa", "F16", dict(n_ctx=1000)),
    ("gqa", "Q8_0", dict(n_ctx=256)),
    ("gqa", "Q4_K_M", dict(n_ctx=4096)),
    ("gqa", "Q4_K_M", dict(n_ctx=4096, n_ubatch=128, n_batch=256)),
    ("gqa", "Q4_K_M", dict(n_ctx=4096, flash_attn="on")),
    ("gqa", "Q4_K_M", dict(n_ctx=4096, flash_attn="on", type_k="q8_0", type_v="q8_0")),
    ("gqa", "Q4_K_M", dict(n_ctx=3000, flash_attn="on", type_k="q4_0", type_v="q4_0")),
    ("gqa", "Q4_K_M", dict(n_ctx=4096, n_seq_max=4)),
    ("gqa", "Q4_K_M", dict(n_ctx=4096, n_seq_max=4, kv_unified=True, flash_attn="auto")),
    ("gqa", "Q4_0", dict(n_ctx=2048, n_ubatch=256)),
    ("gqa", "Q6_K", dict(n_ctx=512)),
    ("mha", "Q5_K_M", dict(n_ctx=2048)),
    ("mha", "Q4_K_S", dict(n_ctx=2048, flash_attn="on")),
    ("mha", "Q3_K_M", dict(n_ctx=700, n_ubatch=64)),
    ("tied", "Q4_K_M", dict(n_ctx=1024)),
    ("tied", "IQ4_XS", dict(n_ctx=1024)),
    ("qwen2", "Q4_K_M", dict(n_ctx=2048)),
    ("qwen2", "Q8_0", dict(n_ctx=2048, flash_attn="on", n_seq_max=2)),
    ("qwen3", "Q4_K_M", dict(n_ctx=2048)),
    ("qwen3", "Q6_K", dict(n_ctx=1024, flash_attn="on")),
] + [("deep", quant, dict(n_ctx=512)) for quant in ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q3_K_L", "Q3_K_S", "Q2_K",
                                                     "Q4_K_S", "Q5_K_S", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")]
CASES += [
    ("head128", "Q4_K_M", dict(n_ctx=2048, flash_attn="on", type_k="q4_0", type_v="q4_0")),
    ("head128", "Q4_K_M", dict(n_ctx=2048, flash_attn="off", type_k="q8_0")),
    ("gemma3", "Q4_K_M", dict(n_ctx=2048)),
    ("gemma3", "Q8_0", dict(n_ctx=4096, flash_attn="on", n_ubatch=256)),
    ("gemma3", "Q4_K_M", dict(n_ctx=4096, n_seq_max=4, kv_unified=True, flash_attn="on")),
    ("gemma3", "Q6_K", dict(n_ctx=4096, n_seq_max=2, flash_attn="on", type_k="q8_0", type_v="q8_0")),
    ("gemma3", "Q4_0", dict(n_ctx=640)),
    ("gemma3", "Q4_K_M", dict(n_ctx=2048, swa_full=True)),
    ("gemma2", "Q4_K_M", dict(n_ctx=2048)),
    ("gemma2", "Q8_0", dict(n_ctx=4096, flash_attn="on", n_seq_max=2)),
    ("gemma2", "Q6_K", dict(n_ctx=4096, flash_attn="on", type_k="q8_0", type_v="q8_0", n_ubatch=256)),
    ("gptoss", "MXFP4_MOE", dict(n_ctx=2048)),
    ("gptoss", "MXFP4_MOE", dict(n_ctx=4096, flash_attn="on", n_ubatch=256)),
    ("gptoss", "Q8_0", dict(n_ctx=4096, n_seq_max=4, kv_unified=True, flash_attn="on")),
    ("gptoss", "Q4_K_M", dict(n_ctx=2048, n_seq_max=2, flash_attn="on", type_k="q8_0", type_v="q8_0")),
    ("mixtral", "Q4_K_M", dict(n_ctx=2048)),
    ("mixtral", "Q2_K", dict(n_ctx=1024, n_ubatch=128)),
    ("mixtral", "Q8_0", dict(n_ctx=2048, flash_attn="on", n_seq_max=2)),
    ("mixtral", "MXFP4_MOE", dict(n_ctx=512)),
    ("qwen3moe", "Q4_K_M", dict(n_ctx=2048)),
    ("qwen3moe", "Q6_K", dict(n_ctx=4096, flash_attn="on", type_k="q8_0", type_v="q8_0")),
    ("qwen3moe", "IQ4_XS", dict(n_ctx=1024, n_ubatch=256, n_batch=256)),
]


def write_gguf(path: str, arch: str, n_embd: int, n_layer: int, n_head: int, n_head_kv: int, n_ff: int,
               n_vocab: int, tied: bool = False, n_expert: int = 0, n_expert_used: int = 0, n_ff_exp: int = 0,
               head_dim: int = 0, n_swa: int = 0, n_ctx_train: int = 4096) -> None:
    """A float32 model with llama.cpp's tensor names for `arch` (random weights: only the sizes matter); with
    `n_expert`, each layer's FFN a mixture of experts (the router and 3-D expert tensors, as the converter writes);
    Gemma 2's and 3's with their post-norms and, with `n_swa`, sliding-window layers (every other one; five in six)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    head_dim = head_dim or n_embd // n_head
    writer.add_rope_dimension_count(head_dim)
    if head_dim != n_embd // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if n_swa:
        writer.add_sliding_window(n_swa)
    if arch == "gemma2":   # the converter writes Gemma 2's soft caps
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("no_vocab")
    writer.add_file_type(0)
    if n_expert:
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(n_expert_used)
        if n_ff_exp:
            writer.add_expert_feed_forward_length(n_ff_exp)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:   # numpy order: (rows, columns)
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", n_vocab, n_embd)
    tensor("output_norm.weight", n_embd)
    if not tied:
        tensor("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        tensor(f"blk.{i}.attn_norm.weight", n_embd)
        tensor(f"blk.{i}.attn_q.weight", n_head * head_dim, n_embd)
        tensor(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        tensor(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        if arch.startswith(("qwen3", "gemma3")):   # RMS norms on each head's Q and K
            tensor(f"blk.{i}.attn_q_norm.weight", head_dim)
            tensor(f"blk.{i}.attn_k_norm.weight", head_dim)
        if arch in ("qwen2", "gpt-oss"):
            tensor(f"blk.{i}.attn_q.bias", n_head * head_dim)
            tensor(f"blk.{i}.attn_k.bias", n_head_kv * head_dim)
            tensor(f"blk.{i}.attn_v.bias", n_head_kv * head_dim)
        tensor(f"blk.{i}.attn_output.weight", n_embd, n_head * head_dim)
        if arch == "gpt-oss":   # the output projection's bias, each head's attention sink, the FFN's norm
            tensor(f"blk.{i}.attn_output.bias", n_embd)
            tensor(f"blk.{i}.attn_sinks.weight", n_head)
            tensor(f"blk.{i}.post_attention_norm.weight", n_embd)
        if arch in ("gemma2", "gemma3"):   # RMS norms after the attention and after the FFN
            tensor(f"blk.{i}.post_attention_norm.weight", n_embd)
            tensor(f"blk.{i}.post_ffw_norm.weight", n_embd)
        if arch != "gpt-oss":
            tensor(f"blk.{i}.ffn_norm.weight", n_embd)
        if n_expert:
            width = n_ff_exp or n_ff
            tensor(f"blk.{i}.ffn_gate_inp.weight", n_expert, n_embd)
            tensor(f"blk.{i}.ffn_gate_exps.weight", n_expert, width, n_embd)
            tensor(f"blk.{i}.ffn_up_exps.weight", n_expert, width, n_embd)
            tensor(f"blk.{i}.ffn_down_exps.weight", n_expert, n_embd, width)
            if arch == "gpt-oss":   # every expert's biases, and the router's
                tensor(f"blk.{i}.ffn_gate_inp.bias", n_expert)
                tensor(f"blk.{i}.ffn_gate_exps.bias", n_expert, width)
                tensor(f"blk.{i}.ffn_up_exps.bias", n_expert, width)
                tensor(f"blk.{i}.ffn_down_exps.bias", n_expert, n_embd)
            continue
        tensor(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(source: str, target: str, quant: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}" if quant != "F32" else "LLAMA_FTYPE_ALL_F32")
    params.nthread = 1
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to {quant}")


def tensor_table(path: str) -> list[list]:
    """Each tensor of a GGUF file: [name, type, shape (ggml order: columns first)]."""
    import gguf

    reader = gguf.GGUFReader(path)
    return [[t.name, t.tensor_type.name, [int(n) for n in t.shape]] for t in reader.tensors]


# what each load reports: llama.cpp's log lines (MiB with 2 decimals; the compute buffer again with 4 at exit)
PATTERNS = {
    "model_buffers_mib": re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB"),
    "kv_buffers_mib": re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size =\s+([\d.]+) MiB"),
    "output_buffers_mib": re.compile(r"llama_context:\s+(\S+)\s+output buffer size =\s+([\d.]+) MiB"),
    "compute_buffers_mib": re.compile(r"~llama_context:\s+(\S+) compute buffer size is\s+([\d.]+) MiB"),
}
KV_SIZE = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s+(\d+) layers,\s+(\d+)/(\d+) seqs\), "
                     r"K \((\w+)\):\s+([\d.]+) MiB, V \((\w+)\):\s+([\d.]+) MiB")


def load(path: str, settings: dict, resident: bool = False) -> dict:
    """Load `path` with `settings` (llama.cpp's context parameters) in this process, through llama.cpp's own C API;
    run in a child, so that its log is this load's alone. `resident`: also how much the process's resident size grew
    by the load and by decoding ubatches until the context is full (every weight read, the cache written, the last
    ubatch's graph against the whole cache)."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    before = resident_bytes()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = settings["n_ctx"]
    params.n_batch = settings.get("n_batch", 2048)
    params.n_ubatch = settings.get("n_ubatch", 512)
    params.n_seq_max = settings.get("n_seq_max", 1)
    params.kv_unified = settings.get("kv_unified", False)
    params.swa_full = settings.get("swa_full", False)   # llama-server's default (the C API's is a full-size cache)
    params.n_threads = params.n_threads_batch = 1
    params.flash_attn_type = {"on": 1, "off": 0, "auto": -1}[settings.get("flash_attn", "off")]
    for key in ("type_k", "type_v"):
        if key in settings:
            setattr(params, key, getattr(llama_cpp, f"GGML_TYPE_{settings[key].upper()}"))
    context = llama_cpp.llama_init_from_model(model, params)
    if not context:
        raise SystemExit("llama.cpp could not create the context")
    size = int(llama_cpp.llama_model_size(model))
    if not resident:
        llama_cpp.llama_free(context)
        llama_cpp.llama_model_free(model)
        return {"model_size_bytes": size}
    n_tokens = min(params.n_ubatch, params.n_batch, params.n_ctx)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    for start in range(0, params.n_ctx, n_tokens):   # ubatches until the context is full: the last reads it all
        n = min(n_tokens, params.n_ctx - start)
        tokens = (llama_cpp.llama_token * n)(*[(start + i) % n_vocab for i in range(n)])
        if llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(tokens, n)) != 0:
            raise SystemExit("llama.cpp could not decode a ubatch")
    grown = resident_bytes() - before
    llama_cpp.llama_free(context)
    llama_cpp.llama_model_free(model)
    return {"model_size_bytes": size, "resident_growth_bytes": grown}


def resident_bytes() -> int:
    """This process's resident set (VmRSS), in bytes."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def parse(log: str) -> dict:
    out: dict = {key: {} for key in PATTERNS}
    for key, pattern in PATTERNS.items():
        for name, mib in pattern.findall(log):
            out[key][name] = out[key].get(name, 0.0) + float(mib)
    caches = [{"mib": float(m[1]), "cells": int(m[2]), "layers": int(m[3]), "seqs": int(m[5]), "type_k": m[6],
               "k_mib": float(m[7]), "type_v": m[8], "v_mib": float(m[9])} for m in KV_SIZE.finditer(log)]
    if caches:   # a sliding-window model's second cache: the window's
        out["kv"] = {**caches[0], **({"swa": caches[1]} if len(caches) > 1 else {})}
    return out


def run_case(folder: str, model: str, quant: str, settings: dict, *, resident: bool = False,
             models: dict | None = None) -> dict:
    """Load `model` (one of `models`, by default MODELS) as llama.cpp's quantizer writes it in `quant`, in a child
    process: its log's buffers, and with `resident` its resident size's growth."""
    hparams = (models or MODELS)[model]
    source = os.path.join(folder, f"{model}-F32.gguf")
    if not os.path.exists(source):
        write_gguf(source, **hparams)
    path = os.path.join(folder, f"{model}-{quant}.gguf")
    if not os.path.exists(path):
        quantize(source, path, quant)
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--load", path, json.dumps(settings),
                            *(["--resident"] if resident else [])], capture_output=True, text=True, timeout=600)
    if child.returncode != 0:
        raise SystemExit(f"llama.cpp failed to load {path} with {settings}:\n{child.stderr[-3000:]}")
    return {"model": model, "quant": quant, "settings": settings, "hparams": hparams, "cpu_avx512": cpu_avx512(),
            "tensors": tensor_table(path), **json.loads(child.stdout.strip().splitlines()[-1]),
            **parse(child.stderr)}


def cpu_avx512() -> bool:
    """Whether this CPU has AVX-512 (ggml then repacks Q2_K weights too)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return " avx512f" in fh.read()
    except OSError:
        return False


def compact(result: dict) -> dict:
    """The record as written: each quantized file's tensor table once (under "files", a tensor a line: "name TYPE
    256x1000"), each load naming its file."""
    files: dict[str, list[str]] = {}
    runs = []
    for run in result["runs"]:
        name = f"{run['model']}-{run['quant']}"
        files[name] = [f"{tensor} {kind} {'x'.join(map(str, shape))}" for tensor, kind, shape in run["tensors"]]
        runs.append({**{k: v for k, v in run.items() if k != "tensors"}, "file": name})
    return {**result, "files": files, "runs": runs}


def expand(record: dict) -> list[dict]:
    """The record's loads, each with its file's tensor table ([name, type, shape])."""
    tables = {name: [[t, kind, [int(n) for n in shape.split("x")]]
                     for t, kind, shape in (line.split() for line in rows)] for name, rows in record["files"].items()}
    return [{**run, "tensors": tables[run["file"]]} for run in record["runs"]]


def record(cases: list) -> list[dict]:
    import llama_cpp

    with tempfile.TemporaryDirectory(prefix="memfit-llamacpp-") as folder:
        runs = []
        for i, (model, quant, settings) in enumerate(cases):
            print(f"[{i + 1}/{len(cases)}] {model} {quant} {settings}", file=sys.stderr, flush=True)
            runs.append(run_case(folder, model, quant, settings))
    return [{"llama_cpp_python": llama_cpp.__version__, "runs": runs}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help=f"run every case and write {RESULT}")
    parser.add_argument("--case", type=int, action="append", help="run these cases (indices) and print them")
    parser.add_argument("--load", nargs=2, metavar=("GGUF", "SETTINGS"), help=argparse.SUPPRESS)
    parser.add_argument("--resident", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(json.dumps(load(args.load[0], json.loads(args.load[1]), args.resident)))
        return
    if args.record:
        (result,) = record(CASES)
        with open(RESULT, "w") as fh:
            json.dump(compact(result), fh, indent=1)
            fh.write("\n")
        print(f"wrote {RESULT}: {len(result['runs'])} loads")
        return
    chosen = [CASES[i] for i in (args.case or range(len(CASES)))]
    print(json.dumps(record(chosen)[0], indent=1))


if __name__ == "__main__":
    main()
