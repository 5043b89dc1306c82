"""Checkpoint directories: written whole or not at all, checked before anything is read.

A checkpoint is a directory of files plus `checksums.json`, the SHA-256 of each, written
last. It is built under a temporary sibling name (`.NAME.tmp-PID`) and renamed into
place; an existing checkpoint of the same name is first renamed aside
(`.NAME.old-PID`) and removed only after the new one is in place. A crash at any point
therefore leaves either the old checkpoint, or the new one, under NAME, or (between
the two renames) the old one under `.NAME.old-PID`, which `recover` puts back.

`write` is collective when given a `Collective` (the processes of a launched run):
rank 0 makes the temporary directory, every process writes the files it holds
(a pipeline stage's weights, a shard of the optimizer moments) into it, each file's
owner hashes it, and rank 0 writes the checksums and renames, or, if any process
failed, removes everything and every process raises the same error. No process ever
holds the whole model to write it.

Large tensor files are written in the safetensors layout (an 8-byte header length, a
JSON header of names, dtypes, shapes and byte ranges, then the raw little-endian
bytes), whose header depends only on names and shapes, so several processes can each
write their byte ranges of one file (`TensorFile`); `safetensors.safe_open` reads
any slice of any tensor without loading the rest.

The session's checkpoint (this module owns its layout; `TrainingSession.save`/`load`
call it):

    model.onnx                    the graph; every weight as external data in ...
    weights.vg<v>.data            ... one file per virtual graph (raw little-endian fp32)
    optimizer.vg<v>.safetensors   the optimizer's state of those weights, each kind it
                                  names (`state_kinds`) by name (LAMB/AdamW:
                                  `exp_avg/<name>`, `exp_avg_sq/<name>`)
    session.json                  `SessionState`: format, step, loss scale, topology,
                                  each rank's RNG state and extra (loop) state, the
                                  kernel policy, which file holds which tensors, the
                                  optimizer's name, state kinds and scalar state
    checksums.json                SHA-256 of each file, written last

`session.json` records its `format` (`FORMAT`). Older formats are read and named when
they are (`SessionState.old`): 1, the model inline and one `optimizer.pt` (before
per-process files); 2, today's files without a recorded format; 3, before the
optimizer recorded its name and state kinds (LAMB's or AdamW's two moments); 4, before each
rule recorded its hyperparameters by its own names (session/hyperparameters.py: Lion's two
decays were one pair, `betas`, which is read as its `beta1` and `beta2`). A newer format than
this code knows is refused by name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from fileio import DiskFull, disk_full, publish_directory

if TYPE_CHECKING:
    import onnx
    import torch

    from session.flat import FlatOptimizer

__all__ = ["CHECKSUMS_FILE", "FORMAT", "MODEL_FILE", "STATE_FILE", "Collective", "Holdings", "SessionState",
           "TensorFile", "model_weights", "newest", "newest_of", "optimizer_file", "read_optimizer", "read_state",
           "recover", "save", "survey", "verify", "weights_file", "write"]

CHECKSUMS_FILE = "checksums.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class Collective:
    """What `write` needs of the processes: a rank, gather to rank 0 and broadcast from it
    (torch.distributed's object collectives in a run; the identity in one process)."""

    rank = 0

    def gather(self, value: Any) -> Optional[list[Any]]:
        return [value]

    def broadcast(self, value: Any) -> Any:
        return value


def write(target: Path, writers: dict[str, Callable[[Path], None]], owned: Optional[Iterable[str]] = None,
          collective: Optional[Collective] = None,
          published: Optional[Callable[[Path], None]] = None) -> Optional[Path]:
    """Create checkpoint directory `target` atomically (collective with `collective`).

    Each process passes the writers of the files it writes (each writes one file, or
    its part of one, at the path it gets) and the names of the files it owns (hashes;
    default: all it writes). A full disk is a ValueError that says so and leaves the
    previous checkpoint as it was. `published(target)` runs on rank 0 the moment the
    checkpoint is in place (before the others hear of it: one of them may be gone).
    Returns `target` on rank 0, None elsewhere.
    """
    collective = collective or Collective()
    lead = collective.rank == 0
    tmp = None
    if lead:
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        problem = _attempt(lambda: _fresh_directory(tmp), target)
        tmp = (str(tmp), problem)
    tmp, problem = collective.broadcast(tmp)
    if problem is not None:
        raise problem
    tmp = Path(tmp)
    problem = None
    for name, writer in writers.items():
        problem = problem or _attempt(lambda: writer(tmp / name), target)
    collective.gather(None)  # every process has written: now each owner hashes its files
    sums: dict[str, str] = {}
    if problem is None:
        for name in sorted(set(writers) if owned is None else set(owned)):
            problem = problem or _attempt(lambda: sums.update({name: _sha256(tmp / name)}), target)
    reports = collective.gather((problem, sums))
    outcome = None
    if lead:
        problems = [p for p, _ in reports if p is not None]
        if problems:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = problems[0]
        else:
            sums = {k: v for _, s in reports for k, v in s.items()}
            outcome = _attempt(lambda: _publish(tmp, target, sums), target)
            if outcome is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            elif published is not None:
                published(target)
    outcome = collective.broadcast(outcome)
    if outcome is not None:
        raise outcome
    return target if lead else None


def _fresh_directory(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def _attempt(action: Callable[[], None], target: Path) -> Optional[ValueError]:
    """None when `action` succeeds, else the one-line error every process raises (a DiskFull
    for want of space)."""
    try:
        action()
    except OSError as e:
        if disk_full(e):
            return DiskFull(f"the disk is full: cannot write checkpoint {target} ({e.strerror}); free space: nothing "
                            "of it was kept, and the previous checkpoint of that name, if any, is intact")
        where = f"{e.filename}: " if e.filename else ""
        return ValueError(f"cannot write checkpoint {target}: {where}{e.strerror or e}")
    return None


def _publish(tmp: Path, target: Path, sums: dict[str, str]) -> None:
    """The checksums last, then the directory into place (fileio: flushed, the old one aside)."""
    (tmp / CHECKSUMS_FILE).write_text(json.dumps(dict(sorted(sums.items())), indent=1) + "\n")
    publish_directory(tmp, target)


def verify(directory: Path, required: Sequence[str], only: Optional[Iterable[str]] = None) -> None:
    """Every required file present and each file (or each of `only`) equal to its recorded
    checksum, or a ValueError naming the checkpoint, the file and what is wrong with it.
    Nothing of the checkpoint but `checksums.json` is read before this passes."""
    if not directory.is_dir():
        raise ValueError(f"checkpoint {directory} does not exist (or is not a directory)")
    for name in required:
        if not (directory / name).exists():
            raise ValueError(f"{directory} is not a complete checkpoint: {name} is missing")
    sums_path = directory / CHECKSUMS_FILE
    if not sums_path.exists():
        raise ValueError(f"checkpoint {directory} has no {CHECKSUMS_FILE}: it was not written by this version "
                         "or was copied incompletely; copy it again or start from its weights with "
                         "training.init_from")
    try:
        sums = json.loads(sums_path.read_text())
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"checkpoint {directory}: {CHECKSUMS_FILE} is corrupt (not a JSON object of checksums); "
                         "resume from an earlier checkpoint") from None
    names = list(sums) if only is None else list(dict.fromkeys(only))
    for name in names:
        if name not in sums:
            raise ValueError(f"checkpoint {directory}: {name} has no checksum in {CHECKSUMS_FILE}")
        path = directory / name
        if not path.exists():
            raise ValueError(f"checkpoint {directory}: {name} is missing (listed in {CHECKSUMS_FILE})")
        actual = _sha256(path)
        if actual != sums[name]:
            raise ValueError(f"checkpoint {directory}: {name} is corrupt (SHA-256 {actual[:12]}… but "
                             f"{sums[name][:12]}… was written); resume from an earlier checkpoint")


def recover(run_dir: Path) -> list[str]:
    """Tidy what interrupted saves left in `run_dir`; returns what was done, one line each."""
    done = []
    if not run_dir.is_dir():
        return done
    for path in sorted(run_dir.iterdir()):
        name = path.name
        if not name.startswith(".") or not path.is_dir():
            continue
        if ".tmp-" in name:  # never finished: the checkpoint it was to become is not in it
            shutil.rmtree(path)
            done.append(f"removed the unfinished checkpoint {path}")
        elif ".old-" in name:
            final = run_dir / name[1:].split(".old-")[0]
            if final.exists():
                shutil.rmtree(path)
                done.append(f"removed {path}, replaced by {final}")
            else:  # the crash came between the two renames: the old one is the checkpoint
                path.rename(final)
                done.append(f"restored {final} from {path}")
    return done


class TensorFile:
    """The safetensors layout of flat fp32 tensors `names` of `sizes` elements, in that order.

    The header depends only on names and sizes, so every process computes the same
    byte range for every element: `write(path, name, first, values)` writes `values`
    as elements `first...` of tensor `name` (several processes may write disjoint
    ranges of one file); `read(path, name, first, count)` reads a range back.
    """

    def __init__(self, names: Sequence[str], sizes: Sequence[int]):
        self.names = list(names)
        self.sizes = [int(n) for n in sizes]
        header, offset = {}, 0
        self._offsets = {}
        for name, numel in zip(self.names, self.sizes):
            size = 4 * numel
            header[name] = {"dtype": "F32", "shape": [numel], "data_offsets": [offset, offset + size]}
            self._offsets[name] = offset
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
        self.header = len(text).to_bytes(8, "little") + text
        self.size = len(self.header) + offset

    def create(self, path: Path) -> None:
        """Write the header (one process; the others' ranges may come before or after it)."""
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.write(self.header)

    def write(self, path: Path, name: str, first: int, values: np.ndarray) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            data = np.ascontiguousarray(values, dtype="<f4").tobytes()
            position = len(self.header) + self._offsets[name] + 4 * first
            while data:
                written = os.pwrite(fd, data, position)
                data, position = data[written:], position + written
        finally:
            os.close(fd)

    @staticmethod
    def read(path: Path, name: str, first: int = 0, count: Optional[int] = None) -> np.ndarray:
        """Elements `first...` (`count` of them; default to the end) of the flat tensor `name`."""
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            flat = f.get_slice(name)
            end = flat.get_shape()[0] if count is None else first + count
            return flat[first:end]


# ============================================================ the session's checkpoint
FORMAT = 5
MODEL_FILE = "model.onnx"
STATE_FILE = "session.json"
LEGACY_OPTIMIZER_FILE = "optimizer.pt"  # format 1
_OLD_FORMATS = {
    1: "format 1 (the model inline and one optimizer.pt, before per-process files)",
    2: "format 2 (written before checkpoints recorded their format)",
    3: "format 3 (written before optimizers recorded their name and state kinds)",
    4: "format 4 (written before each optimizer recorded its hyperparameters by its own names)",
}
# What formats 1 to 3 hold of the optimizer: LAMB's or AdamW's moments.
_MOMENTS = ("exp_avg", "exp_avg_sq")


def weights_file(virtual_graph: int) -> str:
    return f"weights.vg{virtual_graph}.data"


def optimizer_file(virtual_graph: int) -> str:
    return f"optimizer.vg{virtual_graph}.safetensors"


@dataclass
class SessionState:
    """session.json: everything of a checkpoint but its tensors."""

    step: int
    loss_scale: float = 1.0
    loss_scale_clean_steps: int = 0
    topology: dict[str, int] = field(default_factory=lambda: {"replicas": 1, "virtual_graphs": 1})
    per_rank: list[dict] = field(default_factory=list)  # each rank's {"rng": {...}, "extra": {...}}
    kernels: dict[str, Any] = field(default_factory=dict)  # the kernel policy that wrote it
    files: Optional[dict[str, dict[str, list[str]]]] = None  # {"weights"|"optimizer": {file: names}}; format 1: None
    optimizer: Optional[dict[str, Any]] = None  # the optimizer's scalar state, names and shapes; format 1: None
    format: int = FORMAT

    @property
    def old(self) -> Optional[str]:
        """Which older format this checkpoint is in (it is read all the same), or None."""
        return _OLD_FORMATS.get(self.format)

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "SessionState":
        """Parse session.json of any format this code reads (upgraded to today's fields)."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where} holds a JSON {type(raw).__name__}, not an object")
        version = raw.get("format", 2 if "files" in raw else 1)
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT:
            raise ValueError(f"{where} is in checkpoint format {version}, newer than this version reads (1 to "
                             f"{FORMAT}): resume it with the newer version of this project that wrote it")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"{where} names checkpoint format {version!r}, which no version of this project writes "
                             f"(formats are whole numbers, 1 to {FORMAT} here): the file is damaged; resume from "
                             "another checkpoint")
        try:
            per_rank = raw.get("per_rank") or [{"torch_rng": raw.get("torch_rng"), "extra": raw.get("extra", {})}]
            state = cls(
                step=int(raw["step"]), loss_scale=float(raw["loss_scale"]),
                loss_scale_clean_steps=int(raw["loss_scale_clean_steps"]),
                topology={k: int(v) for k, v in raw.get("topology", {"replicas": 1, "virtual_graphs": 1}).items()},
                per_rank=[{"rng": r.get("rng") or {"cpu": r["torch_rng"]}, "extra": r.get("extra", {})}
                          for r in per_rank],
                kernels=dict(raw.get("kernels", {})), files=raw.get("files"), optimizer=raw.get("optimizer"),
                format=version)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where} is not a session state this version reads ({type(e).__name__}: {e}); resume "
                             "from another checkpoint") from None
        if state.step < 0 or state.step != raw["step"] or isinstance(raw["step"], bool):
            raise ValueError(f"{where} says step {raw['step']!r}, which is no step a run reaches (a whole number, 0 or "
                             "more): the file is damaged; resume from another checkpoint")
        if version >= 2 and (not isinstance(state.files, dict) or not isinstance(state.optimizer, dict)):
            raise ValueError(f"{where} names no weight and optimizer files; resume from another checkpoint")
        if version == 4 and state.optimizer.get("optimizer") == "lion":
            try:
                state.optimizer = _lion_decays_by_name(state.optimizer)
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{where} is not a session state this version reads (Lion's betas: {e}); resume "
                                 "from another checkpoint") from None
        return state

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _lion_decays_by_name(optimizer: dict[str, Any]) -> dict[str, Any]:
    """Format 4 recorded Lion's β₁ and β₂ as one pair, `betas` (LAMB's name); format 5 records
    them by Lion's own names, `beta1` and `beta2`."""
    groups = []
    for group in optimizer.get("param_groups", []):
        group = dict(group)
        if "betas" in group:
            group["beta1"], group["beta2"] = group.pop("betas")
        groups.append(group)
    return {**optimizer, "param_groups": groups}


def read_state(directory: Path) -> SessionState:
    """The checkpoint's session.json, after it matched its checksum."""
    verify(directory, (STATE_FILE,), only=(STATE_FILE,))
    path = directory / STATE_FILE
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    return SessionState.from_json(raw, str(path))


@dataclass
class Holdings:
    """What one process of a run holds, hence writes: its weights and their moments."""

    skeleton: "onnx.ModelProto"  # the graph without its weights
    weights: list[tuple[str, tuple[int, ...]]]  # every weight of the model (all processes'), in graph order
    placement: dict[str, int]  # the virtual graph of every weight: its files
    params: Mapping[str, "torch.Tensor"]  # this process's weights
    optimizer: "FlatOptimizer"  # their optimizer state (a shard of it with replicated tensor sharding)
    virtual_graph: int
    first_replica: bool  # replica 0 writes the weights and the moment files' headers
    lead: bool  # rank 0 writes model.onnx and session.json

    def files(self) -> dict[str, dict[str, list[str]]]:
        """Which file holds which tensors: one weight file and one moment file per virtual graph."""
        by_vg: dict[int, list[str]] = {}
        for name, _ in self.weights:
            by_vg.setdefault(self.placement[name], []).append(name)
        return {"weights": {weights_file(v): names for v, names in sorted(by_vg.items())},
                "optimizer": {optimizer_file(v): names for v, names in sorted(by_vg.items())}}



