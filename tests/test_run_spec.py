"""potluck.cli.spec: references to user code, the spec file and its overrides, the model forms a
`--model` may return, data sources, optimizer and loss names; `pipeline plan` on a user model."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from potluck.cli import main
from potluck.cli.plan_file import PLAN_FILE_VERSION, PlanFile
from potluck.cli.spec import LOSSES, OPTIMIZERS, RunSpec, SpecError, add_spec_options, load_ref
from tests import user_model


def parse(*argv: str) -> RunSpec:
    parser = argparse.ArgumentParser()
    add_spec_options(parser)
    return RunSpec.from_args(parser.parse_args(list(argv)))


def test_refs_resolve() -> None:
    assert load_ref("tests.user_model:make_layers") is user_model.make_layers
    assert load_ref("tests.user_model:Residual.forward") is user_model.Residual.forward
    assert load_ref("torch.nn.functional:mse_loss") is nn.functional.mse_loss


@pytest.mark.parametrize("ref, message", [
    ("tests.user_model", "expected 'pkg.module:name'"),
    (":make_layers", "expected 'pkg.module:name'"),
    ("tests.no_such_module:f", "module 'tests.no_such_module' not found"),
    ("no_such_package.models:f", "module 'no_such_package' not found"),
    ("tests.user_model:no_such_fn", "'tests.user_model' has no attribute 'no_such_fn'"),
    ("tests.user_model:Residual.nope", "'tests.user_model.Residual' has no attribute 'nope'"),
    ("tests.user_model:NOT_CALLABLE", "tests.user_model.NOT_CALLABLE is a int, not callable"),
])
def test_bad_refs_say_what_failed(ref: str, message: str) -> None:
    with pytest.raises(SpecError, match="^--model ") as e:
        load_ref(ref, "--model")
    assert message in str(e.value)


def test_a_module_that_fails_to_import_is_not_reported_missing(tmp_path, monkeypatch) -> None:
    (tmp_path / "h7_broken_model.py").write_text("import h7_missing_dependency\n")
    (tmp_path / "h7_raising_model.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SpecError, match="importing 'h7_broken_model' failed: No module named 'h7_missing_dep"):
        load_ref("h7_broken_model:f")
    with pytest.raises(SpecError, match="importing 'h7_raising_model' failed: RuntimeError: no GPU here"):
        load_ref("h7_raising_model:f")


SPEC_FILE = """# what to train
model = "tests.user_model:make_sequential"
data = 'tests.user_model:batches'  # the user's data
loss = "mse"
optimizer = "sgd"
lr = 0.5
seed = 3
"""


def test_spec_file_and_command_line_overrides(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(SPEC_FILE)
    assert parse() == RunSpec()
    assert parse("--spec", str(path)) == RunSpec("tests.user_model:make_sequential", "tests.user_model:batches",
                                                 "mse", "sgd", 0.5, 3)
    spec = parse("--spec", str(path), "--lr", "0.1", "--optimizer", "adamw", "--loss", "tests.user_model:loss")
    assert spec == RunSpec("tests.user_model:make_sequential", "tests.user_model:batches",
                           "tests.user_model:loss", "adamw", 0.1, 3)
    assert parse("--model", "tests.user_model:make_layers", "--seed", "5") == \
        RunSpec(model="tests.user_model:make_layers", seed=5)


@pytest.mark.parametrize("text, message", [
    ('modle = "a:b"\n', "unknown keys modle"),
    ("lr = \"fast\"\n", "lr = 'fast' has the wrong type"),
    ("seed = true\n", "seed = True has the wrong type"),
    ('optimizer = "lbfgs"\n', "optimizer 'lbfgs': expected one of sgd, adam, adamw"),
    ('loss = "hinge"\n', "loss 'hinge': expected 'pkg.module:fn' or one of"),
    ("lr = -1\n", "lr must be positive"),
    ("lr = \n", "--spec"),
])
def test_bad_spec_files_are_refused(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        parse("--spec", str(path))
    with pytest.raises(SpecError, match="--spec .*missing.toml"):
        parse("--spec", str(tmp_path / "missing.toml"))


def test_bad_names_on_the_command_line_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("--optimizer", "lbfgs")
    assert "invalid choice: 'lbfgs'" in capsys.readouterr().err
    with pytest.raises(SpecError, match="loss 'hinge'"):
        parse("--loss", "hinge")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_name(name: str) -> None:
    param = nn.Parameter(torch.ones(3))
    opt = parse("--optimizer", name, "--lr", "0.25").make_optimizer([param])
    assert type(opt) is getattr(torch.optim, OPTIMIZERS[name]) and opt.param_groups[0]["lr"] == 0.25
    param.sum().backward()
    opt.step()
    assert (param < 1).all()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_each_loss_name(name: str) -> None:
    out = torch.tensor([[2.0, -1.0], [0.5, 0.25]])
    targets = {"cross_entropy": torch.tensor([0, 1]), "nll": torch.tensor([0, 1])}.get(name, torch.ones(2, 2))
    fn = parse("--loss", name).loss_fn
    assert fn is getattr(nn.functional, LOSSES[name])
    assert fn(out, targets).shape == ()
    assert parse("--loss", "tests.user_model:loss").loss_fn is user_model.loss


def outputs(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("ref, count", [("make_layers", 3), ("make_sequential", 3), ("make_residual", 2)])
def test_model_forms(ref: str, count: int) -> None:
    spec = RunSpec(model=f"tests.user_model:{ref}", seed=11)
    layers = spec.layers()
    assert len(layers) == count and all(isinstance(layer, nn.Module) for layer in layers)
    torch.manual_seed(11)
    whole = getattr(user_model, ref)()
    x = torch.randn(4, user_model.FEATURES)
    assert torch.allclose(outputs(layers, x), nn.Sequential(*whole)(x) if isinstance(whole, list) else whole(x))
    # every peer builds the same weights for the layers it holds, and the global RNG is left alone
    state = torch.random.get_rng_state()
    part = spec.make_layers([count - 1])
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(part[0].state_dict().values(),
                                                 layers[-1].state_dict().values(), strict=True))
    with pytest.raises(SpecError, match=f"has {count} layers"):
        spec.make_layers([count])


def test_residual_is_cut_only_where_one_tensor_crosses() -> None:
    first, rest = RunSpec(model="tests.user_model:make_residual").layers()
    assert [n for n, _ in first.named_modules() if n] == ["inp"]  # a and b stay together with their skip


def test_models_that_are_not_layers_are_refused(tmp_path, monkeypatch) -> None:
    (tmp_path / "h7_odd_models.py").write_text(
        "import torch\n"
        "def number(): return 3\n"
        "def empty(): return []\n"
        "class Branchy(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(2, 2)\n"
        "    def forward(self, x):\n"
        "        return self.l(x) if x.sum() > 0 else x\n"
        "def branchy(): return Branchy()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, message in [("number", "returned a int"), ("empty", "not a non-empty list"),
                          ("branchy", "torch.fx cannot trace it")]:
        with pytest.raises(SpecError, match=message):
            RunSpec(model=f"h7_odd_models:{name}").layers()


def test_batches_and_sources() -> None:
    spec = RunSpec(data="tests.user_model:batches", seed=2)
    source = spec.source(rank=0)
    n = user_model.EPOCH_BATCHES
    seen = [source(mb) for mb in range(n + 2)]  # past the end of the first epoch
    assert all(x.shape == (user_model.BATCH, user_model.FEATURES) for x, _ in seen)
    first_epoch = list(spec.batches(0))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(seen, first_epoch, strict=False))
    assert torch.equal(seen[n][0], next(spec.batches(0, seed=3))[0])  # epoch 1: the next seed
    assert torch.equal(source(1)[0], seen[1][0])  # an earlier micro-batch replays
    assert torch.equal(source(n + 1)[0], seen[n + 1][0])
    assert not torch.equal(spec.source(rank=1)(0)[0], seen[0][0])  # each rank draws its own batches
    assert torch.equal(spec.sample(), seen[0][0])
    with pytest.raises(SpecError, match="no --data given"):
        RunSpec().source(0)
    with pytest.raises(SpecError, match="yielded no batches"):
        RunSpec(data="tests.user_model:no_batches").source(0)(0)


def test_a_spec_trains_the_user_model() -> None:
    spec = parse("--model", "tests.user_model:make_layers", "--data", "tests.user_model:batches",
                 "--optimizer", "adam", "--lr", "0.03")
    layers = spec.layers()
    model = nn.Sequential(*layers)
    opt, source = spec.make_optimizer(model.parameters()), spec.source(0)
    before = user_model.accuracy(layers)
    for mb in range(60):
        x, y = source(mb)
        opt.zero_grad()
        spec.loss_fn(model(x), y).backward()
        opt.step()
    assert user_model.accuracy(layers) > max(0.8, before + 0.3)


USER_MODEL = ["--model", "tests.user_model:make_layers", "--data", "tests.user_model:batches"]


def write_profiles(path, memory: int) -> str:
    path.write_text(json.dumps([{"peer_id": f"node-{i}", "flops": 1e9, "memory": memory} for i in range(4)]))
    return str(path)


def test_plan_a_user_model_and_write_the_plan(tmp_path, capsys) -> None:
    profiles = write_profiles(tmp_path / "profiles.json", 2**40)
    assert main(["pipeline", "plan", "--profiles", profiles, *USER_MODEL, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["model"]
    assert summary["layers"] == 3
    # each node holds 60% of a copy: two clusters of two stages
    profiles = write_profiles(tmp_path / "profiles.json", int(summary["memory_needed"] * 0.6))
    (tmp_path / "run.toml").write_text('optimizer = "sgd"\nlr = 0.5\nloss = "tests.user_model:loss"\n')
    out = tmp_path / "plan.json"
    assert main(["pipeline", "plan", "--profiles", profiles, "--run-id", "mlp", "--spec", str(tmp_path / "run.toml"),
                 *USER_MODEL, "--lr", "0.05", "--write-plan", str(out)]) == 0
    printed = capsys.readouterr()
    assert "2 clusters" in printed.out and f"plan written to {out}" in printed.err
    plan = PlanFile.read(out)
    assert plan.spec == RunSpec("tests.user_model:make_layers", "tests.user_model:batches", "tests.user_model:loss",
                                "sgd", 0.05)
    assert (plan.run_id, plan.version, plan.num_layers, plan.micro_batch) == ("mlp", PLAN_FILE_VERSION, 3,
                                                                               user_model.BATCH)
    assert [len(stages) for stages in plan.clusters] == [2, 2] and not plan.standby
    assert sorted(s.peer for stages in plan.clusters for s in stages) == [f"node-{i}" for i in range(4)]
    layers = plan.spec.layers()
    assert [c.param_bytes for c in plan.layer_costs] == [sum(p.numel() * 4 for p in layer.parameters())
                                                          for layer in layers]
    # what the file holds can be edited by hand; a broken edit is refused when read
    wire = json.loads(out.read_text())
    for edit, message in [(lambda w: w.update(version=2), "version 2, this potluck reads version 1"),
                          (lambda w: w["clusters"][0].pop(), "cluster 0's stages do not cover layers 0-2"),
                          (lambda w: w["standby"].append(w["clusters"][0][0]["peer"]), "a peer appears twice"),
                          (lambda w: w["spec"].update(optimizer="lbfgs"), "optimizer 'lbfgs'")]:
        broken = json.loads(json.dumps(wire))
        edit(broken)
        out.write_text(json.dumps(broken))
        with pytest.raises(SpecError, match=message):
            PlanFile.read(out)


def test_plan_without_a_model_plans_the_demo(tmp_path, capsys) -> None:
    profiles = write_profiles(tmp_path / "profiles.json", 2**40)
    assert main(["pipeline", "plan", "--profiles", profiles, "--json", "--clusters", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["layers"] == 6 and len(plan["clusters"][0]["stages"]) == 4


def test_plan_errors_name_the_problem(tmp_path, capsys) -> None:
    profiles = write_profiles(tmp_path / "profiles.json", 2**40)
    assert main(["pipeline", "plan", "--profiles", profiles, "--model", "tests.user_model:make_layers"]) == 1
    assert "needs --data to be profiled on" in capsys.readouterr().err
    assert main(["pipeline", "plan", "--profiles", profiles, "--model", "tests.user_model:nope",
                 "--data", "tests.user_model:batches"]) == 1
    assert "'tests.user_model' has no attribute 'nope'" in capsys.readouterr().err
