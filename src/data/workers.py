"""What a DataLoader's worker process loads, and how workers start: the dataset of uint8 tensors, its transforms, the
start method. Light on purpose (torch and torchvision, not Lightning): a forkserver imports it once per rank, then forks
each worker from itself.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

# Per-channel statistics of the CIFAR-10 training set (R, G, B), used for both datasets here.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

# The first release of each CPython line whose forked child resets the interpreter's thread-state lock before taking
# it (cpython#112275); 3.12 and later have it.
FORK_SAFE_FROM = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}
QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


def fork_can_hang(version: tuple[int, ...] = tuple(sys.version_info[:3]), name: str = sys.implementation.name) -> bool:
    """Whether this Python's ``fork`` can leave the child stuck for good where another thread held the interpreter's
    thread-state lock at that moment: CPython before 3.10.15 and 3.11.10 (cpython#112275). A process group's threads
    take that lock without the GIL whenever they drop the last reference to one of Python's tensors (gloo's after an
    all-gather), so a loader's worker forked beside them can hang in its first instant, before any code of its own."""
    if name != "cpython":
        return False
    fixed = FORK_SAFE_FROM.get(tuple(version[:2]))
    return fixed is not None and tuple(version) < fixed


class ImageTensors(Dataset):
    """uint8 images (N, 3, H, W) and int64 labels, transformed one item at a time."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: v2.Transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[index]), self.labels[index]


def train_transform(image_size: int, augment: bool) -> v2.Transform:
    """Random crop with 4-pixel zero padding and horizontal flip, then normalisation."""
    steps = [v2.RandomCrop(image_size, padding=4), v2.RandomHorizontalFlip()] if augment else []
    return v2.Compose([*steps, *eval_transform().transforms])


def eval_transform() -> v2.Compose:
    """uint8 -> float in [0, 1] -> normalised with CIFAR-10's channel statistics."""
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR10_MEAN, CIFAR10_STD)])


def start_worker(worker_id: int) -> None:
    """What each loader worker does first (torch's ``worker_init_fn``): it leaves Ctrl-C to its rank, and ends with
    it, at once and quietly.

    A terminal's Ctrl-C reaches every process of its group, the workers too: torch's ended at once, and the ranks'
    stop at one step (src/callbacks/graceful_stop.py) met a loader without workers, a failed run instead of a stop.
    The rank stops its workers as it ends.

    The kernel ends it with its parent: the rank, or the rank's forkserver. A forkserver's worker also lets go of the
    pipe whose end tells the server its rank is gone (multiprocessing hands every process the server forks that
    pipe, for processes of its own): held, a rank killed outright left its server and workers running for good, as
    the server waited for that end and torch's workers watch only their parent (every 5 s, the fallback). A worker
    hands each batch's shared memory to its rank through a thread of multiprocessing's; a rank killed while it
    fetched one made that thread print a traceback after the run's one error line.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    threading.excepthook = _quiet_hang_ups


def _quiet_hang_ups(args: threading.ExceptHookArgs) -> None:
    """Nothing for a rank gone while it fetched a batch from this worker (which the kernel is about to end)."""
    frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback is not None else []
    sharer = any(frame.filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")) for frame in frames)
    if not (sharer and issubclass(args.exc_type, (ConnectionError, EOFError))):
        threading.__excepthook__(args)


def worker_context(method: str) -> Any:
    """The multiprocessing context loader workers start with: ``fork``, ``forkserver`` or ``spawn``."""
    context = multiprocessing.get_context(method)
    if method != "fork":
        # A failed run ends its ranks at once; multiprocessing's resource tracker (a process these start methods
        # start) then removes the semaphores of their loaders' queues, with a warning a rank after the run's one
        # error line. The tracker takes this interpreter's -W options.
        if QUIET_TRACKER not in sys.warnoptions:
            sys.warnoptions.append(QUIET_TRACKER)
    if method == "forkserver":
        context.set_forkserver_preload([__name__])  # imported once by the server, not by each worker it forks
    return context
