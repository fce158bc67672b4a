"""The scaling report of a sweep: ``python -m src.sweeps.report SWEEP_DIR`` (also written when a sweep ends).

Reads each job's ``throughput.json`` (or ``failure.json``) and ``.hydra/overrides.yaml``, and writes
``scaling.csv``, ``scaling.md`` and ``scaling.png`` into the sweep dir. Jobs that differ only in their
world size (``trainer.devices``, ``trainer.num_nodes``) form one series; each series' speedup and
efficiency are measured against its smallest world size.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from src.core.errors import print_line, storage_error_in, write_fix

WORLD_KEYS = ("trainer.devices", "trainer.num_nodes")
COLUMNS = [
    "job",
    "series",
    "num_nodes",
    "devices",
    "world_size",
    "per_device_batch_size",
    "global_batch_size",
    "samples_per_second",
    "samples_per_second_per_device",
    "speedup",
    "efficiency",
    "step_time_s",
    "epoch_time_s",
    "peak_memory_mb",
    "strategy",
    "backend",
    "precision",
    "device_name",
]


@dataclass
class Job:
    """One job dir of a sweep: its number, what it overrode, and what it measured or why it failed."""

    num: int
    overrides: dict[str, str]
    record: dict | None = None
    error: str | None = None
    series: str = "all"
    derived: dict = field(default_factory=dict)


def load_jobs(sweep_dir: Path) -> list[Job]:
    """Every numbered job dir under ``sweep_dir``, in job order."""
    jobs = []
    for job_dir in sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    ):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        listed = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        overrides = dict(o.split("=", 1) for o in listed or [] if "=" in o and not o.startswith("hydra."))
        job = Job(num=int(job_dir.name), overrides=overrides)
        if (job_dir / "throughput.json").is_file():
            job.record = json.loads((job_dir / "throughput.json").read_text())
        elif (job_dir / "failure.json").is_file():
            job.error = json.loads((job_dir / "failure.json").read_text())["error"]
        else:
            job.error = "no throughput.json: the job did not finish (see its log)"
        jobs.append(job)
    swept = sorted(
        {k for j in jobs for k in j.overrides if k not in WORLD_KEYS and len({o.overrides.get(k) for o in jobs}) > 1}
    )
    for job in jobs:  # a series: the jobs that differ only in world size
        job.series = " ".join(f"{k}={job.overrides.get(k)}" for k in swept) or "all"
    return jobs


def common_overrides(jobs: list[Job]) -> str:
    """The overrides every job of the sweep shared."""
    shared = set.intersection(*(set(j.overrides.items()) for j in jobs)) if jobs else set()
    return " ".join(f"{k}={v}" for k, v in sorted(shared))


def scaling_mode(jobs: list[Job]) -> str:
    """weak: per-device batch fixed as the world grows; strong: global batch fixed."""
    if len({j.record["world_size"] for j in jobs}) < 2:
        return "single world size"
    if len({j.record["per_device_batch_size"] for j in jobs}) == 1:
        return "weak scaling (per-device batch fixed)"
    if len({j.record["global_batch_size"] for j in jobs}) == 1:
        return "strong scaling (global batch fixed)"
    return "mixed (neither per-device nor global batch fixed)"


def analyse(jobs: list[Job]) -> dict[str, list[Job]]:
    """Group finished jobs into series and fill in speedup and efficiency against each series' smallest world."""
    series: dict[str, list[Job]] = {}
    for job in jobs:
        if job.record is not None:
            series.setdefault(job.series, []).append(job)
    for members in series.values():
        members.sort(key=lambda j: j.record["world_size"])
        base = members[0].record
        for job in members:
            speedup = job.record["samples_per_second"] / base["samples_per_second"]
            job.derived = {"speedup": speedup, "efficiency": speedup / (job.record["world_size"] / base["world_size"])}
    return series


