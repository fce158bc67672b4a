"""``python -m src.slurm_sweep [sbatch options] -- OVERRIDES``: a Hydra sweep as Slurm jobs, one allocation each.

    python -m src.slurm_sweep -- trainer.devices=1,2,4 trainer.max_epochs=5
    python -m src.slurm_sweep --gpus-per-node=0 -- trainer.devices=1,2 trainer.accelerator=cpu backend=gloo

The overrides are expanded as ``python -m src.train -m`` would (Hydra's own sweep syntax). Every job
is ``sbatch slurm/train.sbatch`` with ``--nodes`` = its ``trainer.num_nodes`` and ``--ntasks-per-node``
= its ``trainer.devices`` (and ``--gpus-per-node`` the same, unless you pass one), writing into
``outputs/slurm/sweeps/<time>/<k>/`` (``SWEEP_DIR=...`` to choose). A last job, started when all of them
have ended, writes the scaling report there (``src.sweeps.report``). hydra-submitit-launcher would size every job
like the first (it resolves its resources once per sweep), so the jobs are submitted here instead.

Run again with the same ``SWEEP_DIR`` and overrides, it resumes the sweep: a job that finished (its
``result.json``) or that Slurm still holds (pending, running) is not submitted again; the others are, and
resume from their own ``last.ckpt`` (slurm/train.sbatch passes ``ckpt_path=auto``). ``jobs.json`` in the sweep
dir records each job's overrides and Slurm job id.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from src.core.errors import UserError, hydra_error_message, one_line, print_line
from src.core.settings import check_no_empty_paths, check_values, hydra_config_of
from src.launch.run_dir import RESULT_FILE, read_result, write_json
from src.sweeps.sweep import check_grid, check_task_values, distinct

SBATCH_SCRIPT = "slurm/train.sbatch"
JOBS_FILE = "jobs.json"
HELD = ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "COMPLETING")
USAGE = "python -m src.slurm_sweep [sbatch options] -- trainer.devices=1,2 ..."
SIZE_KEYS = {"trainer.devices": "--ntasks-per-node", "trainer.num_nodes": "--nodes"}


def expand(overrides: list[str]) -> list[list[str]]:
    """Every job's overrides, in the order ``-m`` would run them."""
    check_grid(overrides)
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def sbatch_command(job: list[str], run_dir: Path, sbatch_options: list[str]) -> list[str]:
    """The sbatch call for one job: its allocation sized from its own trainer.devices / trainer.num_nodes."""
    values = dict(o.split("=", 1) for o in job if "=" in o)
    devices, nodes = values.get("trainer.devices", "1"), values.get("trainer.num_nodes", "1")
    if not (devices.isdigit() and nodes.isdigit() and int(devices) >= 1 and int(nodes) >= 1):
        raise ValueError(
            f"trainer.devices={devices} / trainer.num_nodes={nodes}: a Slurm sweep needs whole numbers >= 1"
        )
    sizing = [f"--nodes={nodes}", f"--ntasks-per-node={devices}"]
    if not any(o.startswith("--gpus-per-node") for o in sbatch_options):
        sizing.append(f"--gpus-per-node={devices}")
    # the allocation sets trainer.devices / trainer.num_nodes (slurm/train.sbatch), so they are not repeated
    rest = [o for o in job if o.split("=", 1)[0] not in SIZE_KEYS]
    return ["sbatch", "--parsable", *sizing, f"--export=ALL,RUN_DIR={run_dir}", *sbatch_options, SBATCH_SCRIPT, *rest]


