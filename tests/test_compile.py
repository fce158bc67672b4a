"""model.compile=true: the network is compiled once per process, for training and for evaluation, and never again
(not for the last, smaller batch of validation or test, not for the test after fit), and under DDP the compiled
backward still hands each gradient bucket to the all-reduce as soon as it is ready. Inductor runs on the CPU too, and
the ranks of a machine share its cache: what one rank compiled, the other loads (tests/compile_probe.py)."""

from __future__ import annotations

import json

from tests.conftest import output, train

# 100 training images: 80 to train (3 steps of 8 per rank an epoch), 20 to validate (last batch smaller), 20 to test
COMPILED = [
    "data=synthetic",
    "data.num_train=100",
    "data.val_size=20",
    "data.num_test=20",
    "data.batch_size=8",
    "model.arch=resnet18",
    # the narrow network of the FAST runs: the same graphs and kernels, a 16th of the parameters, and with DDP's
    # buckets of 1 MB (not 25) three of them, as the full width has two
    "model.width=16",
    "model.stem=imagenet",
    "+strategy.bucket_cap_mb=1",
    "model.compile=true",
    # the graphs and DDP's buckets do not depend on the number format; bf16 autocast, which auto picks on a CPU with
    # native bf16, adds the casts' kernels: 84.6 CPU s for this test against 66.5 in fp32, inductor's cache empty
    "trainer.precision=32-true",
    "trainer.accelerator=cpu",
    "strategy=ddp",
    "trainer.devices=2",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=3",
    "trainer.enable_model_summary=false",
    "+callbacks.compile_probe._target_=tests.compile_probe.CompileProbe",
]


def test_two_compiled_ddp_epochs_and_the_test_compile_one_training_and_one_evaluation_graph(tmp_path):
    result = train(*COMPILED, f"hydra.run.dir={tmp_path}", f"+callbacks.compile_probe.out={tmp_path}", timeout=900)
    assert result.returncode == 0, output(result)[-3000:]
    assert "test accuracy" in output(result)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"compile_rank{rank}.json").read_text())
        # evaluation (the sanity check, then every validation and the test) and training: two graphs, from the
        # first epoch on; a recompile for a smaller batch, or for test's inference mode, would add one
        assert [(m["at"], m["graphs"]) for m in record["marks"]] == [("epoch 0", 2), ("epoch 1", 2), ("test", 2)]
        # each graph was split at DDP's buckets (the graph was compiled inside DDP's forward)
        buckets = [line for line in record["ddp_optimizer"] if line.startswith("DDPOptimizer used bucket cap")]
        assert len(buckets) == 2 and all("created 1 buckets" not in line for line in buckets), record
    # each of a rank's graphs (the buckets' forward and backward parts) compiled once for the machine: the rank that
    # came to it second found it in inductor's cache
    ends = [json.loads((tmp_path / f"compile_rank{rank}.json").read_text())["marks"][-1] for rank in (0, 1)]
    graphs = [end["cache_hits"] + end["cache_misses"] for end in ends]
    assert graphs[0] == graphs[1] > 2 and sum(end["cache_misses"] for end in ends) == graphs[0], ends