def survey(run_dir: Path) -> tuple[dict[Path, int], dict[Path, str]]:
    """The checkpoint directories (`checkpoint-*`) of `run_dir`: {path: step} of those whose
    session.json verifies, {path: why not} of the others."""
    good, bad = {}, {}
    for path in sorted(Path(run_dir).glob("checkpoint-*")):
        if not path.is_dir():
            continue
        try:
            good[path] = read_state(path).step
        except (ValueError, OSError) as e:
            bad[path] = str(e)
    return good, bad


def newest_of(found: dict[Path, int]) -> Optional[Path]:
    """The checkpoint of the highest step of `found` ({path: step}), checkpoint-final first at equal steps."""
    return max(found, key=lambda p: (found[p], p.name == "checkpoint-final")) if found else None


def newest(run_dir: Path) -> Optional[Path]:
    """The checkpoint directory of `run_dir` of the highest step whose session.json verifies;
    None when none does."""
    return newest_of(survey(run_dir)[0])

def save(directory: Path, holdings: Holdings, state: SessionState, collective: Optional[Collective] = None,
         published: Optional[Callable[[Path], None]] = None) -> Optional[Path]:
    """Write the checkpoint (collective: every process calls it and writes what it holds);
    returns the path on rank 0, None elsewhere."""
    import onnx

    files = holdings.files()
    state = dataclasses.replace(state, files=files, format=FORMAT)
    shapes = dict(holdings.weights)
    vg, writers, owned = holdings.virtual_graph, {}, set()
    names = files["weights"][weights_file(vg)]
    moments = _state_file(files["optimizer"][optimizer_file(vg)], shapes, holdings.optimizer.state_kinds)
    if holdings.first_replica:
        writers[weights_file(vg)] = lambda path: _write_weights(path, holdings.params, names)
        owned |= {weights_file(vg), optimizer_file(vg)}
    if holdings.first_replica or holdings.optimizer.sharded:
        writers[optimizer_file(vg)] = lambda path: _write_state(path, moments, holdings.optimizer,
                                                                header=holdings.first_replica)
    if holdings.lead:
        writers[MODEL_FILE] = lambda path: onnx.save_model(_with_references(holdings, files), str(path))
        writers[STATE_FILE] = lambda path: path.write_text(json.dumps(state.to_json()))
        owned |= {MODEL_FILE, STATE_FILE}
    return write(directory, writers, owned, collective, published)


