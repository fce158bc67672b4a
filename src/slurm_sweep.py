"""``python -m src.slurm_sweep [sbatch options] -- OVERRIDES``: a Hydra sweep as Slurm jobs, one allocation each.

    python -m src.slurm_sweep -- trainer.devices=1,2,4 trainer.max_epochs=5
    python -m src.slurm_sweep --gpus-per-node=0 -- trainer.devices=1,2 trainer.accelerator=cpu backend=gloo

The overrides are expanded as ``python -m src.train -m`` would (Hydra's own sweep syntax). Every job
is ``sbatch slurm/train.sbatch`` with ``--nodes`` = its ``trainer.num_nodes`` and ``--ntasks-per-node``
= its ``trainer.devices`` (and ``--gpus-per-node`` the same, unless you pass one), writing into
``outputs/slurm/sweeps/<time>/<k>/``. A last job, started when all of them have ended, writes the
scaling report there (``src.report``). hydra-submitit-launcher would size every job like the first
(it resolves its resources once per sweep), so the jobs are submitted here instead.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

SBATCH_SCRIPT = "slurm/train.sbatch"
SIZE_KEYS = {"trainer.devices": "--ntasks-per-node", "trainer.num_nodes": "--nodes"}


def expand(overrides: list[str]) -> list[list[str]]:
    """Every job's overrides, in the order ``-m`` would run them."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def sbatch_command(job: list[str], run_dir: Path, sbatch_options: list[str]) -> list[str]:
    """The sbatch call for one job: its allocation sized from its own trainer.devices / trainer.num_nodes."""
    values = dict(o.split("=", 1) for o in job if "=" in o)
    devices, nodes = values.get("trainer.devices", "1"), values.get("trainer.num_nodes", "1")
    if not (devices.isdigit() and nodes.isdigit()):
        raise ValueError(f"trainer.devices={devices} / trainer.num_nodes={nodes}: a Slurm sweep needs whole numbers")
    sizing = [f"--nodes={nodes}", f"--ntasks-per-node={devices}"]
    if not any(o.startswith("--gpus-per-node") for o in sbatch_options):
        sizing.append(f"--gpus-per-node={devices}")
    # the allocation sets trainer.devices / trainer.num_nodes (slurm/train.sbatch), so they are not repeated
    rest = [o for o in job if o.split("=", 1)[0] not in SIZE_KEYS]
    return ["sbatch", "--parsable", *sizing, f"--export=ALL,RUN_DIR={run_dir}", *sbatch_options, SBATCH_SCRIPT, *rest]


def submit(cmd: list[str]) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed: {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sbatch_options, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    if not overrides:
        print("error: no overrides to sweep: python -m src.slurm_sweep [sbatch options] -- trainer.devices=1,2 ...",
              file=sys.stderr)
        return 2
    try:
        jobs = expand(overrides)
    except Exception as err:  # noqa: BLE001 - Hydra's parser errors are the user's to fix
        print(f"error: cannot expand the sweep: {err}", file=sys.stderr)
        return 2
    sweep_dir = Path(os.environ.get("SWEEP_DIR") or f"outputs/slurm/sweeps/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    ids = []
    try:
        for k, job in enumerate(jobs):
            ids.append(submit(sbatch_command(job, sweep_dir / str(k), sbatch_options)))
            print(f"job {k}: Slurm job {ids[-1]}: {' '.join(job)}")
        report = submit(["sbatch", "--parsable", f"--dependency=afterany:{':'.join(ids)}", "--nodes=1", "--ntasks=1",
                         f"--output={sweep_dir}/report.out", "--job-name=scaling-report",
                         "--wrap", f"{shlex.quote(os.environ.get('PYTHON', '.venv/bin/python'))} -m src.report "
                                   f"{shlex.quote(str(sweep_dir))}"])
    except (RuntimeError, ValueError) as err:
        for job_id in ids:
            subprocess.run(["scancel", job_id], check=False)
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report: Slurm job {report}, when all {len(ids)} jobs have ended: {sweep_dir}/scaling.md")
    print(f"sweep dir: {sweep_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
