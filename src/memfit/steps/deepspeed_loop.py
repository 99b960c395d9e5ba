"""`--engine deepspeed`: the training step run by DeepSpeed's engine (ZeRO stages 1-3, ZeRO-Offload).

DeepSpeed runs the model itself in half precision: `deepspeed.initialize` casts the module's weights
to bf16 (or fp16, with its dynamic loss scaler), keeps float32 master weights in the optimizer and
shards by `--zero` stage over the process group: 1 the master weights and Adam moments, 2 also the
gradients (reduced into each rank's partition through a bucket), 3 also the half-precision weights
(gathered per module as it runs). `-t cpu-offload` is ZeRO-Offload: master weights, moments and
float32 gradients in host RAM, stepped by DeepSpeed's CPU Adam; at stage 3 the weights' partitions too.
`-t nvme-offload` is ZeRO-Infinity: the same, with masters, moments and gradients swapped to files in
the setup's swap folder through DeepSpeed's async_io op (it needs libaio).
The optimizer is DeepSpeed's own AdamW (fused on the device, CPU Adam when offloaded).

The techniques that change the model (checkpointing, attention, sequence, loss) apply before the
engine wraps it; mixed precision, optimizer and sharding are DeepSpeed's.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import subprocess
import sys

import torch
from torch.utils.cpp_extension import get_default_build_root

from memfit.core.errors import MemfitError
from memfit.core.precision import get_precision
from memfit.steps.hooks import NullHooks, StepHooks, tensors_in
from memfit.steps.host import note_host
from memfit.steps.optim import default_lr
from memfit.steps.train import enter_phase


def deepspeed_config(workload, *, lr: float | None, offload: bool, swap_folder: str | None = None) -> dict:
    zero: dict = {"stage": workload.zero_stage, "reduce_bucket_size": workload.reduce_bucket}
    half = get_precision(workload.precision).autocast_dtype   # DeepSpeed casts the model to it
    if swap_folder:
        zero.update(nvme_offload_config(swap_folder, pin_memory=torch.cuda.is_available()))
    elif offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if workload.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": workload.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": half == torch.bfloat16},
        "fp16": {"enabled": half == torch.float16},
        "optimizer": {"type": "AdamW", "params": {"lr": default_lr("adamw") if lr is None else lr,
                                                  "weight_decay": 0.01}},   # torch.optim.AdamW's default
        "steps_per_print": 2**31 - 1,
    }


def nvme_offload_config(folder: str, *, pin_memory: bool) -> dict:
    """DeepSpeed's ZeRO-Infinity entries (stage 3): optimizer states and weights swapped to `folder`, the
    defaults of DeepSpeed 0.19 otherwise (4 optimizer and 5 weight swap buffers, max_in_cpu 1e9)."""
    return {"offload_optimizer": {"device": "nvme", "nvme_path": folder, "pin_memory": pin_memory},
            "offload_param": {"device": "nvme", "nvme_path": folder, "pin_memory": pin_memory}}


def folder_bytes(folder: str) -> int:
    """The bytes of the files under `folder` (what the swap wrote to the drive)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def build_deepspeed_ops(*, offload: bool, swaps: bool = False) -> None:
    """Compile, here and now, the C++ ops that DeepSpeed's engine compiles at its first use on CPU (its
    fused AdamW, or CPU Adam under offload, its shared-memory collectives, and async_io when it swaps to NVMe),
    so that the ranks started next only load them. Compiled inside the ranks, one rank builds while the other
    waits on a lock file, and a rank killed mid-build leaves that lock behind: every later build then waits on
    it for ever. A few minutes the first time; PyTorch keeps the builds under TORCH_EXTENSIONS_DIR."""
    unbuilt = unbuilt_deepspeed_ops(offload=offload, swaps=swaps)
    for builder in _op_builders(offload=offload, swaps=swaps):
        if builder.name in unbuilt:
            logging.getLogger(__name__).warning("memfit: compiling DeepSpeed's %s under %s (first use only, a few "
                                                "minutes)", builder.name, _extensions_root())
        try:
            builder.load(verbose=False)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:   # the compiler's own failure
            needs = "a C++ compiler, ninja" + (" and libaio (apt-get install libaio-dev)"
                                                if builder.name == "async_io" else "")
            raise MemfitError(f"DeepSpeed could not compile its {builder.name} op on this machine ({exc}); it "
                              f"needs {needs}.") from exc


def unbuilt_deepspeed_ops(*, offload: bool, swaps: bool = False) -> list[str]:
    """The ops `build_deepspeed_ops` would compile (not yet built under TORCH_EXTENSIONS_DIR or PyTorch's default
    root; async_io loads DeepSpeed's pin_memory op too)."""
    root = _extensions_root()
    names = [b.name for b in _op_builders(offload=offload, swaps=swaps)] + (["pin_memory"] if swaps else [])
    return [name for name in names if not glob.glob(os.path.join(root, "**", name, f"{name}.so"), recursive=True)]


def _extensions_root() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()   # PyTorch's: NAME or pyXY_cpu/NAME


