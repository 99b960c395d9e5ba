"""Knowledge distillation for real: the frozen teacher and the smaller student in one step, predicted
against a real run; the student starts from the teacher's blocks and learns from its soft targets."""
import pytest
import torch

import memfit
from memfit.core.errors import MemfitError
from memfit.techniques.resolve import ResolvedWorkload
from tests.conftest import SHAPE, assert_analytic, predicted, rel


def test_distillation_counts_the_teacher_and_its_logits_as_predicted(measured):
    run, base = measured(("distill",)), measured(())
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    teacher = 4 * 4999424                        # tiny-llama in float32, frozen
    student = 4 * (4999424 - 2 * 725504)         # two of its four blocks
    assert run.at_peak["parameters"] == teacher + student
    assert run.at_peak["optimizer_states"] < base.at_peak["optimizer_states"], "states for the student only"
    # at this size the teacher's and the student's vocabulary-sized logits outweigh the two blocks saved
    assert run.peak_bytes > base.peak_bytes


def test_an_int8_teacher_takes_less_memory_as_predicted(measured, losses):
    run, full = measured(("distill:teacher=int8",)), measured(("distill",))
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    assert run.at_peak["parameters"] < full.at_peak["parameters"] - 0.6 * 4 * 4 * 725504   # its blocks' linears
    got = losses(("distill:teacher=int8",))
    assert got[-1] < got[0] - 0.1 and got != losses(("distill",))


def test_pruning_after_distill_narrows_the_student_only(measured):
    run = measured(("distill", "prune-structured"))
    assert rel(predicted(run, "traced"), run.peak_bytes) < 0.03
    assert_analytic(run)
    torch.manual_seed(0)
    teacher = ResolvedWorkload(**SHAPE).source.build(device="cpu", dtype=torch.float32)
    student = memfit.apply_(teacher, None, ["distill", "prune-structured"]).model
    assert student.model.layers[0].mlp.down_proj.in_features == 344
    assert teacher.model.layers[0].mlp.down_proj.in_features == 688


def test_the_student_starts_from_the_teachers_blocks_and_learns(losses):
    torch.manual_seed(0)
    teacher = ResolvedWorkload(**SHAPE).source.build(device="cpu", dtype=torch.float32)
    setup = memfit.apply_(teacher, None, ["distill"])
    student = setup.model
    assert len(student.model.layers) == 2 and student.config.num_hidden_layers == 2
    for mine, theirs in ((0, 0), (1, 3)):            # evenly spaced: the first and the last block
        assert torch.equal(student.model.layers[mine].mlp.up_proj.weight,
                           teacher.model.layers[theirs].mlp.up_proj.weight)
    assert not any(p.requires_grad for p in teacher.parameters()) and all(p.requires_grad for p in student.parameters())
    got = losses(("distill",))
    assert got[-1] < got[0] - 0.1 and got != losses(())


def test_distillation_refuses_what_it_cannot_do():
    for techniques, match in ((("distill:layers=4",), "fewer blocks"), (("distill", "lora"), "adapters"),
                              (("distill:temperature=0",), "positive"), (("distill:alpha=2",), "between 0 and 1")):
        with pytest.raises(MemfitError, match=match):
            ResolvedWorkload(**SHAPE, techniques=techniques)
    with pytest.raises(MemfitError, match="student"):
        ResolvedWorkload(**{**SHAPE, "task": "inference"}, techniques=("distill",))
