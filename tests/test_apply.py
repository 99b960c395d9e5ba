"""memfit.apply_ on a user's own model, optimizer and scheduler: the parameter groups and their settings stay,
the schedule goes on where it was, and the technique configs are importable classes."""
import importlib.resources
import warnings

import pytest
import torch

import memfit
from memfit.core.errors import MemfitError
from memfit.techniques import Checkpointing
from memfit.techniques.resolve import ResolvedWorkload


def llama_with_groups(steps_before: int = 2):
    """tiny-llama with two parameter groups (weight decay on matrices only, as most recipes do), a warm-up
    schedule on the first group, and the optimizer and scheduler stepped `steps_before` times already."""
    torch.manual_seed(0)
    model = ResolvedWorkload(model="tiny-llama", seq_len=32).source.build(device="cpu", dtype=torch.float32)
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": matrices, "lr": 1e-3, "weight_decay": 0.1},
                                   {"params": vectors, "lr": 5e-3, "weight_decay": 0.0}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda step: min(1.0, (step + 1) / 4), lambda step: 1.0])
    for _ in range(steps_before):
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def batch():
    ids = torch.randint(0, 256, (2, 32))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("steps_before", [0, 2])
@pytest.mark.parametrize("techniques", [("adamw8bit",), ("cpu-offload",), ("lora",), (Checkpointing(every=2),)])
def test_groups_settings_and_schedule_survive_a_rebuilt_optimizer(techniques, steps_before):
    model, optimizer, scheduler = llama_with_groups(steps_before)
    lrs, matrices = [g["lr"] for g in optimizer.param_groups], len(optimizer.param_groups[0]["params"])
    setup = memfit.apply_(model, optimizer, techniques, scheduler=scheduler)
    groups = setup.optimizer.param_groups
    assert [g["lr"] for g in groups] == lrs and [g["weight_decay"] for g in groups] == [0.1, 0.0]
    if techniques == ("lora",):   # the adapters join the group of the weights they adapt; the rest froze
        assert len(groups[0]["params"]) == 4 * 2 * 2 and not groups[1]["params"]   # q, v x A, B x 2 layers
    else:
        assert len(groups[0]["params"]) == matrices
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            setup.step(batch())
            setup.scheduler.step()
    # PyTorch warns when it sees the scheduler step before the optimizer (or the optimizer's step replaced)
    assert not [w for w in caught if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]
    steps = steps_before + 2
    assert setup.scheduler.last_epoch == steps
    assert [g["lr"] for g in setup.optimizer.param_groups] == [1e-3 * min(1.0, (steps + 1) / 4), 5e-3]


def test_a_scheduler_of_another_optimizer_is_refused():
    model, _, scheduler = llama_with_groups()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MemfitError, match="LR scheduler of the optimizer"):
        memfit.apply_(model, other, ["adamw8bit"], scheduler=scheduler)


def test_the_package_is_typed_and_its_names_are_visible():
    assert importlib.resources.files("memfit").joinpath("py.typed").is_file()
    for name in memfit.__all__:
        assert getattr(memfit, name) is not None
    assert Checkpointing(every=2).spec == "checkpointing:every=2"


def test_optimizer_in_backward_in_a_users_own_loop_gives_the_same_weights():
    """apply_ with optimizer-in-backward rebuilds the user's AdamW (its groups and settings) as one optimizer per
    parameter stepped in backward; the user's loop (backward, optimizer.step, zero_grad) is unchanged and every
    weight ends as with the plain AdamW."""
    torch.manual_seed(1)
    batches = [batch() for _ in range(3)]
    finals = []
    for techniques in ((), ("optimizer-in-backward",)):
        model, optimizer, _ = llama_with_groups(steps_before=0)
        setup = memfit.apply_(model, optimizer, techniques)
        for b in batches:
            setup.model(**b).loss.backward()
            setup.optimizer.step()
            setup.optimizer.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
        assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(*finals))
    with pytest.raises(MemfitError, match="pass your optimizer"):
        memfit.apply_(llama_with_groups(0)[0], None, ["optimizer-in-backward"])


def test_a_plain_tensor_batch_is_the_models_one_argument():
    """setup.step(x) with x a tensor calls model(x) (a tuple or list is unpacked, a dict passed by keyword)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    setup = memfit.apply_(model, torch.optim.SGD(model.parameters(), lr=0.1), ["bf16-mixed"])
    before = model[0].weight.detach().clone()
    loss = setup.step(torch.randn(8, 16))
    assert loss.dim() == 0 and not torch.equal(model[0].weight, before) and model[0].weight.grad is None