def check_jobs(jobs: list[list[str]]) -> str | None:
    """Every job's config composed as its run will compose it, with the values every command checks as it starts
    (src/core/settings.py) and those building its data and model checks, before the first is submitted; what is
    wrong, in words, or None. A misspelled key, a group's unknown option or a refused value was each found by a job
    that had queued for its allocation."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        for k, job in enumerate(jobs):
            try:
                config = compose(config_name="train", overrides=job, return_hydra_config=True)
                with hydra_config_of(config):  # the data's paths name ${hydra:runtime.cwd}
                    check_values(config)
                    check_no_empty_paths(config)  # paths.checkpoints is not checked: the jobs' nodes have their own
                    check_task_values(config)
            except Exception as err:  # noqa: BLE001 - Hydra's and the checks' refusals, in their words
                said = hydra_error_message(err)
                if said is None:
                    raise
                return f"job {k} ({' '.join(distinct(job, jobs))}): {one_line(said)}; no job was submitted"
    return None


def submit(cmd: list[str]) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:  # sbatch's lines as one (a controller out of reach says four)
        said = "; ".join(line.strip() for line in result.stderr.strip().splitlines() if line.strip())
        raise RuntimeError(f"{shlex.join(cmd)} failed: {said or f'exit status {result.returncode}'}")
    return result.stdout.strip().split(";")[0]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sbatch_options, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else ([], argv)
    if {"-h", "--help"} & set(sbatch_options if "--" in argv else argv):
        print((__doc__ or "").replace("``", ""))
        return 0
    options = [o for o in overrides if o.startswith("-")] if "--" not in argv else []
    if options:
        print(
            f"error: {options[0]} is not an override: sbatch options go before --, the overrides after it: {USAGE}",
            file=sys.stderr,
        )
        return 2
    if not overrides:
        print(f"error: no overrides to sweep: {USAGE}", file=sys.stderr)
        return 2
    try:
        jobs = expand(overrides)
    except UserError as err:
        print_line(f"error: {err}")
        return 2
    except Exception as err:  # noqa: BLE001 - Hydra's parser errors are the user's to fix
        print(f"error: cannot expand the sweep: {err}", file=sys.stderr)
        return 2
    sweep_dir = Path(os.environ.get("SWEEP_DIR") or f"outputs/slurm/sweeps/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    try:  # every job's sizes before the first is submitted: none is left queued by a refusal of a later one
        for k, job in enumerate(jobs):
            sbatch_command(job, sweep_dir / str(k), sbatch_options)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    refused = check_jobs(jobs)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    made = not sweep_dir.exists()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    record = sweep_dir / JOBS_FILE
    earlier = json.loads(record.read_text())["jobs"] if record.is_file() else []
    if earlier and [j["overrides"] for j in earlier] != jobs:
        print(
            f"error: SWEEP_DIR={sweep_dir} holds another sweep ({record} lists other jobs): pass a new SWEEP_DIR to "
            "start another sweep, or the same overrides to go on with that one",
            file=sys.stderr,
        )
        return 2
    ids = [j.get("slurm_job") for j in earlier] or [None] * len(jobs)
    waiting = []  # the Slurm jobs the report waits for
    try:
        for k, job in enumerate(jobs):
            if read_result(sweep_dir / str(k)) is not None:
                print(
                    f"job {k}: finished in an earlier run of this sweep ({sweep_dir / str(k) / RESULT_FILE}): "
                    "not submitted again"
                )
                continue
            state = slurm_state(ids[k]) if ids[k] else ""
            if state in HELD:
                print(f"job {k}: Slurm job {ids[k]} is still {state.lower()}: not submitted again")
                waiting.append(ids[k])
                continue
            ids[k] = submit(sbatch_command(job, sweep_dir / str(k), sbatch_options))
            waiting.append(ids[k])
            print(f"job {k}: Slurm job {ids[k]}: {' '.join(job)}")
            _record(record, jobs, ids)
        dependency = [f"--dependency=afterany:{':'.join(waiting)}"] if waiting else []
        report = submit(
            [
                "sbatch",
                "--parsable",
                *dependency,
                "--nodes=1",
                "--ntasks=1",
                f"--output={sweep_dir}/report.out",
                "--job-name=scaling-report",
                "--wrap",
                f"{shlex.quote(os.environ.get('PYTHON', '.venv/bin/python'))} -m src.sweeps.report "
                f"{shlex.quote(str(sweep_dir))}",
            ]
        )
    except (RuntimeError, ValueError) as err:
        for job_id in waiting:
            subprocess.run(["scancel", job_id], check=False)
        if made and not any(sweep_dir.iterdir()):  # nothing was submitted: no empty sweep dir left behind
            sweep_dir.rmdir()
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report: Slurm job {report}, when all {len(waiting)} job(s) of this run have ended: {sweep_dir}/scaling.md")
    print(f"sweep dir: {sweep_dir} (run this command again with SWEEP_DIR={sweep_dir} to resume the sweep)")
    return 0


def slurm_state(job_id: str) -> str:
    """What Slurm says of a job ('PENDING', 'RUNNING', 'COMPLETED', ...); '' once it has forgotten it."""
    result = subprocess.run(["squeue", "--noheader", "--jobs", job_id, "--format=%T"], capture_output=True, text=True)
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else ""


def _record(path: Path, jobs: list[list[str]], ids: list[str | None]) -> None:
    """jobs.json: every job's overrides and its latest Slurm job id (written after each submission)."""
    write_json(
        path, {"jobs": [{"num": k, "overrides": job, "slurm_job": i} for k, (job, i) in enumerate(zip(jobs, ids))]}
    )


if __name__ == "__main__":
    sys.exit(main())