def write_report(sweep_dir: Path) -> list[Job]:
    """Write scaling.csv, scaling.md and scaling.png (once a job finished) into ``sweep_dir``; return the jobs it
    read."""
    jobs = load_jobs(sweep_dir)
    if not jobs:
        raise FileNotFoundError(f"{sweep_dir} holds no job dirs (0/, 1/, ...): is it a sweep dir?")
    series = analyse(jobs)
    rows = [_row(job) for members in series.values() for job in members]
    with open(sweep_dir / "scaling.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (sweep_dir / "scaling.md").write_text(_markdown(jobs, series))
    if series:  # else no job finished: nothing to draw, and scaling.md says why each failed
        _plot(series, sweep_dir / "scaling.png")
    return jobs


def write_report_or_end(sweep_dir: Path) -> list[Job]:
    """``write_report``; where the filesystem refuses it (a full disk, a folder not writable), one ``error:`` line
    that names the command to write it again, and exit 1: each job's results stay in its dir."""
    try:
        return write_report(sweep_dir)
    except OSError as err:
        refused = storage_error_in(err)
        if refused is None:
            raise
    print_line(
        f"error: cannot write the scaling report into {sweep_dir} ({refused.strerror or refused}): each job's results "
        f"stay in its dir; {write_fix(refused)}, then python -m src.sweeps.report {sweep_dir}"
    )
    sys.exit(1)


def _row(job: Job) -> dict:
    r = job.record
    row = {k: r.get(k) for k in COLUMNS if k in r}
    return {**row, "job": job.num, "series": job.series, **job.derived}


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def _markdown(jobs: list[Job], series: dict[str, list[Job]]) -> str:
    finished = [j for j in jobs if j.record]
    hardware = sorted({f"{j.record['device_name']} on {', '.join(j.record['hosts'])}" for j in finished})
    lines = ["# Scaling report", ""]
    lines.append(f"Hardware: {'; '.join(hardware) or 'n/a'}  ")
    setups = sorted({f"{j.record['strategy']}/{j.record['backend']}, {j.record['precision']}" for j in finished})
    lines.append(f"Strategy/backend, precision: {'; '.join(setups) or 'n/a'}  ")
    lines.append(f"Jobs: {len(jobs)} ({len(finished)} finished, {len(jobs) - len(finished)} failed)  ")
    lines.append(f"Every job: `{common_overrides(jobs) or '(defaults)'}`")
    lines.append("")
    for name, members in series.items():
        title = "all jobs" if name == "all" else name
        lines += [
            f"## {title}: {scaling_mode(members)}",
            "",
            "| job | nodes | devices | world size | global batch | samples/s | samples/s per device "
            "| speedup | efficiency |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for job in members:
            r = job.record
            lines.append(
                f"| {job.num} | {r['num_nodes']} | {r['devices']} | {r['world_size']} | "
                f"{r['global_batch_size']} | {_fmt(r['samples_per_second'])} | "
                f"{_fmt(r['samples_per_second_per_device'])} | {_fmt(job.derived['speedup'], 2)}x | "
                f"{_fmt(100 * job.derived['efficiency'], 0)}% |"
            )
        lines.append("")
    failed = [j for j in jobs if j.record is None]
    if failed:
        lines += ["## Failed jobs", ""]
        lines += [f"- job {j.num} ({' '.join(f'{k}={v}' for k, v in j.overrides.items())}): {j.error}" for j in failed]
        lines.append("")
    lines += [
        "Speedup: samples/s over the series' smallest world size. Efficiency: speedup divided by the growth",
        "in world size (100% is linear scaling). Samples/s is the steady state: warm-up steps excluded.",
        "",
    ]
    return "\n".join(lines)


def plot_title(finished: list[Job]) -> str:
    """What every plotted job shared: network, devices and their count, backend, precision, per-device batch.

    A setting the jobs differ in is left out here: the series (the legend) are named by it.
    """

    def common(key: str) -> str | None:
        values = {str(j.record[key]) for j in finished if j.record.get(key) is not None}
        return values.pop() if len(values) == 1 else None

    if not finished:
        return "no job finished"

    def span(key: str) -> tuple[str, int]:  # ('1–8', 8), or ('2', 2) where every job had the same
        values = sorted({j.record[key] for j in finished})
        return "–".join(str(v) for v in dict.fromkeys((values[0], values[-1]))), values[-1]

    worlds, _ = span("world_size")
    nodes, most_nodes = span("num_nodes")
    device = common("device_name") or "mixed devices"
    where = f"{worlds} x {device}" if common("accelerator") == "cuda" else f"{worlds} processes on {device}"
    if most_nodes > 1:
        where += f", {nodes} nodes"
    batch = common("per_device_batch_size")
    parts = [common("arch"), where, common("backend"), common("precision"), batch and f"batch {batch} per device"]
    return " · ".join(p for p in parts if p)


def _plot(series: dict[str, list[Job]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, members in series.items():
        ws = [j.record["world_size"] for j in members]
        tp = [j.record["samples_per_second"] for j in members]
        label = "measured" if len(series) == 1 else name  # one series: nothing but the world size differs
        (line,) = ax_tp.plot(ws, tp, "o-", label=label)
        ax_tp.plot(
            ws,
            [tp[0] * w / ws[0] for w in ws],
            "--",
            color=line.get_color(),
            alpha=0.5,
            label="ideal linear" if len(series) == 1 else f"ideal linear ({name})",
        )
        ax_eff.plot(ws, [100 * j.derived["efficiency"] for j in members], "o-", color=line.get_color(), label=label)
    title = plot_title([j for members in series.values() for j in members])
    fig.suptitle(title, fontsize=10)
    ax_tp.set(xlabel="world size (processes)", ylabel="samples/s (global)", title="Throughput")
    ax_eff.set(xlabel="world size (processes)", ylabel="efficiency (%)", title="Scaling efficiency", ylim=(0, 110))
    ax_eff.axhline(100, ls="--", color="grey", alpha=0.5)
    worlds = sorted({j.record["world_size"] for members in series.values() for j in members})
    for ax in (ax_tp, ax_eff):
        ax.set_xticks(worlds)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    legend = [text.get_text() for text in ax_tp.get_legend().get_texts()] if ax_tp.get_legend() else []
    fig.savefig(path, dpi=110, metadata={"Title": title, "Description": "series: " + "; ".join(legend)})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.sweeps.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a finished sweep's dir (outputs/multirun/<date>/<time>)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(
            f"error: {args.sweep_dir} is not a directory: pass a sweep dir such as outputs/multirun/<date>/<time>",
            file=sys.stderr,
        )
        return 2
    try:
        jobs = write_report_or_end(args.sweep_dir)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = sum(j.record is None for j in jobs)
    print(f"scaling report: {args.sweep_dir}/scaling.md ({len(jobs)} jobs, {failed} failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
