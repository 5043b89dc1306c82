"""The shape of the code a maintainer meets (STYLE.md 11, 22 and 25): small modules, a run loop
whose concerns own their cadence, a `Job` protocol the loop reads without probing, no module
reaching for another's private names."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("bert", "builder", "custom_ops", "data", "fileio", "session")


def _product_files() -> list[Path]:
    return sorted(ROOT.glob("*.py")) + sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py"))


def _functions(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [(node.end_lineno - node.lineno + 1, node.name) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_product_file_outgrows_a_read():
    long = {str(p.relative_to(ROOT)): n for p in _product_files() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"product files over 600 lines (split them at their seams): {long}"


def test_bert_is_laid_out_by_job_in_folders_a_reader_takes_in():
    """bert/ by job (docs/design.md): the model at the top, tasks/, run/, io/, config/,
    compare/, sweep/; no folder holds more than 12 modules."""
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT / "bert", *(ROOT / "bert").rglob("*/")]
               if d.is_dir() and d.name != "__pycache__"
               and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 12}
    assert not crowded, f"folders of more than 12 modules (group them by job): {crowded}"


def test_the_run_loop_is_short_and_asks_its_concerns():
    loop = ROOT / "bert" / "run" / "loop.py"
    lines, name = max(_functions(loop))
    assert lines <= 60, f"bert/run/loop.py's {name} is {lines} lines"
    source = loop.read_text()
    steps = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "_steps")
    body = ast.get_source_segment(source, steps)
    for question in ("clock.done(", "logger.should_log(", "checkpointer.should_save(", "evaluator.should_evaluate(",
                     "divergence.update(", "stopping.requested"):
        assert question in body, f"the loop asks {question}"


def _names_a_job(node: ast.expr) -> bool:
    """`job`, `train_job`, `self.job`, `self._job`, and `type(...)` of one."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" and node.args:
        node = node.args[0]
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.lstrip("_") == "job" or name.endswith("_job")


def _job_probes(path: Path) -> list[str]:
    probes = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "isinstance", "issubclass", "vars") and node.args
                and _names_a_job(node.args[0])):
            probes.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
    return probes


def test_the_loop_reads_a_job_through_its_protocol_only():
    probes = [p for path in sorted((ROOT / "bert").rglob("*.py")) for p in _job_probes(path)]
    assert not probes, f"a Job probed (declare what is asked in bert.run.loop.Job instead): {probes}"


def _bench_modules() -> set[str]:
    """What bench scripts import by bare name (bench/ is on their sys.path); the `_`-named
    helper files are bench's internals, so their names are bench's to share."""
    return {p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_")}


def _private_imports(path: Path, ours: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level == 0 and module.split(".")[0] not in ours:
            continue  # another project's module (torch's privates are torch's business)
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {'.' * node.level}{module} "
                             f"import {alias.name}")
    return found


def test_no_module_imports_another_modules_private_names():
    """STYLE.md 11: what another module uses is public (no leading underscore, in `__all__`
    where the module has one); a private name imported elsewhere is a surface nobody declared."""
    ours = set(PRODUCT) | {p.stem for p in ROOT.glob("*.py")} | _bench_modules()
    files = _product_files() + sorted((ROOT / "bench").glob("*.py"))
    found = [f for path in files for f in _private_imports(path, ours)]
    assert not found, f"private names imported from another module (make them public): {found}"


def test_a_task_is_told_apart_by_its_spec():
    """STYLE.md 27: what differs by task is a field of its spec (bert/tasks/spec.py), so a
    `Task.X` test or a map keyed by tasks outside bert/tasks/ is a missing field. These are
    left, each for its reason."""
    from bert.tasks import Task

    left = {
        "bert/config/sections.py": 1,  # model.task's default, Task.PRETRAINING
        "bert/compare/spec.py": 1,  # the comparison's `squad:` stage takes a SQuAD config
    }
    found: dict[str, list[int]] = {}
    for path in _product_files():
        where = str(path.relative_to(ROOT))
        if where.startswith("bert/tasks/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Task"
                    and node.attr in Task.__members__):
                found.setdefault(where, []).append(node.lineno)
    extra = {f: lines for f, lines in found.items() if len(lines) > left.get(f, 0)}
    assert not extra, f"Task.X outside bert/tasks/ (read a field of task.spec instead, or add one): {extra}"


def test_no_benchmark_shadows_a_package_the_processes_it_spawns_import():
    """The benchmarks put bench/ on sys.path, and a spawned process (create_pretraining_data's
    workers, torchrun's) inherits the parent's sys.path: a bench/data.py there made every spawned
    worker import it as `data` after the first benchmark loaded in a test process, and the
    worker pool of create_pretraining_data restarted its dying workers for ever (a CI hang)."""
    import importlib.util
    import sys

    tops = {p.stem for p in ROOT.glob("*.py")} | {d.name for d in ROOT.iterdir() if (d / "__init__.py").exists()}
    away = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
    shadows = {}
    for bench in (ROOT / "bench").glob("*.py"):
        name = bench.stem
        if name in tops:
            shadows[name] = f"the repository's {name}"
        elif name not in sys.builtin_module_names:
            saved, sys.path[:] = sys.path[:], away
            try:
                found = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
            finally:
                sys.path[:] = saved
            if found is not None and found.origin and Path(found.origin).resolve().parent != ROOT / "bench":
                shadows[name] = found.origin
    assert not shadows, f"bench/ modules named like modules found elsewhere (rename them): {shadows}"
