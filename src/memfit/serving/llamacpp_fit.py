"""llama.cpp's --fit (on by default): the context size and the layers on each GPU it chooses so that each GPU keeps
--fit-target free, replayed step by step as common/fit.cpp (common_params_fit_impl, the release llama-cpp-python
0.3.36 vendors) takes them, with memfit's buffers standing in for its dry-run loads:

1. measure the settings given (an unset context: the training context x the streams); nothing changes where every
   device keeps its target free (the CPU alone: the host's total RAM);
2. an unset context shrinks: interpolated linearly between the measurements at the largest and at --fit-ctx (4096),
   rounded down to 256 cells a stream; on one GPU that ends it;
3. unless -ngl, --tensor-split or a tensor override was given, each GPU from the last takes the most whole layers
   that fit (the method of false position over the layer count); a mixture of experts fills the layers with their
   experts on the CPU first (the rest of every partial layer, its first one's by --override-tensor);
4. a mixture whose dense weights all fit then turns those partial layers whole, front to back, and tries to fit part
   of one more layer (its attention with the FFN's up, or gate, or neither).

Where it fails, llama.cpp loads with what it had set by then (a context already shrunk stays shrunk).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from memfit.core.errors import MemfitError
from memfit.core.units import MiB
from memfit.serving.gguf_file import GGUFModel
from memfit.serving.llamacpp import LlamaCppSettings, estimate_llamacpp

FIT_TARGET = 1024 * MiB   # --fit-target: what each device keeps free
FIT_CTX = 4096            # --fit-ctx: the least context --fit sets
UINT32 = 2**32

# the tensors of layer {il} a partial layer sends elsewhere, by how much of the layer stays (fit.cpp's
# common_layer_fraction_t and get_overflow_pattern)
OVERFLOW = {
    "attn": r"blk\.{il}\.ffn_(gate|up|gate_up|down).*",   # the attention stays
    "up": r"blk\.{il}\.ffn_(gate|gate_up|down).*",        # the attention and the FFN's up
    "gate": r"blk\.{il}\.ffn_down.*",                     # all but the FFN's down
    "moe": r"blk\.{il}\.ffn_(up|down|gate_up|gate)_(ch|)exps",   # all but the experts
}


@dataclass
class _Layers:
    """One device's share (fit.cpp's ngl_t): n_layer slots, of which the last n_part are partial."""
    n_layer: int = 0
    n_part: int = 0
    overflow: str = "moe"    # what the first partial layer sends elsewhere (the others: "moe")

    @property
    def n_full(self) -> int:
        return self.n_layer - self.n_part


@dataclass
class FitResult:
    settings: LlamaCppSettings   # what llama.cpp loads with after its fit (an unset context: resolved)
    status: str                  # "unchanged", "fitted" or "failed"
    steps: list[str] = field(default_factory=list)   # what it did, as its trace says it
    reason: str = ""             # why it failed

    def arguments(self) -> str:
        """The fitted arguments as llama.cpp's llama-fit-params prints them."""
        s = self.settings
        words = [f"-c {s.ctx_size or 0} -ngl {s.n_gpu_layers}"]
        if s.tensor_split:
            words.append("-ts " + ",".join(f"{share:g}" for share in s.tensor_split))
        if s.override_tensor:
            words.append('-ot "' + ",".join(f"{p}={backend_name(d)}" for p, d in s.override_tensor) + '"')
        return " ".join(words)


def backend_name(device: str) -> str:
    """llama.cpp's buffer-type name for one of memfit's devices (a CUDA build's)."""
    return device.replace("GPU", "CUDA")


def _trunc_div(a: int, b: int) -> int:
    """C++'s integer division (toward zero)."""
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b >= 0) else -quotient


def _step(delta: int, target: int, low: int, high: int) -> int:
    """fit.cpp's false-position step: an int64 quotient stored in a uint32_t, then clamped to 1 .. delta - 1."""
    step = _trunc_div(delta * (target - low), high - low) % UINT32 if high != low else delta - 1
    return min(max(step, 1), delta - 1)


