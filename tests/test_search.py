"""hparams_search=optuna: every trial a whole DDP run whose ranks agree, a study that survives a kill, pruning."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import optuna
import pytest
import torch

from src.core.errors import UserError
from tests.conftest import FAST, descendants, output, running, train
from tests.faults import hold_sweep_job

SEARCH = [
    *FAST,
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=3",
    "test=false",
    "callbacks.last_checkpoint.every_n_train_steps=0",
    "data.batch_size=choice(4,8)",
]
VALUES = re.compile(r"trial (\d+) of study cifar10-ddp: this process trains with (.*)$", re.M)


def study(sweep_dir: Path) -> optuna.Study:
    return optuna.load_study(study_name="cifar10-ddp", storage=f"sqlite:///{sweep_dir}/optuna.db")


def trained_with(log_file: Path) -> list[tuple[int, str]]:
    return [(int(n), values) for n, values in VALUES.findall(log_file.read_text())]


def wait_for(path: Path, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_a_ddp_search_killed_in_its_second_trial_ends_with_exactly_n_trials_whose_ranks_agree(tmp_path):
    sweep_dir = tmp_path / "search"
    command = [
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=3",
        "strategy=ddp",
        "trainer.devices=2",
        f"hydra.sweep.dir={sweep_dir}",
        *SEARCH,
        # trial 1 sits in its second epoch's first step until the kill (its epoch takes a tenth of a second), once
        *hold_sweep_job(1, f"{tmp_path}/slept"),
    ]
    search = train(*command, background=True)
    wait_for(tmp_path / "slept", search)  # trial 1 has trained its first epoch
    ranks = descendants(search.pid)
    search.send_signal(signal.SIGKILL)
    search.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in ranks) and time.monotonic() < deadline:  # trial 1's rank 1 follows its launcher
        time.sleep(0.2)
    assert not any(running(pid) for pid in ranks)
    killed = study(sweep_dir).trials
    assert [t.state.name for t in killed] == ["COMPLETE", "RUNNING"]

    again = train(*command)
    assert again.returncode == 0, output(again)[-4000:]
    trials = study(sweep_dir).trials
    assert [t.number for t in trials] == [0, 1, 2] and all(t.state.name == "COMPLETE" for t in trials)
    assert trials[1].params == killed[1].params  # the cut-short trial ran again with its own values
    assert "finished in an earlier run of this sweep" not in output(again)  # trial 0 had been told: not touched
    for trial in trials:
        job = sweep_dir / str(trial.number)
        logs = [trained_with(job / "train.log"), trained_with(job / "train_node0_local1.log")]
        lines = logs[0] + logs[1]
        assert {n for n, _ in lines} == {trial.number} and len({v for _, v in lines}) == 1, lines  # the ranks agree
        expected = " ".join(f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
        assert lines[0][1] == expected
        assert len(logs[0]) == (2 if trial.number == 1 else 1)  # only the cut-short trial ran twice
        final = torch.load(job / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert final["global_step"] == 6 and final["saved_by"]["world_size"] == 2
        assert json.loads((job / "result.json").read_text())["score"] == trial.value
    assert (
        f"Restoring states from the checkpoint path at {sweep_dir / '1' / 'checkpoints' / 'last.ckpt'}"
        in (sweep_dir / "1" / "train.log").read_text()
    )
    best = (sweep_dir / "best.yaml").read_text()
    assert f"trial: {study(sweep_dir).best_trial.number}" in best
    table = (sweep_dir / "trials.md").read_text()
    assert table.count("| complete |") == 3 and "Best: trial" in table
    assert not (sweep_dir / "scaling.md").exists()  # a search's report is its own


def test_the_pruner_stops_a_bad_trial_at_an_epoch_end_and_the_study_records_it(tmp_path):
    sweep_dir = tmp_path / "search"
    # a pruner that prunes every trial whose val/acc is below 1.1 (all of them), from its second validation on
    result = train(
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=1",
        f"hydra.sweep.dir={sweep_dir}",
        *SEARCH,
        "trainer.max_epochs=4",
        "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
        "+hydra.sweeper.pruner.lower=1.1",
        "~hydra.sweeper.pruner.n_startup_trials",
        "hydra.sweeper.pruner.n_warmup_steps=1",
    )
    assert result.returncode == 0, output(result)[-4000:]
    (trial,) = study(sweep_dir).trials
    assert trial.state.name == "PRUNED" and sorted(trial.intermediate_values) == [0, 1]
    assert "trial 0 pruned after epoch 1" in output(result)
    job = sweep_dir / "0"
    assert json.loads((job / "result.json").read_text())["pruned_at_epoch"] == 1
    final = torch.load(job / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == 6  # 2 of 4 epochs: it stopped there, and its last.ckpt says so
    assert "| pruned |" in (sweep_dir / "trials.md").read_text() and not (sweep_dir / "best.yaml").exists()


def test_a_failing_trial_is_recorded_as_failed_and_the_search_says_why(tmp_path):
    sweep_dir = tmp_path / "search"
    result = train(
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=1",
        f"hydra.sweep.dir={sweep_dir}",
        *SEARCH,
        "+callbacks.fault._target_=tests.faults.RaiseAt",  # a failure only the run meets
        "+callbacks.fault.step=1",
        "+callbacks.fault.error=builtins.ValueError",
        timeout=120,
    )
    assert result.returncode == 1, output(result)[-4000:]
    assert "error: 1 of 1 trials failed: trial 0: ValueError: injected failure at step 1" in result.stderr
    assert [t.state.name for t in study(sweep_dir).trials] == ["FAIL"]


def test_a_value_a_trial_would_refuse_refuses_the_search_before_its_study_and_first_trial(tmp_path):
    """Before, each trial ran and failed on it, and the study recorded every one as failed: a fixed value, and a
    searched key's choice (or a range's end) a trial would refuse."""
    for overrides, said, narrow in (
        (["model.arch=choice(resnet18,resnet7)"], "error: model.arch=resnet7 is not a torchvision ResNet", "choices"),
        (["model.optimizer.lr=interval(-0.1,0.5)"], "error: model.optimizer.lr=-0.1 must be a number >= 0", "range"),
        ([f"paths.checkpoints={tmp_path}/f/ck"], f"error: paths.checkpoints={tmp_path}/f/ck lies under", None),
    ):
        (tmp_path / "f").write_text("")  # a file where the last case's checkpoints would go
        result = train("-m", "hparams_search=optuna", f"hydra.sweep.dir={tmp_path}/s", *SEARCH, *overrides)
        assert result.returncode == 2 and result.stderr.startswith(said), output(result)[-3000:]
        assert result.stderr.count("\n") == 1 and result.stderr.endswith("; no trial of the search started\n")
        key = said.split()[1].split("=")[0]
        assert (f"(a value the search may try: narrow {key}'s {narrow})" in result.stderr) == (narrow is not None)
        assert narrow is not None or "narrow" not in result.stderr  # a fixed value: nothing for the search to narrow
        assert "Launching" not in output(result) and not (tmp_path / "s").exists()  # no study, no trial, no dir


def test_a_search_on_several_nodes_or_without_multirun_is_refused_in_one_line(tmp_path):
    nodes = train(
        "-m", "hparams_search=optuna", f"hydra.sweep.dir={tmp_path}/s", *SEARCH, "trainer.num_nodes=2", timeout=120
    )
    assert nodes.returncode == 2
    assert nodes.stderr.startswith(
        "error: hparams_search=optuna runs its trials from one process, which starts each "
        "trial's ranks: start it once, without srun or torchrun, on one node"
    )
    once = train("hparams_search=optuna", f"hydra.run.dir={tmp_path}/r", *FAST, timeout=120)
    assert once.returncode == 2
    assert once.stderr.strip() == (
        "error: hparams_search=optuna searches as a multirun: add -m (python -m src.train -m hparams_search=optuna ...)"
    )


def test_a_study_run_again_with_other_fixed_overrides_is_refused(tmp_path):
    sweep_dir = tmp_path / "search"
    sweep_dir.mkdir()
    earlier = optuna.create_study(
        study_name="cifar10-ddp", storage=f"sqlite:///{sweep_dir}/optuna.db", direction="maximize"
    )  # as a search with other epochs left it
    earlier.set_user_attr("fixed_overrides", ["hparams_search=optuna", "trainer.max_epochs=5"])
    result = train("-m", "hparams_search=optuna", "trainer.max_epochs=2", f"hydra.sweep.dir={sweep_dir}", timeout=120)
    assert result.returncode == 2, output(result)[-3000:]
    assert result.stderr.strip() == (
        f"error: hydra.sweep.dir={sweep_dir} holds the study of another search: its "
        "trials ran with trainer.max_epochs=5 where this search has trainer.max_epochs=2; "
        "pass a new hydra.sweep.dir to start another search, or the same overrides to go "
        "on with that one"
    )


@pytest.mark.parametrize(
    "settings, words",
    [
        (
            {"direction": "up"},
            "hydra.sweeper.direction=up must be maximize",
        ),  # before: optuna's ValueError, a traceback
        ({"n_trials": 2.5}, "hydra.sweeper.n_trials=2.5 must be a whole number >= 1"),
        ({"storage": "foo://x"}, "hydra.sweeper.storage=foo://x cannot be opened (NoSuchModuleError"),  # SQLAlchemy's
        ({"storage": "sqlite:////nonexistent/x.db"}, "hydra.sweeper.storage=sqlite:////nonexistent/x.db cannot be"),
        # before: "full_key: sampler", "change the offending pruner.* value": the node without its place
        (
            {"sampler": {"_target_": "optuna.samplers.Nope"}},
            "hydra.sweeper.sampler: Error locating target 'optuna.samplers.Nope': change hydra.sweeper.sampler.*",
        ),
        (
            {"pruner": {"_target_": "optuna.pruners.MedianPruner", "n_warmup_steps": -3}},
            "hydra.sweeper.pruner: Number of warmup steps cannot be negative, but got n_warmup_steps=-3: change",
        ),
    ],
)
def test_the_sweepers_own_values_are_one_line_naming_the_key_before_any_trial(settings, words, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from src.sweeps.hparams_search import OptunaSweeper

    # the trials' values are composed with Hydra's context of a real search: checked by the refusal test above
    monkeypatch.setattr(OptunaSweeper, "_check_trials", lambda *_: None)
    sweeper = OptunaSweeper(**{"n_trials": 1, "params": {"model.optimizer.lr": "interval(0.01, 0.5)"}, **settings})
    config = {"trainer": {"num_nodes": 1}, "hydra": {"sweep": {"dir": str(tmp_path)}}, "search": {}}
    sweeper.config = OmegaConf.create(config)  # search: what hparams_search=optuna adds, whose sweeper this is
    with pytest.raises(UserError) as refused:
        sweeper.sweep([])
    assert str(refused.value).startswith(words)
    assert not (tmp_path / "optuna.db").exists() or "storage" not in settings
