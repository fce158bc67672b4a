"""What ``logger=mlflow`` and ``logger=wandb`` need from outside the run, checked before any other process starts.

A tracking server that does not answer would otherwise cost minutes and end in a cryptic error: MLflow retried a
closed port for 4 min 18 s (mlflow 3.17), then failed with a multi-line exception; W&B, online with a key and no way to
its server, gave up after 2 min with ``CommError: Failed to get resume status ...: context deadline exceeded``.
Here it is one ``error:`` line within seconds. Any HTTP answer will do (even 401 or 404): what a server says of
the run's requests is its client's to report.

Light on purpose (no Lightning, no torch): src/cli/entry.py runs these checks before the local ranks start.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from typing import Any

from src.core.errors import UserError

WANDB_DEFAULT_URL = "https://api.wandb.ai"


def check_servers(loggers: Any, timeout_s: float = 10) -> None:
    """The tracking servers the chosen loggers will talk to answer (a SQLite store or an offline run needs none)."""
    if "mlflow" in loggers:
        uri = loggers.mlflow.get("tracking_uri")
        if uri and uri.startswith(("http://", "https://")):
            why = unreachable(uri, timeout_s)
            if why:
                raise UserError(
                    f"logger.mlflow.tracking_uri={uri}: no MLflow server answers there ({why}): start it "
                    "(mlflow server --host 0.0.0.0 --port 5000), or leave tracking_uri out to log to "
                    "outputs/mlflow.db"
                )
    offline = loggers.wandb.get("offline", "auto") if "wandb" in loggers else True
    if not wandb_offline(offline):
        url = os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL
        why = unreachable(url, timeout_s)
        if why:
            online = (
                "logger.wandb.offline=false"
                if offline is False
                else f"WANDB_MODE={os.environ['WANDB_MODE']}"
                if os.environ.get("WANDB_MODE")
                else "an API key is configured"
            )
            raise UserError(
                f"logger=wandb logs online ({online}) but {url} cannot be reached ({why}): "
                "log offline with logger.wandb.offline=true and upload later with wandb sync, or fix the "
                "network"
            )


def unreachable(url: str, timeout_s: float) -> str | None:
    """Why nothing answers HTTP at ``url`` ('Connection refused', 'Name or service not known', ...), or None."""
    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:  # a server answered
        return None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
    return None


def wandb_offline(offline: bool | str) -> bool:
    """``offline: auto``: WANDB_MODE if the user set it, else offline unless an API key is configured for the host."""
    if isinstance(offline, bool):
        return offline
    if offline != "auto":
        raise UserError(f"logger.wandb.offline={offline} must be true, false or auto")
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode:
        return mode in ("offline", "dryrun", "disabled")
    if os.environ.get("WANDB_API_KEY"):
        return False
    try:  # `wandb login` keeps the key in ~/.netrc, for the host in WANDB_BASE_URL
        from wandb.sdk.lib import wbauth

        return not wbauth.read_netrc_auth(host=os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL)
    except Exception:  # noqa: BLE001 - no netrc, or a wandb that keeps keys elsewhere: no key found
        return True
