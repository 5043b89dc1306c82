"""Scale-out with real torch.distributed processes (gloo, loopback), checked against one process.

Each test launches tests/distributed_worker.py under torchrun and compares what it wrote
with the same training in this process: replicas against gradient accumulation,
replicated tensor sharding against whole replicas, a 2-stage pipeline (and 2 stages ×
2 replicas) against the unpipelined graph, resumes across topologies.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.distributed_worker import MICRO, STEPS, make_session, train, weights
from tests.helpers import assert_close, sections, tiny_config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def torchrun(nproc: int, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc-per-node N args...`; the whole process group is
    killed when it overruns or the test fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        _kill_group(process)  # torchrun and any worker it left behind
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run_worker(nproc: int, scenario: str, out: Path, **env: str) -> str:
    # Every pipeline message carries a descriptor its receiver checks (session/pipeline.py).
    result = torchrun(nproc, "tests/distributed_worker.py", scenario, str(out),
                      env={"GROUPBERT_STRICT_P2P": "1", **env})
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


def assert_same_training(got: dict, losses: list[float], final: dict, what: str, rtol: float = 1e-5,
                         sign_steps: bool = False, noise: float = 1e-5) -> None:
    """`sign_steps`: the optimizer steps by the sign of the gradient (Lion), so the key bias,
    whose gradient is rounding noise, walks by ±lr on each side: it is left out. `noise`:
    the largest the key bias may grow from that noise (bf16's is larger)."""
    assert len(got["losses"]) == len(losses) >= 5
    assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol, f"{what}: losses")
    assert got["weights"].keys() == final.keys()
    for name, value in final.items():
        if name.endswith("key.bias") and sign_steps:
            continue
        if name.endswith("key.bias"):
            # Softmax cancels the key bias: its gradient is exactly zero, so both sides hold
            # rounding noise (which Adam's normalisation enlarges); it must stay noise.
            assert got["weights"][name].abs().max() < noise and value.abs().max() < noise, name
            continue
        assert_close(got["weights"][name], value, rtol, f"{what}: {name}")


@pytest.fixture(scope="module")
def replicas_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas")
    run_worker(2, "replicas", out)
    return out


def one_process(cfg, kind="lamb", steps=range(STEPS), **options):
    session = make_session(cfg, kind, **options)
    losses = train(session, cfg, steps, 2 * MICRO)
    return session, losses


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_two_replicas_equal_one_process_with_twice_the_accumulation(replicas_run, kind):
    cfg = tiny_config("groupbert")
    session, losses = one_process(cfg, kind, gradient_accumulation=2)
    got = torch.load(replicas_run / f"{kind}_rts0.pt")
    assert got["buckets"] > 3, "several buckets, reduced while backward runs"
    assert got["bucket_bytes"] <= 0.02 * 2**20 + 8, "tensors larger than a bucket (the FFN weights) span several"
    assert_same_training(got, losses, weights(session), f"2 replicas vs accumulation, {kind}")


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_sharded_replicas_equal_whole_replicas(replicas_run, kind):
    whole, sharded = (torch.load(replicas_run / f"{kind}_rts{i}.pt") for i in (0, 1))
    assert_same_training(sharded, whole["losses"], whole["weights"], f"RTS vs whole replicas, {kind}")
    # Bytes of the buffers each replica allocated: half the moments; for gradients, the
    # shard plus at most two buckets in flight (staging + its reduced chunk), never the
    # whole flat gradient buffer.
    assert sharded["state_bytes"] / whole["state_bytes"] <= 0.55
    in_flight = 2 * 1.5 * sharded["bucket_bytes"]
    assert sharded["gradient_bytes"] <= 0.51 * whole["gradient_bytes"] + in_flight < whole["gradient_bytes"]