def _state_file(names: list[str], shapes: dict[str, tuple[int, ...]], kinds: Sequence[str]) -> TensorFile:
    keys = [f"{kind}/{n}" for kind in kinds for n in names]
    sizes = [math.prod(shapes[n]) for _ in kinds for n in names]
    return TensorFile(keys, sizes)


def _write_weights(path: Path, params: Mapping[str, "torch.Tensor"], names: list[str]) -> None:
    with open(path, "wb") as f:
        for name in names:  # one tensor at a time
            f.write(params[name].detach().float().cpu().numpy().astype("<f4").tobytes())


def _write_state(path: Path, file: TensorFile, optimizer: "FlatOptimizer", header: bool) -> None:
    """Every state kind of the pieces this process holds (a shard's chunks with RTS)."""
    if header:
        file.create(path)
    names = optimizer.layout.names
    for kind, buffer in optimizer.flat_state.items():
        for i, first, end, offset in optimizer.holding.pieces():
            file.write(path, f"{kind}/{names[i]}", first, buffer[offset : offset + end - first].cpu().numpy())


def _with_references(holdings: Holdings, files: dict[str, dict[str, list[str]]]) -> "onnx.ModelProto":
    """The graph with every weight as external data in its virtual graph's file."""
    import onnx

    shapes, where = dict(holdings.weights), {}
    for file, names in files["weights"].items():
        offset = 0
        for name in names:
            where[name] = (file, offset)
            offset += 4 * math.prod(shapes[name])
    model = onnx.ModelProto()
    model.CopyFrom(holdings.skeleton)
    for name, shape in holdings.weights:
        file, offset = where[name]
        tensor = model.graph.initializer.add()
        tensor.name, tensor.data_type = name, onnx.TensorProto.FLOAT
        tensor.dims.extend(shape)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", file), ("offset", str(offset)), ("length", str(4 * math.prod(shape)))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
    return model


