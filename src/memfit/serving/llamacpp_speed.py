"""How fast llama.cpp generates and reads a prompt with a given split of a GGUF model between a GPU and the CPU.

Generating (decode): each token reads every weight once (a mixture of experts, only the experts it is routed to; the
token embedding, one row) and the KV cache of its context, each on the device that holds it. A device reads F16
weights at a share of its peak bandwidth, and each quantized type's kernel at a fraction of F16's (it dequantizes as
it reads). Both are calibrated on published llama-bench tables (benchmarks/published_llamabench.md), measured side by
side in one run each:
- DECODE_SHARE: F16 weights read at 0.68-0.82 of peak on GDDR cards (RTX 3090 and 4090 in January and May 2024,
  RTX A6000: rows L02, L07, L31, L37, L39; mean 0.77), at 0.41-0.51 on HBM ones (A100 80GB PCIe, H100 PCIe: L43,
  L48; llama.cpp's one-token kernels do not keep enough bytes in flight for HBM);
- TYPE_EFFICIENCY: Q8_0 0.86 (L04 beside L02), Q4_0 0.72 (L13 / L07), a Q4_K_M file 0.66-0.80 on five GPUs
  (mean 0.75: L29, L35, L38, L41, L46; its Q6_K tensors assumed as fast as its Q4_K ones), Q3_K 0.40 and Q2_K 0.37
  (L11, L09: January 2024 kernels). Types with no published row take their family's figure (assumed, marked so).
The host's share (HOST_SHARE) is assumed; the same type efficiencies are assumed for the CPU's kernels
(benchmarks/llamacpp_cpu_speed.py measures the ratios on this machine's 2 cores: they lose more there).

Reading a prompt: the ubatch's matrix products at MATMUL_SHARE of the GPU's FP16 tensor rate with FP16
accumulation (llama.cpp's: twice the FP32-accumulate rate the catalog lists for GeForce cards; on Hopper half its
peak, as llama.cpp's kernels use the Ampere-style instructions, not Hopper's own), a quantized weight's products
(llama.cpp's int8 MMQ kernels, dequantizing as they go) at QUANTIZED_PROMPT of that; plus, on a partial offload, the
CPU's weights copied over the host link once per ubatch (llama.cpp's op offload). Read off the same tables:
MATMUL_SHARE 0.40 (F16 rows on the RTX 3090 and 4090 in January and May 2024, A100 80GB PCIe, H100 PCIe: 0.35-0.44:
L01, L06, L30, L36, L42, L47), QUANTIZED_PROMPT 0.78 (quantized files against F16 on the same GPU and run: 0.69-0.91:
L03, L05, L08, L10, L12, L14, L28, L34, L40, L45).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memfit.serving.gguf_file import GGUFModel, GGUFTensor
    from memfit.serving.llamacpp import LlamaCppEstimate
    from memfit.specs.hardware import GPU

HOST_BANDWIDTH_GBPS = 50.0       # assumed default: dual-channel DDR4-3200 (51.2 GB/s peak)
DECODE_SHARE = {"gddr": 0.77, "hbm": 0.46}   # F16 weights' share of peak bandwidth generating (see above)
HOST_SHARE = 0.7                 # assumed: the host's share of its peak bandwidth generating
HBM_GPUS = ("a100", "h100", "h200", "gh200", "h20", "b200", "v100", "mi300")   # catalog names' prefixes
# the share of F16's read rate each ggml type's one-token kernel reaches (see above); Q4_1, Q5_0, Q5_1, IQ4_NL, Q5_K,
# IQ4_XS and MXFP4 have no published row: their family's figure (assumed)
TYPE_EFFICIENCY = {"F32": 1.0, "F16": 1.0, "BF16": 1.0, "Q8_0": 0.86, "Q4_0": 0.72, "Q4_1": 0.72,
                   "Q5_0": 0.72, "Q5_1": 0.72, "IQ4_NL": 0.72, "Q4_K": 0.75, "Q5_K": 0.75, "Q6_K": 0.75,
                   "IQ4_XS": 0.75, "MXFP4": 0.75, "Q3_K": 0.40, "Q2_K": 0.37}
MATMUL_SHARE = 0.40              # a prompt's share of the FP16-accumulate tensor rate (see above)
QUANTIZED_PROMPT = 0.78          # a quantized weight's products against a float one's
# the published rows (benchmarks/published_llamabench.md) the figures above were read off; the rest are held out
CALIBRATION_ROWS = ("L02", "L04", "L07", "L09", "L11", "L13", "L29", "L31", "L35", "L37", "L38", "L39", "L41", "L43",
                    "L46", "L48",   # generating
                    "L01", "L03", "L05", "L06", "L08", "L10", "L12", "L14", "L28", "L30", "L34", "L36", "L40", "L42",
                    "L45", "L47")   # reading a prompt


def fp16_tensor_rate(gpu: GPU) -> float:
    """FLOP/s of the FP16 tensor products llama.cpp runs: GeForce cards accumulate in FP16 at twice the rate the
    catalog lists (their FP32-accumulate one); Hopper runs llama.cpp's Ampere-style instructions at half its peak."""
    rate = gpu.fp16_tflops * 1e12
    if gpu.name.startswith(("rtx-30", "rtx-40", "rtx-50")):
        return 2 * rate
    return rate / 2 if gpu.compute_capability[0] == 9 else rate


