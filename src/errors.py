"""Errors a user can cause, and how an entry point reports them: one line, non-zero exit."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

from lightning.fabric.utilities.exceptions import MisconfigurationException

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the command line, config, data or environment that the user can fix."""


def user_error_in(err: BaseException) -> BaseException | None:
    """The UserError (or Lightning's MisconfigurationException) behind ``err``, through Hydra's wrapping."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (UserError, MisconfigurationException)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def exit_on_user_error(task: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a user's mistake into one ``error:`` line and exit code 2 (HYDRA_FULL_ERROR=1 keeps the traceback)."""

    @functools.wraps(task)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return task(*args, **kwargs)
        except Exception as err:
            cause = user_error_in(err)
            if cause is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {cause}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper
