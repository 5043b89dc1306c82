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

    Online only with credentials (WANDB_API_KEY, or the key `wandb login` keeps in
    ~/.netrc) and the W&B host (or the HTTPS proxy) accepting a TCP connection within
    3 s; otherwise, or if the online init fails, offline into `output_dir/wandb`, and in
    every such case one printed line says why and how to upload (`wandb sync`).
    """
    import wandb

    settings = wandb.setup().settings  # settings files; the environment is read again below (setup is cached)
    base_url = os.environ.get("WANDB_BASE_URL") or settings.base_url
    chosen = os.environ.get("WANDB_MODE") or settings.mode
    offline = f"logging offline into {output_dir / 'wandb'} (upload later with `wandb sync`)"
    if chosen == "disabled":
        print("wandb: disabled (WANDB_MODE or wandb settings): nothing is logged to W&B", flush=True)
        mode = "disabled"
    elif chosen in ("offline", "dryrun"):
        print(f"wandb: mode {chosen} (WANDB_MODE or wandb settings); {offline}", flush=True)
        mode = "offline"
    elif not _has_credentials(base_url):
        print(f"wandb: no W&B credentials (set WANDB_API_KEY or run `wandb login`); {offline}", flush=True)
        mode = "offline"
    else:
        mode = "online"
    if mode == "online":
        why = _unreachable(base_url)
        if why:
            print(f"wandb: {base_url} {why}; {offline}", flush=True)
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
        print(f"wandb: online init failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); {offline}",
              flush=True)
        return init("offline")


def _has_credentials(url: str) -> bool:
    """WANDB_API_KEY, or a password for the W&B host in the netrc file `wandb login` writes
    (NETRC, else ~/.netrc); an unreadable netrc counts as none."""
    import netrc
    import urllib.parse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


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
