"""Where a sweep's state lives: an Optuna journal file (a path) or a database (an SQLAlchemy URL),
opened with Optuna's public storage classes only, plus what Optuna 5.0 gives RDBStorage alone: a
heartbeat of each running trial and the failure of a dead worker's stale trial, written here on
public storage calls (`set_trial_system_attr`, `get_all_trials`, `set_trial_state_values`) so that
one mechanism serves both kinds of storage.

The records are Optuna's to read and check: what it cannot read is a `StorageDamaged` (a ValueError)
of one line naming the file or URL and what to do, at opening, or when a line another process
appended is not JSON; nothing more is written to a journal found damaged. The sweep checks the
attributes it writes itself (bert/sweep/worker.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import optuna
import sqlalchemy.exc
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalFileSymlinkLock
from optuna.trial import TrialState

__all__ = ["AFRESH", "GRACE_S", "HEARTBEAT_S", "JOURNAL", "MAX_RETRY", "StorageDamaged", "default_storage", "fail_stale_trials",
           "heartbeat", "open_storage", "quiet_optuna", "requeue", "storage_errors"]

# A running trial records a heartbeat every HEARTBEAT_S; one whose heartbeat is GRACE_S old
# belonged to a worker that died without warning (SIGKILL, the OOM killer, a lost machine):
# it is failed and queued again, at most MAX_RETRY times, so a run that kills its process every
# time stops being retried. A trial stopped by a signal, or by a setup error before its first
# step, is queued again every time (the count of those is the trial attribute REQUEUED).
HEARTBEAT_S = 20
GRACE_S = 120
MAX_RETRY = 2
JOURNAL = "optuna.journal"
BEAT, REQUEUED = "heartbeat", "requeued"
AFRESH = "move it away to start the sweep afresh (the runs in the sweep directory stay)"


class StorageDamaged(ValueError):
    """The sweep's storage cannot be read; the message names it and what to do."""


def default_storage(sweep_dir: Path) -> str:
    return str((sweep_dir / JOURNAL).resolve())


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def _why(error: BaseException) -> str:
    """The error in a few words: Optuna's StorageInternalError by the database error under it, JSON by place."""
    if isinstance(error, optuna.exceptions.StorageInternalError) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, json.JSONDecodeError):
        return f"not JSON: {error.msg} at character {error.pos}"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text at byte {error.start}"
    return f"{type(error).__name__}: {_first_line(error)}"


def _unreadable(where: str, why: str) -> StorageDamaged:
    return StorageDamaged(f"sweep storage {where} cannot be read ({why}); if it is damaged, {AFRESH}")


# ---------------------------------------------------------------------------- the journal
class _Journal(BaseJournalBackend):
    """Optuna's journal file backend; an error Optuna meets reading it (a line that is not JSON,
    which another process may append at any time) is a StorageDamaged naming the file, after
    which nothing more is read or written. The records themselves are Optuna's to read."""

    def __init__(self, path: str):
        self.path, self._file = path, JournalFileBackend(path)
        self.damage: StorageDamaged | None = None

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        if self.damage is None:
            try:
                yield from self._file.read_logs(log_number_from)
                return
            except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError, "Invalid log format."
                self.damage = _unreadable(self.path, _why(e))
        raise self.damage

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        if self.damage is not None:
            raise self.damage
        self._file.append_logs(logs)


_RECORD = b'{"op_code":'  # how Optuna's JournalFileBackend begins every line (json.dumps, compact)


def _record_start(data: bytes) -> bool:
    """Whether `data` begins as a journal line does, or is a beginning of one cut short."""
    return data.startswith(_RECORD) or _RECORD.startswith(data)


def _not_a_record(line: bytes) -> str:
    try:
        json.loads(line)
    except ValueError as e:
        return _why(e)
    return "not a record of Optuna's"


def _check_tail(path: str) -> None:
    """The journal's last line. Optuna's reader skips a last line that lacks its newline (a write
    that never finished, or one in progress: a line is one write under the lock) or that is not
    JSON, taking it for a write in progress, and the next record appended to it damages both.
    Both are refused here, the first with the command that cuts it off: only when it is the
    beginning of a record after whole ones (a file of random bytes is no journal, and cutting it
    would not make one)."""
    data = Path(path).read_bytes()
    if not data.endswith(b"\n"):
        lock = JournalFileSymlinkLock(path)  # the lock Optuna's writers hold: wait for a write in progress
        lock.acquire()
        try:
            data = Path(path).read_bytes()
        finally:
            lock.release()
    whole = data.rfind(b"\n") + 1
    if whole != len(data):
        tail, first = data[whole:], data[:data.find(b"\n")]
        if not _record_start(tail):  # not a record cut short: random bytes, another program's file
            lines = data.count(b"\n") + 1
            raise _unreadable(path, f"not an Optuna journal: its last line, {lines}, is {_not_a_record(tail)}")
        if whole and not _record_start(first):
            raise _unreadable(path, f"not an Optuna journal: its first line is {_not_a_record(first)}")
        raise StorageDamaged(
            f"sweep storage {path} cannot be read (its last line is cut short after byte {whole}: a write that "
            f"never finished); cut it off with `truncate -s {whole} {path}` to continue the sweep, or {AFRESH}")
    lines = data.count(b"\n")
    try:
        json.loads(data[data.rfind(b"\n", 0, whole - 1) + 1:whole - 1])
    except ValueError as e:
        raise _unreadable(path, f"its last line, {lines}, is {_why(e)}") from None