class _LazyWeights(Mapping):
    """Weights by name, each read when asked for (a checkpoint's or a model file's)."""

    def __init__(self, tensors: dict[str, Any], reader: Callable[[Any], np.ndarray]):
        self.tensors, self.reader = tensors, reader

    def __getitem__(self, name: str) -> np.ndarray:
        return self.reader(self.tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def model_weights(source: Any, names: Iterable[str]) -> Mapping[str, np.ndarray]:
    """The weights of an ONNX model, a model file or a checkpoint directory, by name, each
    read when asked for. In a checkpoint, model.onnx and the data files holding `names`
    are checked against their checksums first."""
    import onnx

    from session.model_io import WeightReader, load_without_data

    if isinstance(source, onnx.ModelProto):
        proto, reader = source, WeightReader(None, None, "the model")
    else:
        path = Path(source)
        if path.is_dir():
            if (path / CHECKSUMS_FILE).exists():
                verify(path, (MODEL_FILE,), only=(MODEL_FILE,))
            path = path / MODEL_FILE
        proto, reader = load_without_data(path), WeightReader(path.parent, None, str(path))
        if (path.parent / CHECKSUMS_FILE).exists():
            wanted = set(names)
            external = {e.value for t in proto.graph.initializer if t.name in wanted
                        for e in t.external_data if e.key == "location"}
            verify(path.parent, (), only=sorted(external))
    return _LazyWeights({t.name: t for t in proto.graph.initializer}, reader)


def read_optimizer(directory: Path, state: SessionState, optimizer: "FlatOptimizer") -> None:
    """Restore the optimizer's scalar state and the state it holds (its shard's byte ranges
    with replicated tensor sharding), each file checked against its checksum first."""
    import torch

    if state.files is None:  # format 1: one optimizer.pt with every tensor's state
        from session.optimizers import select_state

        verify(directory, (LEGACY_OPTIMIZER_FILE,), only=(LEGACY_OPTIMIZER_FILE,))
        try:
            saved = torch.load(directory / LEGACY_OPTIMIZER_FILE, map_location="cpu", weights_only=True)["optimizer"]
        except Exception as e:
            raise ValueError(f"checkpoint {directory}: {LEGACY_OPTIMIZER_FILE} is unreadable ({e})") from None
        optimizer.load_state_dict(select_state(saved, optimizer.parameter_names))
        return
    from safetensors import safe_open

    names = optimizer.layout.names
    file_of = {name: file for file, held in state.files["optimizer"].items() for name in held}
    missing = [n for n in names if n not in file_of]
    if missing:
        raise ValueError(f"checkpoint {directory} holds no optimizer state for {missing[:3]}: load state saved for "
                         "the same model")
    verify(directory, (), only=sorted({file_of[n] for n in names}))
    optimizer.load_scalar_state(state.optimizer, f"checkpoint {directory}")
    saved_kinds = tuple(state.optimizer.get("state_kinds", _MOMENTS))
    if saved_kinds != optimizer.state_kinds:
        raise ValueError(f"checkpoint {directory} holds optimizer state {list(saved_kinds)}, this optimizer "
                         f"{list(optimizer.state_kinds)}: resume with the optimizer that wrote it")
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] = {}
        for kind, buffer in optimizer.flat_state.items():
            for i, first, end, offset in optimizer.holding.pieces():
                file = file_of[names[i]]
                if file not in opened:
                    opened[file] = stack.enter_context(safe_open(str(directory / file), framework="pt"))
                buffer[offset : offset + end - first] = opened[file].get_slice(f"{kind}/{names[i]}")[first:end]