def _used(tensor: GGUFTensor, gguf: GGUFModel) -> float:
    """The share of a weight a token uses: a mixture's experts, the n_expert_used it is routed to; else all."""
    if tensor.name == "token_embd.weight":
        return 1 / tensor.shape[1]
    return gguf.n_expert_used / gguf.n_expert if tensor.name.endswith("_exps.weight") else 1.0


def decode_seconds(estimate: LlamaCppEstimate, gguf: GGUFModel, gpu: GPU | None, host_bandwidth_gbps: float,
                   kv_share: float = 0.5) -> float:
    """One generated token's time: each weight it uses read at its device's rate for its type, and `kv_share` of
    the KV cache (the context it attends to: half of it on average over a generation). `gpu` None: the CPU alone."""
    rates = {"CPU": host_bandwidth_gbps * 1e9 * HOST_SHARE}
    if gpu is not None:   # each GPU reads its own layers, one after another (a layer split is a pipeline)
        memory = "hbm" if gpu.name.startswith(HBM_GPUS) else "gddr"
        rates |= {name: gpu.memory_bandwidth_gbps * 1e9 * DECODE_SHARE[memory] for name in estimate.buffers
                  if name != "CPU"}
    seconds = sum(kv_share * buffers.kv / rates[device] for device, buffers in estimate.buffers.items())
    for tensor in gguf.tensors:
        efficiency = TYPE_EFFICIENCY.get(tensor.type, min(TYPE_EFFICIENCY.values()))
        seconds += tensor.nbytes * _used(tensor, gguf) / (rates[estimate.placement[tensor.name]] * efficiency)
    return seconds


def speed(estimate: LlamaCppEstimate, gguf: GGUFModel, gpu: GPU, host_bandwidth_gbps: float) -> tuple[float, float]:
    """(tokens/s generating, tokens/s reading a prompt) with `gpu` holding what the estimate puts on it."""
    ubatch, rate = estimate.settings.n_ubatch, fp16_tensor_rate(gpu) * MATMUL_SHARE
    prompt = 0.0
    for tensor in gguf.tensors:
        if tensor.layer is not None and len(tensor.shape) > 1:
            flops = 2 * tensor.shape[0] * tensor.shape[1] * _used(tensor, gguf) * ubatch
            quantized = tensor.type not in ("F32", "F16", "BF16")
            prompt += flops / (rate * (QUANTIZED_PROMPT if quantized else 1.0))
        if estimate.placement[tensor.name] == "CPU" and tensor.name != "token_embd.weight":
            prompt += tensor.nbytes / (gpu.host_link_gbps * 1e9)   # op offload: across the host link
    return 1 / decode_seconds(estimate, gguf, gpu, host_bandwidth_gbps), ubatch / prompt