@pytest.mark.parametrize("rule, replicas", [("lion", 2), ("lion", 4), ("sgd", 2)])
def test_a_rule_sharded_over_replicas_equals_one_process_and_resumes(tmp_path, rule, replicas):
    """The rules added beside LAMB and AdamW through the seam (Lion: one class; SGD with Nesterov
    momentum: its declaration and its class): sharded under RTS over 2 and 4 replicas each trains
    as one process with the same global batch, holds 1/R of the state, resumes its sharded
    checkpoint bit for bit on the same replicas, and in one process to the same losses."""
    run_worker(replicas, rule, tmp_path)
    cfg = tiny_config("groupbert")
    session, losses = one_process(cfg, rule, gradient_accumulation=replicas)
    final = weights(session)
    sharded = torch.load(tmp_path / f"{rule}_{replicas}_rts1.pt")
    sign = rule == "lion"  # steps by the gradient's sign
    assert_same_training(sharded, losses, final, f"{rule}, {replicas} sharded replicas", sign_steps=sign)
    assert sharded["state_bytes"] <= 1.01 * session.optimizer.state_bytes() / replicas + 4 * 2**10
    assert sharded["resumed"] == sharded["losses"][3:], "the same replicas resume bit for bit"
    assert all(torch.equal(sharded["resumed_weights"][n], w) for n, w in sharded["weights"].items())
    if replicas == 2:
        whole = torch.load(tmp_path / f"{rule}_2_rts0.pt")
        assert_same_training(whole, losses, final, f"{rule}, 2 whole replicas", sign_steps=sign)
    resumed = make_session(cfg, rule, gradient_accumulation=replicas)
    assert resumed.load(tmp_path / f"{rule}-{replicas}-checkpoint-3")["resharded_from"]["replicas"] == replicas
    assert_close(torch.tensor(train(resumed, cfg, range(3, STEPS), 2 * MICRO)), torch.tensor(sharded["losses"][3:]),
                 1e-5, f"one process after a {replicas}-replica {rule} checkpoint")


def test_sharded_gradients_alive_during_backward_are_the_shard_one_gradient_and_a_bucket(tmp_path):
    """Every storage a gradient lives in, autograd's own included, counted at every gradient a
    node hands over, every gradient the reducer takes and every reduction it launches, and
    checked against the allocator, in bf16 as the bench measures: at each reading, replaying
    the allocator's events (torch.profiler, profile_memory) up to the counter's marker,
    every storage counted is allocated with the bytes counted, and every allocation made
    since the step began that is not counted and that autograd did not save for backward
    (activations, the bf16 copy of a weight) is smaller than half a bucket. Taking the tied
    embedding's uses as produced (the projection's in bf16, before its cast), a replica
    holds the shard, one embedding-sized gradient and buckets (besides finished reductions'
    buffers that gloo's worker threads let go of late under load); added up by autograd, the
    first use's gradient (held outside any .grad) meets the last one's. Either way, and
    reduced by reduce-scatter, the training is the same: one process's in bf16, run with
    the workers' thread count (bf16 matmuls round differently with other blockings: 5e-3
    apart at 2 threads; 6e-6 at equal ones), and each other's (2e-8)."""
    run_worker(2, "live_gradients", tmp_path)
    got = torch.load(tmp_path / "live_gradients.pt")
    cfg = tiny_config("groupbert", vocab_size=6007, max_predictions=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(got["early"]["threads"])
    try:
        session, losses = one_process(cfg, gradient_accumulation=4, precision="bf16")
    finally:
        torch.set_num_threads(threads)
    final = weights(session)
    for name, run in got.items():
        assert_same_training(run, losses, final, f"2 sharded replicas, {name}", rtol=1e-4, noise=2e-3)
        if name != "early":  # the projection's use taken before its cast, or cast and added up by autograd
            assert_same_training(run, got["early"]["losses"], got["early"]["weights"], f"{name} vs early",
                                 noise=2e-3)
    for name in ("early", "summed"):
        run = got[name]
        assert run["largest"] > 0.4 * run["whole"], "the word embedding dominates this model"
        _check_counter_against_allocator(run, name)
    early, summed = got["early"], got["summed"]
    # Without what gloo's worker threads still hold of finished reductions (bench/scaling.py: under load).
    assert early["peak_held"] <= early["shard"] + early["largest"] + 1.5 * early["bucket"], (
        early["peak_held"], early["peak"])
    assert summed["peak"] >= summed["shard"] + 2 * summed["largest"], summed["peak"]


def test_the_weights_copy_trains_replicas_and_pipelines_as_a_cast_at_each_use(tmp_path):
    """weight_cast=shadow under replicated tensor sharding (the tied embedding's projection use
    taken by the reducer through the copy, as through autocast's cast) and pipelining with
    recompute: the same losses and weights as casts at each use, to the bit."""
    run_worker(2, "weight_shadow", tmp_path)
    got = torch.load(tmp_path / "weight_shadow.pt")
    for run in ("replicas", "pipeline"):
        shadow, cast = got[f"{run}_shadow"], got[f"{run}_autocast"]
        assert (shadow["policy"], cast["policy"]) == ("shadow", "autocast")
        assert shadow["losses"] == cast["losses"], run
        assert len(set(shadow["losses"])) == len(shadow["losses"]) >= 5
        assert shadow["weights"].keys() == cast["weights"].keys()
        assert all(torch.equal(shadow["weights"][n], cast["weights"][n]) for n in cast["weights"]), run


def _check_counter_against_allocator(run: dict, what: str) -> None:
    """Replay the allocator's events (address -> bytes); at each of the counter's markers,
    compare. The profiler records a free only on the thread that profiles: a buffer a
    collective's thread freed last (gloo's workers) has no event, so the replay also frees
    what the counter saw expire (its weak references see any thread), and an address
    allocated again was freed before. A storage autograd saved is no gradient until the
    allocator gives its address out again."""
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, event index of its allocation)
    saved: set[int] = set()
    marks, last_mark = 0, -1
    smallest_moved = run["bucket"] // 2
    for n, event in enumerate(run["timeline"]):
        if event[0] == "alloc":
            _, address, size = event
            saved.discard(address)
            if size > 0:
                live[address] = (size, n)
            else:
                live.pop(address, None)
            continue
        kind, index = event[1].split()
        if kind == "saved":
            saved.add(int(index))
            continue
        reading = run["readings"][int(index)]
        for address in reading["freed"]:
            if address in live and live[address][1] < last_mark:
                del live[address]
        last_mark = n
        marks += 1
        counted = reading["live"]
        for address, size in counted.items():
            if address in run["before"]:
                continue
            assert live.get(address, (None,))[0] == size, (
                f"{what}, {event[1]}: a counted storage of {size} bytes at {address:#x} is not allocated as such "
                f"(allocator: {live.get(address)})")
        missed = {a: size for a, (size, _) in live.items()
                  if a not in counted and a not in saved and size >= smallest_moved}
        assert not missed, (f"{what}, {event[1]}: allocations the counter does not count: "
                            f"{sorted(missed.values(), reverse=True)[:5]} bytes (counted {sum(counted.values())})")
    assert marks == len(run["readings"]) > 20, (what, marks, len(run["readings"]))


