"""What a launch decides before and around the processes' work, checked in one process:
the rank layout (one function for the data share and the process groups), the device of
each process, the early refusal of a launch that does not fit, and who owns SIGINT/SIGTERM."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bert import load_config, with_overrides
from bert.data import data_share, run_layout
from session import distributed
from session.ranks import RankLayout, process_device, rank_layout

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ layout
@pytest.mark.parametrize("world, stages", [(1, 1), (4, 1), (2, 2), (6, 2), (12, 3), (8, 4)])
def test_every_rank_holds_one_replica_and_virtual_graph_and_every_pair_is_held_once(world, stages):
    layouts = [rank_layout(world, stages, None, rank) for rank in range(world)]
    assert {(l.replica, l.virtual_graph) for l in layouts} == \
        {(r, v) for r in range(world // stages) for v in range(stages)}
    for layout in layouts:
        assert layout.replicas * layout.virtual_graphs == world == layout.world_size
        assert layout.rank_of(layout.replica, layout.virtual_graph) == layout.rank
        # The stages of one replica are neighbours; a virtual graph's replicas are V apart.
        assert layout.rank == layout.replica * stages + layout.virtual_graph


def test_a_process_count_that_does_not_split_into_pipelines_names_the_counts_that_fit():
    with pytest.raises(ValueError, match=r"^3 processes do not split into replicas of 2 pipeline processes .*"
                                         r"`torchrun --nproc-per-node 2` \(1 replica\) or "
                                         r"`torchrun --nproc-per-node 4` \(2 replicas\)$"):
        rank_layout(3, 2, None, 2)
    with pytest.raises(ValueError, match=r"parallel.replication_factor 2 × 2 pipeline processes needs 4 processes, "
                                         r"but 6 were launched: launch with `torchrun --nproc-per-node 4 bert.py "
                                         r"...`; or leave parallel.replication_factor unset to use every process "
                                         r"\(3 replicas\)"):
        rank_layout(6, 2, 2, 0)
    with pytest.raises(ValueError, match="replication_factor 2 needs 2 processes, but 1 were launched"):
        rank_layout(1, 1, 2, 0)


def _pipeline_config(**training):
    config = load_config(ROOT / "configs" / "groupbert_large.json")
    return with_overrides(config, {"parallel.pipeline": True, "model.layers_per_stage": [6, 6, 6, 6],
                                   **{f"training.{k}": v for k, v in training.items()}})


@pytest.mark.parametrize("rank", range(8))
def test_the_data_share_is_the_layout_the_process_groups_are_made_from(monkeypatch, rank):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", str(rank))
    config = _pipeline_config()
    layout = run_layout(config)
    assert layout == rank_layout(8, 4, None, rank) == RankLayout(rank, 2, 4)
    assert data_share(config) == (rank // 4, 2)
    # make_topology takes the same function; Topology is the layout with its groups.
    assert issubclass(distributed.Topology, RankLayout) and distributed.rank_layout is rank_layout


def test_the_data_share_refuses_what_the_session_would_refuse(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="3 processes do not split into replicas of 4 pipeline processes"):
        data_share(_pipeline_config())


# ----------------------------------------------------------------- devices
def test_each_process_of_a_node_gets_its_own_gpu_or_an_index_is_refused_with_the_fix():
    launched = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "3"}
    assert process_device("cuda", launched) == "cuda:1"
    assert process_device("cpu", launched) == "cpu"
    with pytest.raises(ValueError, match=r"training.device 'cuda:0' puts all 2 processes of this node on one GPU: "
                                         r"give 'cuda' \(each process takes the GPU of its LOCAL_RANK\)"):
        process_device("cuda:0", launched)
    one_per_node = {**launched, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert process_device("cuda:1", one_per_node) == "cuda:1", "one process per node may pick its GPU"
    assert process_device("cuda:1", {}) == "cuda:1" and process_device("cuda", {}) == "cuda"


@pytest.mark.slow
@pytest.mark.parametrize("argv, expected", [
    (["--training.log_every", "5"], "error: data.eval_files ['data/pretraining/seq128/eval/*.hdf5'] match no file"),
    (["--parallel.pipeline", "true", "--model.layers_per_stage", "[12, 12]"],
     "error: 3 processes do not split into replicas of 2 pipeline processes"),
], ids=["missing-data", "process-count"])
def test_a_launch_that_cannot_run_is_refused_before_torch_is_imported(tmp_path, argv, expected):
    """configs/groupbert_large.json without its shards, with overrides, as rank 2 of 3."""
    probe = ("import runpy, sys; code = runpy.run_path('bert.py')['main'](sys.argv[1:]); "
             "print(code, 'torch' in sys.modules, ','.join(sorted(m for m in sys.modules if m.startswith('session'))))")
    done = subprocess.run([sys.executable, "-c", probe, "--config", "configs/groupbert_large.json", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "3", "RANK": "2", "LOCAL_WORLD_SIZE": "3"})
    assert done.stderr.startswith(expected) and len(done.stderr.strip().splitlines()) == 1, done.stderr
    code, torch_imported, session_modules = done.stdout.split()
    assert code == "2" and torch_imported == "False", done.stdout
    torch_free = {"session", "session.ranks", "session.kernel_choices", "session.process"}
    assert set(session_modules.split(",")) <= torch_free, session_modules


# ----------------------------------------------------------------- signals
@pytest.fixture
def handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield before
    for s, handler in before.items():
        signal.signal(s, handler)


def test_the_launch_context_owns_the_signals_and_gives_them_back(handlers):
    with distributed.launch("cpu") as world:
        assert signal.getsignal(signal.SIGTERM) == world._on_signal == signal.getsignal(signal.SIGINT)
        with pytest.raises(SystemExit) as stopped:
            signal.raise_signal(signal.SIGTERM)
        assert stopped.value.code == 128 + signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert {s: signal.getsignal(s) for s in handlers} == handlers


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_in_a_stoppable_block_the_first_signal_asks_to_stop_and_the_second_stops_now(handlers, signum, capsys):
    asked = []
    with distributed.launch("cpu") as world:
        with world.stop_on_signal(lambda: asked.append(True), announce=True) as stop:
            signal.raise_signal(signum)
            assert asked == [True] and stop.signum == signum
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGTERM)
            assert asked == [True], "the second signal does not ask again"
        with pytest.raises(SystemExit if signum == signal.SIGTERM else KeyboardInterrupt):
            signal.raise_signal(signum)  # outside the block: at once
    assert f"{signal.Signals(signum).name}: stopping after this step" in capsys.readouterr().out
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_bert_py_runs_with_the_process_settings_the_benchmarks_measure_with(monkeypatch, capsys):
    """session.process's settings (glibc keeping freed memory: 10 % of a CPU step) are applied
    by bert.py itself, so the benchmarks' tokens/s are what a run gets."""
    import runpy

    import session.process

    assert session.process.retain_freed_memory(), "glibc takes the setting"
    calls = []
    monkeypatch.setattr(session.process, "retain_freed_memory", lambda: calls.append(1) or True)
    main = runpy.run_path(str(ROOT / "bert.py"))["main"]
    assert main(["summary", "--config", str(ROOT / "configs" / "demo.json")]) == 0
    assert calls == [1]
    for bench in ("train_throughput.py", "step_profile.py"):
        assert "retain_freed_memory()" in (ROOT / "bench" / bench).read_text(), bench