def fit_llamacpp(model: GGUFModel, settings: LlamaCppSettings, *, free: list[int], host_total: int | None = None,
                 margins: list[int] | None = None, n_ctx_min: int | None = FIT_CTX) -> FitResult:
    """llama.cpp's --fit for `model` on GPUs with `free` bytes each (none: the CPU alone, judged against
    `host_total`), keeping `margins` (--fit-target, each device's) free; `n_ctx_min` None: the user asked for the
    full context (-c 0), which fit then never shrinks."""
    nd = len(free)
    margins = list(margins or [FIT_TARGET] * max(nd, 1))
    if len(margins) == 1 and nd > 1:
        margins *= nd   # one value: every device's
    if len(margins) != max(nd, 1):
        raise MemfitError(f"--fit-target: one value, or one per GPU ({nd}), not {len(margins)}.")
    if not nd and host_total is None:
        raise MemfitError("--fit on the CPU alone weighs the host's RAM: give --host-ram.")
    given = settings
    steps: list[str] = []
    n_streams = 1 if settings.kv_unified else max(1, settings.parallel)
    n_ctx_auto = settings.ctx_size is None
    n_ctx_max = min((model.n_ctx_train or 4096) * n_streams, UINT32 - 1)
    n_ctx_min_total = UINT32 - 1 if n_ctx_min is None else min(n_ctx_min * n_streams, UINT32 - 1)
    if n_ctx_auto:
        settings = replace(settings, ctx_size=n_ctx_max)

    def measure(at: LlamaCppSettings, part: str = "total") -> list[int]:
        """Each GPU's buffers (llama_memory_breakdown's model + context + compute; `part`: one of them), or with
        none the host's."""
        estimate = estimate_llamacpp(model, at, gpus=nd)
        if not nd:
            cpu = estimate.buffers["CPU"]
            return [cpu.model + cpu.kv + cpu.compute]   # the dry run sizes each weight once (repacked or not)
        return [getattr(estimate.buffers[f"GPU{i}"], part) for i in range(nd)]

    def result(status: str, reason: str = "") -> FitResult:
        steps.append(f"failed: {reason}" if reason else ("no changes needed" if status == "unchanged" else
                                                         "fitted"))
        return FitResult(settings, status, steps, reason)

    # step 1: the settings given
    full = measure(settings)
    budget = free if nd else [host_total or 0]
    projected_free = [budget[i] - full[i] for i in range(len(full))]
    steps.append(f"projected to use {sum(full) // MiB} MiB of {'device' if nd else 'host'} memory vs. "
                 f"{sum(budget) // MiB} MiB {'free' if nd else 'in total'}")
    if all(projected_free[i] >= margins[i] for i in range(len(full))):
        return result("unchanged")

    # step 2: an unset context shrinks
    if sum(projected_free) - sum(margins) < 0:
        if not n_ctx_auto:
            steps.append(f"context size set by user to {settings.ctx_size}: no change")
        elif n_ctx_max <= n_ctx_min_total:
            steps.append(f"context {n_ctx_max}: at most the least it sets ({n_ctx_min_total}), no change")
        else:
            target = sum(budget) - sum(margins)
            if nd > 1:   # whole layers (a mixture's tensors, a third of one) wasted at each device's edge
                layers = model.n_layer if given.n_gpu_layers < 0 else min(given.n_gpu_layers, model.n_layer)
                model_per_layer = sum(measure(settings, "model")) // max(layers, 1)
                target -= (nd + 1) * model_per_layer // (6 if model.n_expert else 2)
            settings = replace(settings, ctx_size=n_ctx_min_total)
            least = sum(measure(settings))
            if target > least:
                n_ctx = n_ctx_min_total + (n_ctx_max - n_ctx_min_total) * (target - least) // max(sum(full) - least, 1)
                align = 256 * n_streams
                settings = replace(settings, ctx_size=max(n_ctx - n_ctx % align, n_ctx_min_total))
                steps.append(f"context size reduced from {n_ctx_max} to {settings.ctx_size}")
                if nd <= 1:
                    return result("fitted")
            else:
                steps.append(f"context size reduced from {n_ctx_max} to {n_ctx_min_total}: "
                             f"{(sum(full) - least) // MiB} MiB less, not enough")
    if not nd:
        return result("failed", "was unable to fit model into system memory by reducing context")
    if given.n_gpu_layers != LlamaCppSettings.n_gpu_layers:
        return result("failed", f"n_gpu_layers already set by user to {given.n_gpu_layers}")
    if nd > 1 and given.tensor_split and any(given.tensor_split):
        return result("failed", "tensor_split already set by user")
    if given.override_tensor or given.n_cpu_moe:
        return result("failed", "tensor_buft_overrides already set by user")
    settings, status = _fit_layers(model, settings, nd, [free[i] - margins[i] for i in range(nd)], steps)
    return result(status)