def test_sharded_checkpoint_resumes_in_one_process_and_in_four(replicas_run):
    cfg = tiny_config("groupbert")
    expected = torch.load(replicas_run / "lamb_rts1.pt")["after_checkpoint"]
    session = make_session(cfg, gradient_accumulation=2)
    extra = session.load(replicas_run / "checkpoint-3")
    assert extra["resharded_from"] == {"replicas": 2, "virtual_graphs": 1} and session.step == 3
    assert_close(torch.tensor(train(session, cfg, range(3, 5), 2 * MICRO)), torch.tensor(expected), 1e-5,
                 "1 process after a 2-replica checkpoint")
    run_worker(4, "resume4", replicas_run)
    four = torch.load(replicas_run / "resume4.pt")
    assert four["step"] == 5
    assert_close(torch.tensor(four["losses"]), torch.tensor(expected), 1e-5, "4 replicas after a 2-replica checkpoint")
    assert four["state_bytes"] / four["whole_state_bytes"] <= 0.3


@pytest.mark.parametrize("nproc", [2, 4])
def test_pipeline_equals_one_process(tmp_path, nproc):
    run_worker(nproc, "pipeline", tmp_path)
    for architecture in ("groupbert", "bert"):
        cfg = tiny_config(architecture, layers_per_stage=(1, 1))
        session, losses = one_process(cfg, gradient_accumulation=MICRO, recompute=True)
        got = torch.load(tmp_path / f"pipeline_{architecture}_{nproc}.pt")
        assert got["stages"] == [0, 2], "rank 0 holds the embeddings' stage and the heads' stage"
        if architecture == "groupbert":  # every stage's forward framed by the hooks, before its backward
            events, micro = got["hook_events"], MICRO // (nproc // 2)
            for m in range(micro):
                for stage in (0, 2):
                    at = events.index(("forward_of", m, stage, True))
                    assert events[at + 1] == ("forward_done", m, stage)
                assert events.index(("forward_done", m, 2)) < events.index(("backward_of", m, True))
                assert events.index(("end_microbatch", m)) > events.index(("backward_of", m, True))
            assert [e for e in events if e[0] == "forward_of"][:2] == [("forward_of", 0, 0, True),
                                                                      ("forward_of", 1, 0, True)], "1F1B warm-up"
        assert_same_training(got, losses, weights(session), f"{nproc // 2} × 2-stage pipeline, {architecture}")


