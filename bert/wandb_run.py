"""The wandb run behind `bert.py --wandb`: online when W&B can be reached, else offline.

`wandb.init` in online mode waits up to its `init_timeout` and then raises when the
host cannot be reached (observed: a run with WANDB_API_KEY set and no network died
after 35 s). A TCP probe of the host first, bounded by a thread join, costs at most
3 s and lets the run log offline instead; an online start that fails anyway falls
back to offline too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from bert.config import Config

__all__ = ["start_wandb"]


def start_wandb(output_dir: Path, config: Config):
    """A wandb run that never blocks training for lack of network.

    Online only with WANDB_API_KEY set and the W&B host (or the HTTPS proxy) accepting a
    TCP connection within 3 s; otherwise, or if the online init fails, offline into
    `output_dir/wandb` with one printed line (`wandb sync` uploads it later).
    """
    import wandb

    settings = wandb.setup().settings  # settings files; the environment is read again below (setup is cached)
    base_url = os.environ.get("WANDB_BASE_URL") or settings.base_url
    chosen = os.environ.get("WANDB_MODE") or settings.mode
    if chosen in ("offline", "dryrun", "disabled"):
        mode = "disabled" if chosen == "disabled" else "offline"
    else:
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if mode == "online":
        why = _unreachable(base_url)
        if why:
            print(f"wandb: {base_url} {why}; logging offline into {output_dir / 'wandb'} "
                  "(upload later with `wandb sync`)", flush=True)
            mode = "offline"

    def init(mode: str):
        return wandb.init(
            project="groupbert", name=config.name, dir=str(output_dir), mode=mode,
            config=config.model_dump(mode="json"), resume="allow",
            settings=wandb.Settings(init_timeout=30, silent=True),
        )

    if mode != "online":
        return init(mode)
    try:
        return init(mode)
    except Exception as e:  # wandb raises its own error types for auth and network failures
        print(f"wandb: online init failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); logging offline "
              f"into {output_dir / 'wandb'} (upload later with `wandb sync`)", flush=True)
        return init("offline")


def _unreachable(url: str, timeout: float = 3.0) -> Optional[str]:
    """None if a TCP connection to the host of `url` (or to its proxy) opens within `timeout`,
    else why not. Runs in a daemon thread, so a hanging DNS lookup cannot hold the run."""
    import socket
    import threading
    import urllib.parse
    import urllib.request

    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "", parsed.port or (443 if parsed.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(parsed.scheme)
    if proxy and host and not urllib.request.proxy_bypass(host):
        proxied = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxied.hostname or "", proxied.port or 80
    result: list[Optional[str]] = [f"did not answer within {timeout:.0f} s"]

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result[0] = None
        except OSError as e:
            result[0] = f"is unreachable ({e.strerror or e})"

    thread = threading.Thread(target=probe, daemon=True, name="wandb-reachability")
    thread.start()
    thread.join(timeout)
    return result[0]
