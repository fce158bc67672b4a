"""What torch.compile did in a real run: ``+callbacks.compile_probe._target_=tests.compile_probe.CompileProbe``.

Writes ``compile_rankN.json`` into ``out`` when testing ends: dynamo's count of compiled graphs after each training
epoch and after the test, inductor's cache hits and misses, and DDPOptimizer's line when it split a graph at DDP's
gradient buckets (so that each bucket's all-reduce starts while the backward pass goes on).

The ranks of the run compile in turns (a lock in ``out``): each graph is compiled by the rank that comes to it first,
and the other rank finds it in inductor's cache (the run's ``TORCHINDUCTOR_CACHE_DIR``, one folder for the
machine's ranks, as it is by default). Side by side, both ranks compiled every graph at the same time, each missing
the cache: tests/test_compile.py's run alone on a 2-core Intel Xeon with AMX, inductor's cache empty, took 75 CPU s
that way and 61 CPU s in turns (59 s and 57 s of wall time). What is compiled, and how often, is the same; a rank
that loads its graphs from the cache, as every rank of a run after the first does, is proven beside one that
compiles them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import lightning as L


class CompileProbe(L.Callback):
    def __init__(self, out: str) -> None:
        # one compile thread in each rank: with inductor's default (one per core) each rank starts a pool of compile
        # workers, a process that imports torch again, and on 2 cores both ranks' pools only take turns with the
        # ranks themselves (tests/test_compile.py alone, inductor's cache empty, the AMD EPYC with AVX2: 180 CPU s
        # for the machine against 202 with the pools; 121 s against 114 s of wall time). What is compiled, and how
        # often, is the same: the kernels are built in the rank instead of beside it.
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1
        # scalar C++ kernels, not inductor's vectorized ones (AVX2, AVX-512): the same graphs, fused into the same
        # kernels, and DDP's same buckets; each kernel's g++ build is shorter (the AMD EPYC with AVX2, the test alone,
        # inductor's cache empty, the two in turns twice: 121 s and 115 s of wall time, 166 and 156 CPU s vectorized;
        # 102 s and 97 s, 141 and 133 CPU s scalar). What inductor's vectorized code computes is torch's to test.
        torch._inductor.config.cpp.vec_isa_ok = False
        self.out = Path(out)
        _compile_in_turns(self.out / "compile.lock")
        self.marks: list[dict[str, object]] = []
        self.ddp_optimizer: list[str] = []
        self._handler: logging.Handler | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._handler is None:
            self._handler = logging.Handler()
            self._handler.emit = lambda record: self.ddp_optimizer.append(record.getMessage().strip())
            logger = logging.getLogger("torch._dynamo.backends.distributed")
            logger.addHandler(self._handler)
            logger.setLevel(logging.INFO)

    def _mark(self, at: str) -> None:
        from torch._dynamo.utils import counters

        self.marks.append(
            {
                "at": at,
                "graphs": counters["stats"]["unique_graphs"],
                "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
                "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
                "cache_misses": counters["inductor"]["fxgraph_cache_miss"],
            }
        )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark(f"epoch {trainer.current_epoch}")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark("test")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"compile_rank{trainer.global_rank}.json").write_text(
            json.dumps({"marks": self.marks, "ddp_optimizer": self.ddp_optimizer}, indent=1) + "\n"
        )


def _compile_in_turns(lock: Path) -> None:
    """Inductor's compiles (the AOT graphs of a frame, and each backward graph when it is first run) hold ``lock``:
    one rank of the machine compiles at a time. Nothing that waits for another rank runs inside a compile."""
    import torch._inductor.compile_fx as compile_fx

    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)  # for this process's life
    mine = threading.RLock()  # a frame's compile holds the turn while its graphs compile
    depth = 0

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        nonlocal depth
        with mine:
            if depth == 0:
                fcntl.flock(fd, fcntl.LOCK_EX)
            depth += 1
            try:
                yield
            finally:
                depth -= 1
                if depth == 0:
                    fcntl.flock(fd, fcntl.LOCK_UN)

    frame_compile, graph_compile = compile_fx.compile_fx, compile_fx.compile_fx_inner

    def graph_in_turn(*args: Any, **kwargs: Any) -> Any:
        with turn():
            return graph_compile(*args, **kwargs)

    # dynamo's inductor backend looks compile_fx up as it calls it; the graphs' compiler is its argument
    def frame_in_turn(model: Any, inputs: Any, inner_compile: Any = graph_in_turn, *args: Any, **kwargs: Any) -> Any:
        with turn():
            return frame_compile(model, inputs, inner_compile, *args, **kwargs)

    compile_fx.compile_fx = frame_in_turn
