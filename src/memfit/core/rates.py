"""The shares of a GPU's data-sheet figures that kernels reach, shared by the step-time models (the planner's cost
model for training and batch inference, serving's engine-step model): each labelled with where it comes from."""
from __future__ import annotations

HBM_EFFICIENCY = 0.75      # fraction of the data-sheet memory bandwidth streaming kernels reach (assumed)
LINK_EFFICIENCY = 0.8      # fraction of the data-sheet link bandwidth collectives and copies reach (assumed)
# large bf16/fp16 matmuls' share of the data-sheet peak: calibrated on Liger-Kernel's A100 benchmark of a Llama MLP
# (published_gpu_throughput.md liger-mlp: 4 x 8192 tokens, 36.3 ms, 0.84 of 312 TFLOP/s less its SiLU's bytes);
# cuBLAS's own large-GEMM figures lie at 0.75-0.85 on A100 and H100
MATMUL_MFU = 0.80


def attention_share(capability: tuple[int, int]) -> float:
    """The fused attention kernels' share of the peak, by generation: FlashAttention-2's published figures (Dao 2023:
    up to 0.72 on A100, 0.65 taken; Shah et al. 2024, FlashAttention-3: 0.35 on H100), which PyTorch's flash backend
    and the serving engines' prefill kernels are."""
    return 0.35 if tuple(capability) >= (9, 0) else 0.65


def experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """The fraction of a mixture's experts one forward over `tokens` tokens reads: each token choosing top_k of
    `experts`, 1 - (1 - top_k / experts) ** tokens of them per layer on average (a decode step of a small batch reads a
    few; a prefill, all)."""
    if not experts:
        return 1.0
    return 1 - (1 - top_k / experts) ** tokens
