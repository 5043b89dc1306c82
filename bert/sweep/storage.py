"""Where a sweep's state lives: an Optuna journal file (a path) or a database (an SQLAlchemy URL),
opened with Optuna's public storage classes only, plus what Optuna 5.0 gives RDBStorage alone: a
heartbeat of each running trial and the failure of a dead worker's stale trial, written here on
public storage calls (`set_trial_system_attr`, `get_all_trials`, `set_trial_state_values`) so that
one mechanism serves both kinds of storage.

A damaged storage is a `StorageDamaged` (a ValueError) of one line naming the file or URL and what
to do, whenever it is found: at opening, or when a record another process appended is replayed.
Nothing is written to a storage found damaged.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import optuna
import sqlalchemy.exc
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalFileSymlinkLock
from optuna.study import StudyDirection
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


# ------------------------------------------------------------------- the journal's records
# Optuna's journal is JSON Lines, one operation per line (optuna/storages/journal/_storage.py,
# JournalOperation). Each record is checked against the fields its replay reads before Optuna sees
# it, so a foreign or damaged line is named here, not met as a KeyError deep in the replay.
_INT, _NUM, _STR, _DICT, _LIST = (int,), (int, float), (str,), (dict,), (list,)
_OPERATIONS: dict[int, dict[str, tuple]] = {
    0: {"study_name": _STR, "directions": _LIST},  # create study
    1: {"study_id": _INT},  # delete study
    2: {"study_id": _INT, "user_attr": _DICT},
    3: {"study_id": _INT, "system_attr": _DICT},
    4: {"study_id": _INT, "datetime_start": (str, type(None))},  # create trial
    5: {"trial_id": _INT, "param_name": _STR, "param_value_internal": _NUM, "distribution": _STR},
    6: {"trial_id": _INT, "state": _INT, "values": (list, type(None))},
    7: {"trial_id": _INT, "step": _INT, "intermediate_value": (int, float, type(None))},
    8: {"trial_id": _INT, "user_attr": _DICT},
    9: {"trial_id": _INT, "system_attr": _DICT},
    10: {},  # discard trials (written by Rustuna; Optuna skips it)
}
_CREATED_TRIAL = {"state": _INT, "value": (int, float, type(None)), "values": (list, type(None)),
                  "datetime_complete": _STR, "distributions": _DICT, "params": _DICT, "user_attrs": _DICT,
                  "system_attrs": _DICT, "intermediate_values": _DICT}


def _typed(value: Any, types: tuple) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def _record_problem(record: Any) -> str | None:
    """What makes `record` something other than an Optuna 5 journal operation, or None."""
    if not isinstance(record, dict):
        return f"it holds a JSON {type(record).__name__}, not a journal record"
    op = record.get("op_code")
    if not _typed(op, _INT) or op not in _OPERATIONS:
        return f"op_code {op!r} is not an Optuna journal operation"
    if not _typed(record.get("worker_id"), _STR):
        return "its worker_id is missing or not text"
    fields = dict(_OPERATIONS[op], **({k: v for k, v in _CREATED_TRIAL.items() if k in record} if op == 4 else {}))
    for key, types in fields.items():
        if key not in record:
            return f"operation {op} lacks its field {key!r}"
        if not _typed(record[key], types):
            return f"field {key!r} of operation {op} is {record[key]!r}"
    try:
        if op == 0:
            [StudyDirection(d) for d in record["directions"]]
        for key in ("user_attr", "system_attr"):
            if key in record and len(record[key]) != 1:
                return f"field {key!r} of operation {op} holds {len(record[key])} attributes, not 1"
        if "state" in fields:
            state = TrialState(record["state"])
            if op == 6 and state == TrialState.RUNNING:
                datetime.fromisoformat(record["datetime_start"])
            elif op == 6 and state.is_finished():
                datetime.fromisoformat(record["datetime_complete"])
        for key in ("datetime_start", "datetime_complete"):
            if op == 4 and isinstance(record.get(key), str):
                datetime.fromisoformat(record[key])
        if op == 5:
            optuna.distributions.json_to_distribution(record["distribution"])
        if op == 4:
            distributions = {k: optuna.distributions.json_to_distribution(v)
                             for k, v in record.get("distributions", {}).items()}
            for name, internal in record.get("params", {}).items():
                distributions[name].to_external_repr(internal)
            [int(k) for k in record.get("intermediate_values", {})]
        for values in (record.get("values") or [], record.get("intermediate_values", {}).values()):
            if not all(_typed(v, (int, float, type(None))) for v in values):
                return f"operation {op} holds a value that is not a number"
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        return f"operation {op} holds a value Optuna cannot read ({type(e).__name__}: {_first_line(e)})"
    return None


class _CheckedJournal(BaseJournalBackend):
    """Optuna's journal file backend, with each record checked as it is read. Once damage is found
    (another process may append it at any time) nothing more is written or read."""

    def __init__(self, path: str):
        self.path, self._file = path, JournalFileBackend(path)
        self.damage: StorageDamaged | None = None

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        records, line = iter(self._file.read_logs(log_number_from)), log_number_from + 1
        while self.damage is None:
            try:
                record = next(records)
            except StopIteration:
                return
            except ValueError as e:  # JSON that does not parse (UnicodeDecodeError too), a line cut short
                self.damage = _unreadable(self.path, f"line {line} is not an Optuna journal record: {_why(e)}")
                break
            if (problem := _record_problem(record)) is not None:
                self.damage = _unreadable(self.path, f"line {line} is not an Optuna journal record: {problem}")
                break
            yield record
            line += 1
        raise self.damage

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        if self.damage is not None:
            raise self.damage
        self._file.append_logs(logs)


def _check_tail(path: str) -> None:
    """The journal's last line. One that lacks its newline is a write that never finished (a full
    disk, a crash) or one in progress (a line is one write under the lock); Optuna would skip it,
    then append the next record to it, damaging both. One that is whole but not a record is skipped
    by Optuna's reader too (it takes it for a line in progress). Both are refused here."""
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
        raise StorageDamaged(
            f"sweep storage {path} cannot be read (its last line is cut short after byte {whole}: a write that "
            f"never finished); cut it off with `truncate -s {whole} {path}` to continue the sweep, or {AFRESH}")
    line = data.count(b"\n")
    try:
        problem = _record_problem(json.loads(data[data.rfind(b"\n", 0, whole - 1) + 1:whole - 1]))
    except ValueError as e:
        problem = _why(e)
    if problem is not None:
        raise _unreadable(path, f"line {line} is not an Optuna journal record: {problem}")


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
            return JournalStorage(_CheckedJournal(where))  # replays every record here
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