def _fit_layers(model: GGUFModel, settings: LlamaCppSettings, nd: int, targets: list[int], steps: list[str]
                ) -> tuple[LlamaCppSettings, str]:
    """Steps 3 and 4: the layers (and a mixture's partial layers) on each GPU, the most that keep to `targets`."""
    hp_ngl, experts = model.n_layer, bool(model.n_expert)

    def placed(layers: list[_Layers], overflow_to: list[str]) -> LlamaCppSettings:
        """fit.cpp's set_ngl_tensor_split_tbo: -ngl, the split (several GPUs) and each partial layer's override."""
        n_gpu_layers = sum(device.n_layer for device in layers)
        overrides = []
        il0 = hp_ngl + 1 - n_gpu_layers
        for index, device in enumerate(layers):
            il0 += device.n_full
            for il in range(il0, il0 + device.n_part):
                kind = device.overflow if il == il0 else "moe"
                overrides.append((OVERFLOW[kind].format(il=il), overflow_to[index] if il == il0 else "CPU"))
            il0 += device.n_part
        split = tuple(float(device.n_layer) for device in layers) if nd > 1 and n_gpu_layers else None
        return replace(settings, n_gpu_layers=n_gpu_layers, tensor_split=split, override_tensor=tuple(overrides))

    def memory(layers: list[_Layers], overflow_to: list[str]) -> list[int]:
        estimate = estimate_llamacpp(model, placed(layers, overflow_to), gpus=nd)
        return [estimate.buffers[f"GPU{i}"].total for i in range(nd)]

    def copy(layers: list[_Layers]) -> list[_Layers]:
        return [replace(device) for device in layers]

    surplus_dense = 0
    if experts:   # every expert on the CPU: do the rest fit?
        moe_all = (r"blk\.\d+\.ffn_(up|down|gate_up|gate)_(ch|)exps", "CPU")
        dense = estimate_llamacpp(model, replace(settings, override_tensor=(moe_all,)), gpus=nd)
        surplus_dense = sum(targets[i] - dense.buffers[f"GPU{i}"].total for i in range(nd))
    overflow_to = ["CPU"] * nd
    layers = [_Layers() for _ in range(nd)]
    mem = memory(layers, overflow_to)

    # step 3: whole layers (a mixture's without their experts), each device from the last taking the most that fit
    for id_ in range(nd - 1, -1, -1):
        unassigned = hp_ngl + 1 - sum(layers[jd].n_layer for jd in range(id_ + 1, nd))
        high = copy(layers)
        high[id_].n_layer = unassigned
        if experts:
            high[id_].n_part = unassigned if id_ < nd - 1 else unassigned - 1
        if high[id_].n_layer > 0:
            mem_high = memory(high, overflow_to)
            if mem_high[id_] > targets[id_]:
                delta = high[id_].n_layer - layers[id_].n_layer
                while delta > 1:
                    step = _step(delta, targets[id_], mem[id_], mem_high[id_])
                    test = copy(layers)
                    test[id_].n_layer += step
                    if experts:   # the output layer, the last device's first, is never partial
                        test[id_].n_part += step - 1 if id_ == nd - 1 and test[id_].n_part == 0 else step
                    mem_test = memory(test, overflow_to)
                    if mem_test[id_] <= targets[id_]:
                        layers, mem = test, mem_test
                    else:
                        high, mem_high = test, mem_test
                    delta = high[id_].n_layer - layers[id_].n_layer
            else:
                layers, mem = high, mem_high
        steps.append(f"GPU{id_}: {layers[id_].n_layer} layers, {mem[id_] // MiB} MiB used")
    if not experts or surplus_dense <= 0:
        return placed(layers, overflow_to), "fitted"

    # step 4: a mixture whose dense weights fit turns its partial layers whole, front to back
    dense_start = nd
    for id_ in range(nd - 1, -1, -1):
        if layers[id_].n_layer <= 0:
            break
        dense_start = id_
    id_ = 0
    while id_ <= dense_start < nd:
        high = copy(layers)
        for jd in range(dense_start, nd):
            move = high[jd].n_layer if jd < nd - 1 else high[jd].n_layer - 1
            high[id_].n_layer += move
            high[jd].n_layer -= move
            high[jd].n_part = 0
        dense_start_high = nd - 1
        mem_high = memory(high, overflow_to)
        if mem_high[id_] > targets[id_]:
            delta = high[id_].n_full - layers[id_].n_full
            while delta > 1:
                step = _step(delta, targets[id_], mem[id_], mem_high[id_])
                test, start_test, converted = copy(layers), dense_start, 0
                while start_test < nd:
                    convert = min(step - converted, test[start_test].n_part)
                    test[start_test].n_layer -= convert
                    test[start_test].n_part -= convert
                    test[id_].n_layer += convert
                    converted += convert
                    if test[start_test].n_part > 0:
                        break
                    start_test += 1
                mem_test = memory(test, overflow_to)
                if mem_test[id_] <= targets[id_]:
                    layers, mem, dense_start = test, mem_test, start_test
                else:
                    high, mem_high, dense_start_high = test, mem_test, start_test
                delta = high[id_].n_full - layers[id_].n_full
        else:
            layers, mem, dense_start = high, mem_high, dense_start_high
        if layers[dense_start].n_layer > (0 if id_ < nd - 1 else 1):   # part of one more layer
            test, start_test = copy(layers), dense_start
            test[start_test].n_layer -= 1
            test[start_test].n_part -= 1
            test[id_].n_layer += 1
            test[id_].n_part += 1
            if test[start_test].n_part == 0:
                start_test += 1
            to_test = list(overflow_to)
            if id_ < nd - 1:
                to_test[id_] = f"GPU{id_ + 1}"

            def fits(at: list[int], device: int = id_) -> bool:
                return at[device] < targets[device] and (device + 1 == nd or at[device + 1] < targets[device + 1])

            test[id_].overflow = "up"
            mem_test = memory(test, to_test)
            if fits(mem_test):
                layers, overflow_to, mem, dense_start = copy(test), to_test, mem_test, start_test
                test[id_].overflow = "gate"
                mem_test = memory(test, to_test)
                if fits(mem_test):
                    layers, mem = copy(test), mem_test
            else:
                test[id_].overflow = "attn"
                mem_test = memory(test, to_test)
                if fits(mem_test):
                    layers, overflow_to, mem, dense_start = copy(test), to_test, mem_test, start_test
        steps.append(f"GPU{id_}: {layers[id_].n_layer} layers ({layers[id_].n_part} overflowing), "
                     f"{mem[id_] // MiB} MiB used")
        id_ += 1
    return placed(layers, overflow_to), "fitted"


def parse_overrides(text: str) -> tuple[tuple[str, str], ...]:
    """llama.cpp's --override-tensor PATTERN=BUFFER[,PATTERN=BUFFER...]: a buffer named CPU, or a GPU's (CUDA0,
    ROCm1, Vulkan0, SYCL0, Metal, GPU0 ...: memfit's GPU of that index)."""
    pairs = []
    for part in text.split(","):
        pattern, sep, buffer = part.rpartition("=")
        if not sep or not pattern:
            raise MemfitError(f"--override-tensor {part!r}: PATTERN=BUFFER, e.g. \"exps=CPU\".")
        if buffer.upper() in ("CPU", "CPU_REPACK"):
            pairs.append((pattern, "CPU"))
            continue
        index = re.fullmatch(r"(?:CUDA|ROCM|VULKAN|SYCL|GPU|METAL|RPC)(\d*)", buffer.upper())
        if index is None:
            raise MemfitError(f"--override-tensor {part}: the buffer is CPU or a GPU's (CUDA0, Vulkan0, ...).")
        pairs.append((pattern, f"GPU{index.group(1) or 0}"))
    return tuple(pairs)
