"""memfit instances and plan --instance: machines people rent, their dated list prices, plans priced per token."""
import json

import pytest

from memfit.cli.main import main
from memfit.core.errors import MemfitError
from memfit.core.units import GiB
from memfit.planner import PlanRequest, plan
from memfit.specs.hardware import get_gpu
from memfit.specs.instances import get_instance, instance_catalog, parse_price, priced, usual_host_ram


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_listed_price_says_when_and_where_it_came_from():
    catalog = instance_catalog().values()
    listed = [i for i in catalog if i.usd_per_hour is not None]
    assert len(listed) >= 15
    assert len({i.provider for i in listed}) >= 4
    for instance in listed:
        assert instance.usd_per_hour > 0 and instance.price_date and instance.price_source.startswith("https://")
        assert instance.gpus >= 1 and instance.host_ram_bytes > 0


def test_instances_lists_the_catalog_and_filters_by_gpu(capsys):
    code, out, _ = run(capsys, "instances", "--json")
    data = json.loads(out)
    assert code == 0 and data["schema"] == "memfit.instances/1" and len(data["instances"]) == len(instance_catalog())
    code, out, _ = run(capsys, "instances", "--gpu", "h100", "--json")
    names = {i["name"] for i in json.loads(out)["instances"]}
    assert "p5.48xlarge" in names and all(i["gpu"] == "h100-sxm-80gb" for i in json.loads(out)["instances"])


def test_a_price_given_replaces_the_list_price_and_bad_ones_say_how_to_write_them():
    assert parse_price("p5.48xlarge=$40") == ("p5.48xlarge", 40.0)
    (p5,) = priced([get_instance("P5.48XLARGE")], {"p5.48xlarge": 40.0})
    assert p5.usd_per_hour == 40.0 and p5.price_source == "--price"
    for bad in ("p5.48xlarge", "p5.48xlarge=free", "=3", "p5.48xlarge=-1"):
        with pytest.raises(MemfitError, match="NAME=USD"):
            parse_price(bad)
    with pytest.raises(MemfitError, match=r"Did you mean: p5\.48xlarge"):
        priced([p5], {"p5.48xlarg": 1.0})


def test_an_instance_sets_the_gpu_its_count_and_host_ram_and_prices_the_plan(capsys):
    code, out, _ = run(capsys, "plan", "tiny-llama", "--seq-len", "256", "--global-batch", "8", "--instance",
                       "g6e.12xlarge", "--top", "2", "--json")
    data = json.loads(out)
    assert code == 0
    instance = get_instance("g6e.12xlarge")
    assert data["request"]["gpu"] == "l40s" and data["request"]["num_gpus"] == 4
    assert data["request"]["host_ram_bytes"] == instance.host_ram_bytes
    best = data["plans"][0]
    assert best["instance"] == "g6e.12xlarge" and best["usd_per_hour"] == instance.usd_per_hour
    tokens_per_hour = best["throughput"] * 4 * 3600
    assert best["usd_per_million_tokens"] == pytest.approx(instance.usd_per_hour / tokens_per_hour * 1e6, rel=1e-3)
    assert best["price"]["date"] == instance.price_date


@pytest.mark.parametrize("argv, message", [
    (("--instance", "p5.48xlarge", "--gpu", "a100-80gb"), "holds h100-sxm-80gb GPUs"),
    (("--instance", "g6e.12xlarge", "--gpus", "8"), "holds 4"),
    (("--instance", "any", "--gpus", "8"), "drop --gpu/--gpus"),
    (("--instance", "p5.48xlrge"), "Did you mean: p5.48xlarge"),
    (("--price", "p5.48xlarge=40",), "add --instance"),
    ((), "needs --gpu"),
])
def test_bad_instance_flags_are_one_line_each(capsys, argv, message):
    code, _, err = run(capsys, "plan", "tiny-llama", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_any_instance_ranks_the_machines_that_fit_by_price_per_token(capsys):
    """Serving a 13B model (26 GB of half-precision weights): the one-GPU machines with 16 GiB of host RAM can
    neither hold it on the GPU nor stream it from the host, the others can; those that fit come cheapest per
    million tokens first, each plan with its machine and price."""
    code, out, _ = run(capsys, "plan", "llama-2-13b", "--task", "inference", "--seq-len", "512", "--batch-size", "4",
                       "--instance", "any", "--json")
    data = json.loads(out)
    prices = [p["usd_per_million_tokens"] for p in data["plans"]]
    assert code == 0 and len({p["instance"] for p in data["plans"]}) >= 10
    assert prices == sorted(prices) and all(p > 0 for p in prices)
    refused = {i["instance"]: i["reason"] for i in data["instances"] if not i["fits"]}
    assert {"g4dn.xlarge", "g5.xlarge", "g6.xlarge"} <= set(refused)
    assert all("host RAM" in reason for reason in refused.values())
    assert "rtx-4090-workstation" in data["unpriced"]
    with pytest.MonkeyPatch.context() as patch:   # the table fits the terminal, every ranked machine named in full
        patch.setenv("COLUMNS", "100")
        code, out, _ = run(capsys, "plan", "llama-2-13b", "--task", "inference", "--seq-len", "512",
                           "--batch-size", "4", "--instance", "any")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 100
    assert all(f"│ {plan['instance']} " in out for plan in data["plans"])


def test_a_bare_gpu_says_when_the_plan_needs_more_host_ram_than_its_machines_have():
    """Serving a 13B model on one A10G streams its layers from 23.6 GiB of host RAM; the one-A10G machine of the
    catalog has 16 GiB. With --host-ram given the plan is checked instead, and nothing is said."""
    a10g = get_gpu("a10g")
    result = plan(PlanRequest(model="llama-2-13b", gpu=a10g, task="inference", seq_len=512, batch_size=4, top=1),
                  brief=True)
    least, most = usual_host_ram(a10g, 1)
    assert result.plans[0].host_ram_bytes > most >= least > 0
    assert result.warnings and "pass --host-ram" in result.warnings[0]
    checked = plan(PlanRequest(model="llama-2-13b", gpu=a10g, task="inference", seq_len=512, batch_size=4, top=1,
                               host_ram_bytes=512 * GiB), brief=True)
    assert checked.feasible and not checked.warnings
