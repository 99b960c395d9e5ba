"""Knowledge distillation (techniques/distillation.py): a frozen teacher at the model's depth and a student with
fewer blocks in one step. The teacher's forward runs without gradients and keeps only its log-softmaxed
logits; the student trains on the cross-entropy plus KL(teacher || student), which PyTorch computes as
exp(target) * (target - input), summed (every term vocabulary-sized)."""
from __future__ import annotations

from memfit.core.weight_formats import TORCHAO_INT8
from memfit.estimators.analytic import ops
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Param, Sym
from memfit.estimators.analytic.weights import quantize_linears


def declare_teacher_and_student(e: Engine, family, teacher_spec, spec, num_layers: int, student_layers: int,
                                int8_teacher: bool) -> dict[str, Param]:
    """The teacher's parameters (frozen, set aside; int8 codes with `int8_teacher`), returned, and the student's
    (in `e.params`: `spec`, narrower than the teacher's when pruning narrows the student)."""
    family.declare_params(e, teacher_spec, num_layers)
    if int8_teacher:
        quantize_linears(e, family, teacher_spec, TORCHAO_INT8)
    teacher, e.params = e.params, {}
    for param in teacher.values():
        param.grad, param.frozen = False, True
    family.declare_params(e, spec, student_layers)
    return teacher


def distillation_loss(e: Engine, family, specs: tuple, teacher: dict[str, Param], depths: tuple[int, int],
                      batch: int, seq: int) -> Sym:
    """One step's loss; `specs` and `depths` are the teacher's and the student's."""
    (teacher_spec, spec), (teacher_layers, student_layers) = specs, depths
    student, e.params = e.params, teacher
    views, e.inputs_are_views = e.inputs_are_views, True     # the teacher reads the student's batch
    logits = family.forward(e, teacher_spec, teacher_layers, batch=batch, q_len=seq, labels=False)
    e.params, e.inputs_are_views = student, views
    soft_targets = _log_softmax_over_temperature(e, logits)
    del logits
    outputs: list[Sym] = []
    cross_entropy = family.train(e, spec, student_layers, batch, seq, stage_outputs=outputs)
    student_logits = outputs.pop()        # the model's output holds them until the loss function returns
    log_probs = _log_softmax_over_temperature(e, student_logits)
    targets = e.new(soft_targets.numel, soft_targets.dtype)           # exp(target): no gradient
    difference = ops.add(e, soft_targets, log_probs)                  # target - input
    del log_probs
    kl = e.record(e.new(1, "float32"), [ops.mul(e, targets, difference)], [])   # the sum
    del targets, difference
    kl = ops.scalar_op(e, ops.scalar_op(e, kl))                       # / rows, * alpha T^2
    loss = ops.add(e, kl, ops.scalar_op(e, cross_entropy))            # + (1 - alpha) x cross-entropy
    del soft_targets, student_logits      # the loss function's locals, freed as it returns
    return loss


def _log_softmax_over_temperature(e: Engine, logits: Sym) -> Sym:
    scaled = ops.scalar_op(e, ops.cast(e, logits, "float32"))
    return ops.softmax(e, scaled, "log_softmax")
