import http.server
import json
import threading

import huggingface_hub.constants
import pytest
import torch

from memfit.core.errors import MemfitError
from memfit.core.units import GiB, MiB, format_bytes, parse_bytes
from memfit.estimators.analytic import count_parameters
from memfit.estimators.analytic.families import registry
from memfit.specs.hardware import get_gpu, gpu_catalog
from memfit.specs.model_source import catalog, resolve_source
from memfit.techniques.resolve import ResolvedWorkload

REQUIRED_MODELS = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b", "bert-base-uncased",
                   "bert-large-uncased", "t5-base", "vit-base-patch16-224", "llama-2-7b", "llama-2-13b",
                   "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "mistral-7b", "mixtral-8x7b",
                   "qwen2.5-7b", "qwen2.5-72b", "gemma-2-9b", "phi-3-mini", "tiny-llama", "tiny-gpt2", "tiny-bert",
                   "tiny-t5", "tiny-mixtral"]
# the models of 2025-26 (issue 39), each with its exact published count
REQUIRED_2025_MODELS = ["llama-3.2-1b", "llama-3.2-3b", "llama-3.3-70b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b",
                        "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "gemma-3-1b",
                        "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b",
                        "mistral-small-24b", "phi-4", "olmo-2-7b", "olmo-2-13b"]
# bundled before the catalog said where each count was published (their references are the model's own hub page)
PUBLISHED_BEFORE_SOURCES = {name for name, doc in catalog().items() if name not in REQUIRED_2025_MODELS}
REQUIRED_GPUS = ["h100-sxm-80gb", "h100-pcie-80gb", "h200-141gb", "a100-40gb", "a100-80gb", "l40s", "l4", "a10g",
                 "rtx-4090", "rtx-3090", "t4", "v100-16gb", "v100-32gb", "mi300x"]


def test_units():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * GiB) == "3.00 GiB"
    assert parse_bytes("24GiB") == 24 * GiB and parse_bytes("512 MiB") == 512 * MiB
    assert parse_bytes("80GB") == 80 * 10**9
    with pytest.raises(MemfitError):
        parse_bytes("lots")


def test_catalog_has_the_required_models():
    assert set(REQUIRED_MODELS) | set(REQUIRED_2025_MODELS) <= set(catalog())
    assert all(catalog()[name]["published_num_parameters"] for name in REQUIRED_2025_MODELS)


@pytest.mark.parametrize("name", [n for n, d in catalog().items() if d.get("published_num_parameters")])
def test_parameter_counts_equal_the_published_models(name):
    """Built on the meta device from the bundled config, the model has the real checkpoint's count; where the
    checkpoint holds more than the bundled model builds (Gemma 3's vision tower, DeepSeek-V3's multi-token prediction
    layer and fp8 scales), the catalog names each part with its count."""
    source, doc = resolve_source(name), catalog()[name]
    model = source.build(device="meta", dtype=torch.float32)
    built = sum(p.numel() for p in model.parameters())
    assert built + sum(doc.get("published_includes", {}).values()) == doc["published_num_parameters"]
    assert doc.get("published_source") or name in PUBLISHED_BEFORE_SOURCES


@pytest.mark.parametrize("name", [n for n in catalog() if registry.has_family(resolve_source(n))])
def test_analytic_parameter_count_equals_the_built_model(name):
    source = resolve_source(name)
    model = source.build(device="meta", dtype=torch.float32)
    seq = source.image_size if source.head == "image-classification" else 8
    assert count_parameters(ResolvedWorkload(model=name, seq_len=seq)) == sum(p.numel() for p in model.parameters())


def test_gpu_catalog():
    assert set(REQUIRED_GPUS) <= set(gpu_catalog())
    assert get_gpu("H100").name == "h100-sxm-80gb"
    assert get_gpu("4090").memory_bytes == round(23.65 * 2**30)   # as CUDA reports it, not nvidia-smi's 24564 MiB
    assert get_gpu("a100-40gb").memory_bytes == 42298834944            # deviceQuery's bytes
    for gpu in gpu_catalog().values():   # every figure says where it comes from
        assert gpu.memory_source and gpu.rates_source, gpu.name
    with pytest.raises(MemfitError, match=r"a100-40gb .* or a100-80gb"):
        get_gpu("a100")   # an alias never picks one memory size over another
    assert get_gpu("t4").bf16_tflops is None
    with pytest.raises(MemfitError, match="h100"):
        get_gpu("h1000")


def test_a_bundled_model_is_found_by_its_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_source("meta-llama/Llama-3.1-8B").name == "llama-3.1-8b"
    assert resolve_source("META-LLAMA/llama-3.1-8b").name == "llama-3.1-8b"
    with pytest.raises(MemfitError, match=r"Did you mean: .*Qwen/Qwen2\.5"):
        resolve_source("Qwen/Qwen9-77B")   # not bundled, and not cached
    # a post-trained variant resolves to its bundled base model's shapes, and says so
    for variant, base in (("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
                          ("google/gemma-3-27b-it", "gemma-3-27b"), ("Qwen/Qwen3-8B-Base", "qwen3-8b"),
                          ("mistralai/Mistral-Small-24B-Instruct-2501", "mistral-small-24b")):
        source = resolve_source(variant)
        assert source.name == base and variant in source.note
    assert resolve_source("Qwen/Qwen3-8B").note is None


class _StandInHub(http.server.BaseHTTPRequestHandler):
    """The two requests huggingface_hub makes for a file: HEAD for its metadata, then GET."""
    files: dict = {}

    def _answer(self, body_too: bool):
        body = self.files.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        for key, value in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                           ("ETag", '"stand-in"'), ("X-Repo-Commit", "0" * 40)):
            self.send_header(key, value)
        self.end_headers()
        if body_too:
            self.wfile.write(body)

    def do_HEAD(self):
        self._answer(False)

    def do_GET(self):
        self._answer(True)

    def log_message(self, *args):
        pass


def test_a_hub_id_fetches_its_config_once_then_works_offline(tmp_path, monkeypatch):
    config = catalog()["tiny-llama"]["hf_config"]
    _StandInHub.files = {"/someone/tiny-thing/resolve/main/config.json": json.dumps(config).encode()}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandInHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)   # read when huggingface_hub loaded
    try:
        assert resolve_source("someone/tiny-thing").hf_config == config
    finally:
        server.shutdown()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_source("someone/tiny-thing").hf_config == config   # from the cache
    with pytest.raises(MemfitError, match=r"offline .* not cached by an earlier run"):
        resolve_source("someone/never-fetched")