def _op_builders(*, offload: bool, swaps: bool) -> list:
    """DeepSpeed's builders of the ops its engine loads on this CPU (none on another accelerator, which builds its
    own)."""
    accelerator = _import_deepspeed().accelerator.get_accelerator()
    if accelerator.device_name() != "cpu":
        return []
    names = ["CPUAdamBuilder" if offload else "FusedAdamBuilder", "ShareMemCommBuilder"]
    builders = []
    for name in names + (["AsyncIOBuilder"] if swaps else []):
        builder = accelerator.create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builders.append(builder)
        elif name == "AsyncIOBuilder":
            raise MemfitError("-t nvme-offload: DeepSpeed's async_io op needs libaio, which this machine lacks "
                              "(apt-get install libaio-dev).")
    return builders


def _import_deepspeed():
    try:
        with contextlib.redirect_stdout(sys.stderr):   # its import logs to the stdout it finds (--json's)
            import deepspeed
    except ImportError:
        raise MemfitError("--engine deepspeed needs DeepSpeed: pip install 'memfit[deepspeed]'.") from None
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


class DeepSpeedLoop:
    """TrainLoop's interface (`step(batch)` -> loss) over a DeepSpeed engine built from `setup` (the
    techniques applied to the model) and the workload's precision, --zero stage and offload."""

    def __init__(self, setup, workload, *, hooks: StepHooks | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise MemfitError("--engine deepspeed needs a process group: run under torchrun (or `memfit measure "
                              "--world-size N`, which starts one).")
        deepspeed = _import_deepspeed()
        self.setup, self.hooks = setup, hooks or NullHooks()
        self.offload, self.stage = setup.host_optimizer is not None, workload.zero_stage
        self.swap_folder = setup.swap_folder
        config = deepspeed_config(workload, lr=setup.lr, offload=self.offload, swap_folder=self.swap_folder)
        params = [p for p in setup.model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=setup.model, model_parameters=params,
                                                                 config=config)
        setup_buckets = getattr(self.optimizer, "setup_buckets", None)
        if setup_buckets is not None:   # ZeRO-1/2 allocate their reduction buckets at the first gradient

            def marked_setup_buckets() -> None:
                setup_buckets()
                self.hooks.mark("gradients", self._buckets())

            self.optimizer.setup_buckets = marked_setup_buckets

    @property
    def skipped_steps(self) -> int:
        """fp16: steps DeepSpeed's loss scaler skipped on overflow."""
        return self.engine.skipped_steps

    def parameter_tensors(self) -> list[torch.Tensor]:
        """The half-precision weights (at stage 3 each parameter's partition, `ds_tensor`)."""
        return [getattr(p, "ds_tensor", p) for p in self.engine.module.parameters()]

    def step(self, batch) -> torch.Tensor:
        setup = self.setup
        (batch,) = setup.prepare_batch(batch)     # windows of a sequence are refused (its deepspeed_conflict)
        self._phase("forward")
        loss = setup.loss(self.engine, batch)
        self._phase("backward")
        self.engine.backward(loss)
        total = loss.detach()
        del loss
        self._phase("optimizer")
        if self.swap_folder:   # the gradient partitions too small to swap wait for the step in host RAM
            note_host([t for info in getattr(self._optimizer_swapper, "swap_params_info", {}).values()
                       for t in info.unswapped_gradients.values()])
        self.engine.step()
        self._mark_states()
        return total

    def _phase(self, name: str) -> None:
        enter_phase(self.setup, self.hooks, name)

    def _buckets(self) -> list[torch.Tensor]:
        return [t for bucket in getattr(self.optimizer, "ipg_buckets", {}).values() for t in tensors_in(bucket)]

    def _mark_states(self) -> None:
        """Name DeepSpeed's buffers for the tracker: the gradient partitions (stage 3: and bucket), the
        float32 master partitions and the moments; with offload the ones DeepSpeed keeps in host RAM."""
        zero = self.optimizer
        masters = [t for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
                   for t in tensors_in(getattr(zero, name, None))]
        inner = getattr(zero, "optimizer", zero)
        states = masters + [t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        partitions = [m.grad for m in masters if m.grad is not None] + tensors_in(
            [getattr(zero, name, None) for name in ("averaged_gradients", "grads_in_partition")])
        flat = tensors_in(getattr(zero, "grad_partitions_flat_buffer", None))
        self.hooks.mark("gradients", self._buckets() + partitions + flat)
        self.hooks.mark("optimizer_states", states)
        if self.offload:
            note_host(states + partitions + (flat + self.parameter_tensors() if self.stage == 3 else [])
                      + self._swap_buffers())

    def _swap_buffers(self) -> list[torch.Tensor]:
        """NVMe offload: the host buffers DeepSpeed's swappers read into and write from (the optimizer's, and
        the weights' shared by every parameter)."""
        if not self.swap_folder:
            return []
        buffers = list(getattr(getattr(self._optimizer_swapper, "swap_buffer_manager", None), "all_buffers", []))
        weights = {id(s): s for p in self.engine.module.parameters() if (s := getattr(p, "nvme_swapper", None))}
        return buffers + [s.buffers for s in weights.values()]

    @property
    def _optimizer_swapper(self):
        """NVMe offload: ZeRO-3's swapper of the optimizer's states (None without one)."""
        return getattr(self.optimizer, "optimizer_swapper", None)
