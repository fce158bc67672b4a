"""What torch.compile did in a real run: ``+callbacks.compile_probe._target_=tests.compile_probe.CompileProbe``.

Writes ``compile_rankN.json`` into ``out`` when testing ends: dynamo's count of compiled graphs after each training
epoch and after the test, and DDPOptimizer's line when it split a graph at DDP's gradient buckets (so that each
bucket's all-reduce starts while the backward pass goes on).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

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