def test_whole_gradient_replicas_accumulating_and_pipelined_equal_one_process(tmp_path):
    """The reducer's whole-gradient mode at accumulation > 1 (4 replicas × 2 micro-batches)
    and under pipelining (2 replicas × 2 stages × 2 micro-batches) equal one process taking
    the same rows in micro-batches of the same size."""
    run_worker(4, "whole_gradient_modes", tmp_path)
    cfg = tiny_config("groupbert")
    session, losses = one_process(cfg, gradient_accumulation=2 * MICRO)
    got = torch.load(tmp_path / "whole_accumulated.pt")
    assert_same_training(got, losses, weights(session), "4 whole replicas × accumulation 2")
    for architecture in ("groupbert", "bert"):
        cfg = tiny_config(architecture, layers_per_stage=(1, 1))
        session, losses = one_process(cfg, gradient_accumulation=MICRO)
        got = torch.load(tmp_path / f"whole_pipeline_{architecture}.pt")
        assert_same_training(got, losses, weights(session), f"2 whole replicas × 2 stages, {architecture}")


# ------------------------------------------------------------ bert.py, faults
def _pids_with(tag: str, rank: int) -> list[int]:
    """Processes started with GROUPBERT_TEST_TAG=tag and RANK=rank (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"GROUPBERT_TEST_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env:
            found.append(int(entry.name))
    return found


def _config_file(tmp_path: Path, **training) -> Path:
    cfg = {"name": "dist", "model": {"architecture": "groupbert", "hidden_size": 48, "num_layers": 2, "num_heads": 3,
                                     "vocab_size": 101, "sequence_length": 24, "max_predictions": 4,
                                     "max_positions": 64},
           **sections(micro_batch_size=4, learning_rate=0.01, warmup_steps=2, log_every=1,
                      output_dir=str(tmp_path / "run"), **training),
           "data": {"source": "synthetic"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.serial  # a fault seen within its wall-clock limits
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_a_failed_process_stops_the_others_naming_it_and_the_run_resumes(tmp_path, fault):
    timeout = 15
    config = _config_file(tmp_path, steps=100000, checkpoint_every=3, replicated_tensor_sharding=True,
                          fault_timeout=timeout)
    tag = uuid.uuid4().hex
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "bert.py",
               "--config", str(config)]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                       "GROUPBERT_TEST_TAG": tag},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "checkpoint-6").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-4000:]
            time.sleep(0.2)
        time.sleep(1)
        (victim,) = _pids_with(tag, rank=1)
        os.kill(victim, fault)
        start = time.monotonic()
        output, _ = process.communicate(timeout=90)
        stopped = time.monotonic() - start
    finally:
        _kill_group(process)
    # A dead process on this host is seen within a heartbeat; a stopped one by its silence,
    # and its dead man's switch ends it so that torchrun need not wait out its grace period.
    limit = 10 if fault == signal.SIGKILL else timeout + 10
    assert stopped < limit, f"the job still ran {stopped:.0f} s after rank 1 {fault.name}\n{output[-4000:]}"
    assert process.returncode != 0
    what = "died" if fault == signal.SIGKILL else "stopped responding"
    found = re.search(rf"error: rank 1 (?:in|after) step (\d+) \(([^)]*)\) {what}.*stopping rank 0\. the newest verified "
                      rf"checkpoint is (\S+): resume with --checkpoint-input", output)
    assert found, output[-4000:]
    checkpoints = sorted((tmp_path / "run").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    last = checkpoints[-1]
    assert found.group(3) == str(last), "the message names the newest checkpoint"
    # The step named is the one rank 1 was in (or had just done): rank 0 waits for it in the same
    # step, or one after.
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert int(found.group(1)) - logged in (0, 1), (found.group(0), logged)
    assert not _pids_with(tag, 0) and not _pids_with(tag, 1), "every worker is gone"
    step = int(last.name.split("-")[1])
    # One process resumes the run of two (another topology, other steps: a branch).
    result = subprocess.run([sys.executable, "bert.py", "--config", str(config), "--checkpoint-input", str(last),
                             "--training.steps", str(step + 2)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "run.1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines][-2:] == [step + 1, step + 2]


@pytest.mark.serial  # its step is timed against the fault timeout
def test_a_step_longer_than_the_fault_timeout_is_not_a_fault(tmp_path):
    """Liveness, not step length: a step of 3 × fault_timeout (2 s) finishes."""
    run_worker(2, "slow_step", tmp_path)
    got = torch.load(tmp_path / "slow_step.pt")
    assert got["seconds"] >= 6 and got["steps"] == 3, got


def test_each_rank_s_work_per_step_is_known_to_every_rank(tmp_path):
    run_worker(2, "slow_rank", tmp_path)
    every = torch.load(tmp_path / "slow_rank.pt")
    assert every[0] == every[1], "both ranks hold the same figures"
    for fast, slow in every[0]:
        assert slow - fast >= 0.35 and fast < 0.35, (fast, slow)


def test_schedule_is_one_forward_one_backward_per_stage():
    """BERT-Large's placement (5 stages on 4 virtual graphs, heads back on 0), 8 micro-batches."""
    from bert import build_model
    from session.pipeline import PipelinePlan, one_forward_one_backward

    cfg = tiny_config("bert", num_layers=4, layers_per_stage=(1, 1, 1, 1))
    plan = PipelinePlan(build_model(cfg).builder.model_proto(), ["loss"])
    assert [(s, i.virtual_graph) for s, i in plan.stages.items()] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 0)]
    actions = one_forward_one_backward(plan.stages, 8).actions
    stages = len(plan.stages)
    for k in range(stages):
        mine = [a for v in actions.values() for a in v if a.stage == k]
        forwards = [a.microbatch for a in mine if a.forward]
        backwards = [a.microbatch for a in mine if not a.forward]
        assert forwards == backwards == list(range(8))
        alive, peak = 0, 0
        for a in mine:
            alive += 1 if a.forward else -1
            peak = max(peak, alive)
        assert peak <= stages - k, f"stage {k} keeps {peak} micro-batches alive"
    assert sum(len(v) for v in actions.values()) == 2 * stages * 8


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
@pytest.mark.parametrize("layer_groups", [2, 3, 4])
@pytest.mark.parametrize("replicas", [1, 2])
def test_every_link_sends_in_the_order_its_receiver_posts_for_every_schedule(architecture, layer_groups, replicas):
    """NCCL's semantics, simulated: a send matches the receive its peer posts in the same place
    of the pair's sequence (no tags), and a pair's groups run one after another. For 1-8
    micro-batches, every process's operations (what each derives on its own) must pair up
    in order on every link, agree in shape and type, and run to the end without deadlock."""
    from bert import build_model
    from session.p2p import round_operations
    from session.pipeline import PipelinePlan, one_forward_one_backward

    cfg = tiny_config(architecture, num_layers=layer_groups, layers_per_stage=(1,) * layer_groups)
    plan = PipelinePlan(build_model(cfg).builder.model_proto(), ["loss", "mlm_accuracy"])
    names = {k: name for (name, _), k in plan.edges.items()}
    for microbatches in range(1, 9):
        schedule = one_forward_one_backward(plan.stages, microbatches)
        vg_of = {s: i.virtual_graph for s, i in plan.stages.items()}
        programs = {}  # rank -> [(round, kind, peer, message)]
        for replica in range(replicas):
            rank_of = {s: replica * plan.virtual_graphs + v for s, v in vg_of.items()}
            for v in range(plan.virtual_graphs):
                ops = round_operations(plan, schedule, v)
                programs[replica * plan.virtual_graphs + v] = [
                    (t, kind, rank_of[m.target_stage if kind == "send" else m.source_stage], m)
                    for t, round_ops in enumerate(ops) for kind, m in round_ops]
        links = defaultdict(lambda: ([], []))
        for rank, program in programs.items():
            for t, kind, peer, m in program:
                spec = plan.specs[names[m.edge]]
                entry = (m, spec.dims, spec.dtype)
                (links[(rank, peer)][0] if kind == "send" else links[(peer, rank)][1]).append((t, entry))
        for (src, dst), (sent, posted) in links.items():
            assert [e for _, e in sent] == [e for _, e in posted], f"link {src}->{dst}, {microbatches} micro-batches"
            assert [t for t, _ in sent] == [t for t, _ in posted], "each message sits in the same round on both ends"
        _run_like_nccl(plan, schedule, programs, replicas)


def _run_like_nccl(plan, schedule, programs, replicas) -> None:
    """Execute every process's ticks: an action needs its messages complete; a message
    completes when both ends have issued its round. Every action must run."""
    issued = defaultdict(set)  # rank -> rounds issued
    position = {rank: 0 for rank in programs}
    length = schedule.length
    while any(p < length for p in position.values()):
        moved = False
        for rank, t in position.items():
            if t >= length:
                continue
            v = rank % plan.virtual_graphs
            action = next((a for a in schedule.actions[v] if schedule.ticks[a] == t), None)
            needs = [(r, peer) for r, kind, peer, m in programs[rank] if kind == "recv" and action is not None
                     and m.target_stage == action.stage and m.microbatch == action.microbatch
                     and m.backward != action.forward and r < t]
            if all(r in issued[peer] and r in issued[rank] for r, peer in needs):
                issued[rank].add(t)
                position[rank] = t + 1
                moved = True
        assert moved, f"deadlock at ticks {position}"