# ------------------------------------------------------------------------------ opening
def _check_database(url: str) -> None:
    """A database with tables but not Optuna's (its `version_info`) is someone else's: refused before
    Optuna would add its tables to it."""
    engine = sqlalchemy.create_engine(url)
    try:
        tables = sorted(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    if tables and "version_info" not in tables:
        shown = ", ".join(tables[:6]) + (", ..." if len(tables) > 6 else "")
        raise StorageDamaged(f"sweep storage {url} is a database but not an Optuna storage (its tables: {shown}); "
                             "name another --storage, or move the file away to start the sweep afresh")


def open_storage(where: str) -> BaseStorage:
    """The sweep's storage: a journal file (a path) or a database (an SQLAlchemy URL); one that
    cannot be read is a StorageDamaged naming it, and is left as it was."""
    try:
        if "://" not in where:
            if os.path.exists(where) and os.path.getsize(where):
                _check_tail(where)
            return JournalStorage(_Journal(where))  # replays every record here
        _check_database(where)
        for attempt in range(5):
            try:
                storage = RDBStorage(
                    where, engine_kwargs={"connect_args": {"timeout": 120}} if where.startswith("sqlite") else None)
                storage.get_all_studies()  # a database with other tables of Optuna's names fails here
                return storage
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
                # Workers started together on a new database race to create Optuna's tables (seen on
                # PostgreSQL: CREATE TYPE studydirection); the losers find them made next time.
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
    except StorageDamaged:
        raise
    except ImportError as e:
        raise ValueError(f"storage {where}: its database driver is missing ({e.__cause__ or e}); for "
                         "postgresql:// URLs: pip install 'psycopg[binary]'") from None
    except Exception as e:  # noqa: BLE001 - whatever else a damaged file makes Optuna or the database raise
        raise _unreadable(where, _why(e)) from None
    raise AssertionError("unreachable")


@contextlib.contextmanager
def storage_errors(where: str) -> Iterator[None]:
    """A database that fails after opening (its tables are not Optuna's, the server went away): one line."""
    try:
        yield
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        raise StorageDamaged(f"sweep storage {where} failed ({_why(e)}); if the database is reachable and its "
                             f"tables are not Optuna's, {AFRESH}") from None


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's line per trial is noise here, and its retry callback is 'experimental'."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


# ------------------------------------------------------------------- heartbeats, stale trials
@contextlib.contextmanager
def heartbeat(storage: BaseStorage, trial_id: int) -> Iterator[None]:
    """Record the writer's clock in the trial's system attribute `heartbeat` every HEARTBEAT_S while
    the block runs (a thread). Machines sharing one storage need their clocks in step (NTP)."""
    stop = threading.Event()

    def beat() -> None:
        warned = False
        while True:
            try:
                storage.set_trial_system_attr(trial_id, BEAT, time.time())
            except optuna.exceptions.UpdateFinishedTrialError:  # given up for dead meanwhile
                pass
            except Exception as e:  # noqa: BLE001 - a storage that is away for a while: beat again later
                if not warned:
                    print(f"warning: sweep heartbeat not recorded ({type(e).__name__}: {_first_line(e)}); "
                          "retrying", flush=True)
                warned = True
            if stop.wait(HEARTBEAT_S):
                return

    thread = threading.Thread(target=beat, name=f"sweep-heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Queue a failed trial's values again, with its output_dir and curve (Optuna's retry callback)."""
    retries = MAX_RETRY + trial.system_attrs.get(REQUEUED, 0)  # only a dead worker's retries are capped
    RetryHeartbeatStaleTrialCallback(max_retry=retries, inherit_intermediate_values=True)(study, trial)


def fail_stale_trials(study: optuna.Study, storage: BaseStorage, study_id: int) -> None:
    """Fail every running trial whose heartbeat is GRACE_S old and queue it again. Workers may race
    here: the storage accepts one change of a running trial's state, the others' raise."""
    now = time.time()
    for t in storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
        started = t.datetime_start.timestamp() if t.datetime_start else 0.0
        if now - max(t.system_attrs.get(BEAT, 0.0), started) <= GRACE_S:  # a re-run inherits its original's
            continue  # beat, so its own start counts too
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker failed it first
            continue
        requeue(study, storage.get_trial(trial_id))
