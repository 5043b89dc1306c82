#!/usr/bin/env python3
"""Scale-out on one machine: 1, 2 and 4 processes, whole replicas and replicated tensor sharding.

    python bench/scaling.py [--steps 6] [--bucket-mb 4]

For each process count N and sharding off/on it launches `torchrun --nproc-per-node N`
running this file as a worker, which trains a GroupBERT (h256, 4 layers, seq 128) on
the same global batch of 32 sequences per step (micro batch 8, gradient accumulation
4/N per replica) and measures, on rank 0:

- correctness first: the first steps' losses of every configuration must equal the
  one-process run's (fp32, ≤ 1e-5 relative), or the bench stops;
- bytes allocated per replica for the optimizer state (the two LAMB moment buffers)
  and for gradients (the flat gradient buffer, or the shard plus the most staging in
  flight), read from the buffers themselves;
- step time and tokens/s (threads per process: cores / N, at least 1);
- communication per step: the loopback interface's transmitted bytes (/proc/net/dev)
  over the timed steps, per process, against the theoretical volume of the
  collectives (ring all-reduce 2(N−1)/N·4P per step without sharding; with it, a
  reduce-scatter (N−1)/N·4P per micro-batch and an all-gather (N−1)/N·4P per step).

Results print as a table and go to bench/results/scaling.json (`rts_state_fraction_2`
and `rts_state_fraction_4`: per-replica optimizer-state bytes with RTS over without).

Two memory measurements follow, on the shipped model sizes:

- live gradient bytes during backward, GroupBERT-base (configs/groupbert_base.json,
  micro batch 1, 2 micro-batches, 25 MB buckets; RTS over 2 and 4 replicas, RTS over 2
  with the tied word embedding's two uses added up by autograd, and 2 whole replicas):
  every storage a gradient lives in, counted once while its memory is allocated
  (`LiveGradients`: each `.grad`, the reducer's buffers and shard, and every gradient
  an autograd node hands towards a parameter, which autograd may hold outside any
  `.grad`, in the model's bf16 too), read at every gradient a node hands over or the
  reducer takes and after every reduction launched; the peak over two steps, over the
  whole gradient buffer (4 bytes × parameters): `rts_grad_live_fraction_2/_4`; beside
  it each rank's state (weights, moments, gradient buffers) and peak RSS (VmHWM);
- a 4-stage GroupBERT-large pipeline (configs/groupbert_large.json, layers [6, 6, 6, 6],
  4 processes, micro batch 1, 4 micro-batches, synthetic data, 2 steps): each rank's
  peak RSS (VmHWM) against its own weights + optimizer state + gradients;
  `pipeline_peak_rss_over_stage_state` is the largest ratio, and the bound the issue
  sets is RSS ≤ 1.5 × state + 1 GiB on every rank.

    python bench/scaling.py --only memory         # just the two memory measurements
    python bench/scaling.py --only grad-memory    # just the live gradients (GroupBERT-base)
    python bench/scaling.py --smoke               # seconds: 1 and 2 processes of a tiny model

`--smoke` runs the step-time part on a tiny GroupBERT (hidden 48, 2 layers, seq 32, global
batch 8), 1 process and 2 with sharding off and on, one timed step each, the losses checked
against one process as in the full run; it writes no results file (tests/test_bench_smoke.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _start  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    parser.add_argument("--bucket-mb", type=float, default=4.0,
                        help="gradient bucket size (parallel.gradient_bucket_mb); RTS stages at most two")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rts", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-memory", choices=["grad", "pipeline"], help=argparse.SUPPRESS)
    parser.add_argument("--early-uses", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["memory", "grad-memory"],
                        help="run only the memory measurements (grad-memory: only the live gradients, GroupBERT-base)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: the step-time part on a tiny model, 1 and 2 processes; no results file")
    return parser


_start.check_packages(build_parser)  # before the imports that need the project's packages

import torch
import torch.distributed as dist

from bert import config_from_dict  # noqa: E402
from bert.data import SyntheticData  # noqa: E402
from bert.model import build_model  # noqa: E402
from session import SessionOptions, distributed  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402

GLOBAL_BATCH, MICRO = 32, 8
SMOKE_GLOBAL_BATCH, SMOKE_MICRO = 8, 2


def batch_sizes(smoke: bool) -> tuple[int, int]:
    """(global batch, micro batch) of the step-time measurement."""
    return (SMOKE_GLOBAL_BATCH, SMOKE_MICRO) if smoke else (GLOBAL_BATCH, MICRO)


def model_config(smoke: bool = False):
    _, micro = batch_sizes(smoke)
    model = ({"architecture": "groupbert", "hidden_size": 48, "num_layers": 2, "num_heads": 3, "vocab_size": 101,
              "sequence_length": 32, "max_predictions": 4} if smoke else
             {"architecture": "groupbert", "hidden_size": 256, "num_layers": 4, "num_heads": 4,
              "sequence_length": 128, "max_predictions": 20})
    return config_from_dict({
        "name": "scaling",
        "model": model,
        "training": {"steps": 100},
        "optimizer": {"learning_rate": 0.006},
        "schedule": {"warmup_steps": 2},
        "batch": {"micro_batch_size": micro},
        "data": {"source": "synthetic"},
    })


def loopback_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    return 0


def worker(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world))
    cfg = model_config(args.smoke)
    global_batch, micro = batch_sizes(args.smoke)
    accumulation = global_batch // micro // world
    spec = OptimizerSpec(kind="lamb", schedule=Schedule(0.006, 2, 100))
    options = SessionOptions(gradient_accumulation=accumulation, replicated_tensor_sharding=bool(args.rts),
                             gradient_bucket_mb=args.bucket_mb)
    # The launch context joins torchrun's process group (and runs the watchdog) around the session.
    with distributed.launch("cpu", fault_timeout=600), \
            TrainingSession(build_model(cfg.model, seed=0).builder.model_proto(), optimizer=spec, options=options,
                            seed=0) as session:
        topo = session.topology
        data = iter(SyntheticData(cfg, micro * accumulation, seed=0, replica=topo.replica, replicas=topo.replicas))
        losses = [session.run(next(data))["loss"] for _ in range(3)]  # correctness and warm-up
        if topo.distributed:
            dist.barrier()
        tx, start = loopback_tx_bytes(), time.perf_counter()
        for _ in range(args.steps):
            session.run(next(data))
        if topo.distributed:
            dist.barrier()
        seconds = (time.perf_counter() - start) / args.steps
        sent = (loopback_tx_bytes() - tx) / args.steps / world
        params = sum(p.numel() for _, p in session.named_weights())
        gradient_bytes = (session.reducer.gradient_bytes() if session.reducer is not None
                          else session.optimizer.flat_grads.nbytes)
        if topo.rank == 0:
            fraction = (world - 1) / world
            theory = (2 * fraction * 4 * params if not args.rts or world == 1 else
                      accumulation * fraction * 4 * params + fraction * 4 * params)
            result = {"processes": world, "rts": bool(args.rts), "threads_per_process": torch.get_num_threads(),
                      "parameters": params, "losses": losses, "step_s": seconds,
                      "tokens_per_s": global_batch * cfg.model.sequence_length / seconds,
                      "optimizer_state_bytes": session.optimizer.state_bytes(), "gradient_bytes": gradient_bytes,
                      "sent_bytes_per_step": sent, "theoretical_bytes_per_step": theory}
            Path(args.out).write_text(json.dumps(result))


class LiveGradients:
    """Every storage a gradient lives in during backward, each counted once, and the peak of their bytes.

    A storage counts from the moment it is seen holding a gradient until its memory is
    released, whoever holds it last: each parameter's `.grad`, the reducer's buffers
    (buckets being filled, uses taken early, reductions in flight, the shard) and every
    gradient an autograd node hands towards a parameter, which autograd itself may hold
    outside any `.grad` (the first use's gradient of the tied word embedding, until the
    last use adds to it), and what a node hands a cast of a parameter (autocast's bf16
    copy of a weight): the same gradient in the cast's dtype, before the cast makes it
    float32. Those are seen through a node hook on every node of the graph that gives a
    parameter or its cast a gradient, registered before the reducer's own. Each storage
    is followed by a weak reference, which expires exactly when its memory is freed, on
    any thread (a collective's thread may hold a buffer a moment after the reducer).
    Read at every gradient a node hands over, at every gradient the reducer takes and
    after every reduction it launches; `peak` is the largest reading. With `mark`, each
    reading is kept (`readings`: the storages counted, {data pointer: bytes}, and those
    freed since the previous one) and puts a profiler marker "live-gradients <n>" on the
    timeline, so a test can replay the allocator's own events against it.

    gloo's worker thread marks a reduction complete before it lets go of the reduction's
    tensors, so under load a finished reduction's buffer, which the reducer no longer
    holds, may stay alive a while on that thread (CI, 2 cores under load: up to three
    buffers). Such a storage is counted and also kept apart (`collective`);
    `peak_held` is the largest reading without it: what the reducer and autograd hold.
    """

    def __init__(self, session, mark: bool = False):
        import torch

        from session.replication import gradient_edges

        self.session, self.reducer, self.mark = session, session.reducer, mark
        self.peak = self.peak_held = 0
        self.at_peak: list[int] = []  # the bytes of each storage counted at the peak, largest first
        self.readings: list[dict] = []
        self._params = [p for _, p in session.named_weights()]
        self._tracked: dict[int, tuple[object, int, int]] = {}  # storage -> (weak reference, data pointer, bytes)
        self._finished: set[int] = set()  # the storages of reductions waited for
        with torch.enable_grad():
            accumulators = {p.view_as(p).grad_fn.next_functions[0][0]: i for i, p in enumerate(self._params)}
        reducer = self.reducer
        backward_of, take, launch, wait_oldest = (reducer.backward_of, reducer._take, reducer._launch,
                                                  reducer._wait_oldest)

        def watched_backward_of(microbatch, roots):
            outputs: dict[object, set[int]] = {}
            for through_casts in (False, True):  # what a cast receives, and the float32 it makes
                for uses in gradient_edges(roots, accumulators, through_casts).values():
                    for node, k in uses:
                        outputs.setdefault(node, set()).add(k)
            for node, ks in outputs.items():
                node.register_hook(lambda grads, _, ks=ks: self._handed_over([grads[k] for k in ks]))
            backward_of(microbatch, roots)

        def watched_take(index, microbatch):
            self.read()
            take(index, microbatch)

        def watched_launch(*unit):
            launch(*unit)
            self.read()

        def watched_wait_oldest():
            finished = reducer.pending[0]
            wait_oldest()
            self._finished.update(t.untyped_storage()._cdata for t in (finished.add, finished.keep) if t is not None)

        reducer.backward_of, reducer._take, reducer._launch = watched_backward_of, watched_take, watched_launch
        reducer._wait_oldest = watched_wait_oldest

    def _track(self, tensors) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        for t in tensors:
            storage = t.untyped_storage()
            if storage._cdata not in self._tracked and storage.nbytes():
                self._tracked[storage._cdata] = (StorageWeakRef(storage), storage.data_ptr(), storage.nbytes())

    def _handed_over(self, grads: list) -> None:
        self._track([g for g in grads if g is not None])
        self.read()

    def read(self) -> int:
        """Count now; returns the bytes."""
        import torch

        held = [p.grad for p in self._params if p.grad is not None] + self.reducer.buffers()
        self._track(held)
        held_keys = {t.untyped_storage()._cdata for t in held}
        live, freed, collective = {}, [], 0
        for key, (ref, pointer, nbytes) in list(self._tracked.items()):
            if ref.expired():
                del self._tracked[key]
                self._finished.discard(key)
                freed.append(pointer)
            else:
                live[pointer] = nbytes
                collective += nbytes if key in self._finished and key not in held_keys else 0
        total = sum(live.values())
        if total > self.peak:
            self.peak, self.at_peak = total, sorted(live.values(), reverse=True)
        self.peak_held = max(self.peak_held, total - collective)
        if self.mark:
            with torch.profiler.record_function(f"live-gradients {len(self.readings)}"):
                self.readings.append({"live": live, "freed": freed, "collective": collective})
        return total


def watch_live_gradients(session, mark: bool = False) -> LiveGradients:
    """Count the live gradient bytes of `session` (RTS or whole replicas) from now on."""
    return LiveGradients(session, mark)


def memory_worker(args: argparse.Namespace) -> None:
    """--worker-memory grad: live gradient peak; --worker-memory pipeline: peak RSS per rank."""
    import torch
    import torch.distributed as dist

    from bert import load_config, with_overrides
    from bert.data import SyntheticData
    from bert.tasks.pretraining import make_session
    from session import distributed

    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    name = "groupbert_base" if args.worker_memory == "grad" else "groupbert_large"
    cfg = load_config(ROOT / "configs" / f"{name}.json")
    overrides = {"batch.micro_batch_size": 1, "batch.gradient_accumulation": 2, "schedule.warmup_steps": 1,
                 "training.steps": 10, "parallel.replicated_tensor_sharding": bool(args.rts),
                 "data.source": "synthetic", "data.files": [], "data.eval_files": []}
    if args.worker_memory == "pipeline":
        overrides.update({"batch.gradient_accumulation": 4, "parallel.pipeline": True,
                          "model.layers_per_stage": [6, 6, 6, 6]})
    cfg = with_overrides(cfg, overrides, "bench/scaling.py")
    with distributed.launch("cpu", fault_timeout=600), make_session(cfg) as session:
        topo = session.topology
        data = iter(SyntheticData(cfg, cfg.batch.samples_per_replica, seed=0, replica=topo.replica,
                                  replicas=topo.replicas))
        built_rss = peak_rss_bytes()  # building: the graph, the weights drawn, then flattened by the optimizer
        if args.worker_memory == "grad":
            Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from VmRSS
        live = None
        if args.worker_memory == "grad":
            session.reducer.early_uses = bool(args.early_uses)
            live = watch_live_gradients(session)
        losses = [session.run(next(data) if session.needs_data else None)["loss"] for _ in range(2)]
        params = sum(math.prod(shape) for _, shape in session.weight_shapes)
        own = sum(p.numel() for _, p in session.named_weights())
        state = (4 * own + session.optimizer.state_bytes()
                 + (session.optimizer.flat_grads.nbytes if session.reducer is None else session.reducer.gradient_bytes()))
        rss = peak_rss_bytes()
        row = {"rank": topo.rank, "peak_live_gradient_bytes": live.peak if live else 0,
               "peak_held_gradient_bytes": live.peak_held if live else 0,  # less gloo's late frees
               "storages_at_peak": live.at_peak[:8] if live else [], "own_parameters": own,
               "stage_state_bytes": state, "peak_rss_bytes": max(rss, built_rss)}
        if args.worker_memory == "grad":  # the peaks of building and of the training steps apart
            row.update(peak_rss_build_bytes=built_rss, peak_rss_train_bytes=rss)
        rows = [None] * world if topo.rank == 0 else None
        dist.gather_object(row, rows, dst=0)
        if topo.rank == 0:
            Path(args.out).write_text(json.dumps({"parameters": params, "processes": world, "losses": losses,
                                                  "ranks": rows}))


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def launch(processes: int, rts: bool, steps: int, bucket_mb: float, out: Path, memory: str = "",
           early_uses: bool = True, smoke: bool = False) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               __file__, "--worker", "--rts", str(int(rts)), "--steps", str(steps), "--out", str(out),
               "--bucket-mb", str(bucket_mb), "--early-uses", str(int(early_uses))]
    command += ["--worker-memory", memory] if memory else []
    command += ["--smoke"] if smoke else []
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{processes} processes, rts={rts} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        return memory_worker(args) if args.worker_memory else worker(args)
    if args.smoke:
        args.steps = 1
        speed(args)
        print("smoke: 1 and 2 processes (sharding off and on) trained the same losses; no results file written")
        return
    out = ROOT / "bench" / "results" / "scaling.json"
    summary = json.loads(out.read_text()) if out.exists() else {}
    if args.only is None:
        summary.update(speed(args))
    summary.update(grad_memory())
    if args.only != "grad-memory":
        summary.update(memory())
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")


def grad_memory() -> dict:
    """Live gradients during backward, GroupBERT-base, micro batch 1, 2 micro-batches, 25 MB
    buckets: RTS over 2 and 4 replicas (the figures), RTS over 2 with the tied embedding's
    uses added up by autograd (as before they were taken early), and 2 whole replicas; each
    rank's peak RSS beside its state."""
    runs = [("rts_grad_live_fraction_2", 2, True, True), ("rts_grad_live_fraction_4", 4, True, True),
            ("rts_grad_live_fraction_2_summed_by_autograd", 2, True, False),
            ("whole_grad_live_fraction_2", 2, False, True)]
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for key, processes, rts, early in runs:
            got = launch(processes, rts, 2, 25.0, Path(tmp) / f"{key}.json", memory="grad", early_uses=early)
            whole = 4 * got["parameters"]
            peak = max(r["peak_live_gradient_bytes"] for r in got["ranks"])
            held = max(r["peak_held_gradient_bytes"] for r in got["ranks"])
            at_peak = max(got["ranks"], key=lambda r: r["peak_live_gradient_bytes"])["storages_at_peak"]
            rss = max(r["peak_rss_bytes"] for r in got["ranks"])
            train_rss = max(r["peak_rss_train_bytes"] for r in got["ranks"])
            state = max(r["stage_state_bytes"] for r in got["ranks"])
            results[key] = peak / whole
            rows.append({"key": key, "processes": processes, "rts": rts, "early_uses": early, "losses": got["losses"],
                         "peak_live_gradient_bytes": peak, "peak_held_gradient_bytes": held,
                         "storages_at_peak": at_peak, "whole_gradient_bytes": whole,
                         "state_bytes_per_rank": state, "peak_rss_bytes_per_rank": rss,
                         "peak_rss_train_bytes_per_rank": train_rss, "ranks": got["ranks"]})
            print(f"GroupBERT-base, {processes} {'replicas with RTS' if rts else 'whole replicas'}"
                  f"{'' if early else ', uses summed by autograd'}: live gradients peak at {peak / 2**20:.0f} MiB "
                  f"= {peak / whole:.3f} of the whole buffer ({whole / 2**20:.0f} MiB); state per rank "
                  f"{state / 2**30:.2f} GiB, peak RSS per rank {rss / 2**30:.2f} GiB (training steps: "
                  f"{train_rss / 2**30:.2f} GiB); at the peak (MiB): {[round(b / 2**20, 1) for b in at_peak]}", flush=True)
    for key, target in (("rts_grad_live_fraction_2", 0.7), ("rts_grad_live_fraction_4", 0.45)):
        print(f"{key} = {results[key]:.3f}: target ≤ {target} {'met' if results[key] <= target else 'NOT met'}")
    reference = next(r["losses"] for r in rows if r["processes"] == 2)
    for row in rows:  # the same training whichever way its gradients are reduced
        worst = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], reference))
        if row["processes"] == 2 and worst > 1e-5:
            raise SystemExit(f"{row['key']}: losses {row['losses']} differ from {reference} by {worst:.2e} relative")
    results["grad_memory_runs"] = rows
    results["grad_memory_load_average"] = os.getloadavg()
    results["grad_memory_command"] = "python bench/scaling.py --only grad-memory"
    return results


def memory() -> dict:
    """The pipeline's RSS (GroupBERT-large)."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        got = launch(4, False, 2, 25.0, Path(tmp) / "pipeline.json", memory="pipeline")
    ratios = []
    print("GroupBERT-large, 4 pipeline stages [6, 6, 6, 6], micro batch 1, 4 micro-batches:")
    for r in sorted(got["ranks"], key=lambda r: r["rank"]):
        ratio = r["peak_rss_bytes"] / r["stage_state_bytes"]
        bound = 1.5 * r["stage_state_bytes"] + 2**30
        ratios.append(ratio)
        print(f"  rank {r['rank']}: {r['own_parameters'] / 1e6:.1f} M parameters, state "
              f"{r['stage_state_bytes'] / 2**30:.2f} GiB, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB "
              f"= {ratio:.2f}× state; bound 1.5 × state + 1 GiB = {bound / 2**30:.2f} GiB "
              f"({'met' if r['peak_rss_bytes'] <= bound else 'NOT met'})", flush=True)
    results["pipeline_peak_rss_over_stage_state"] = max(ratios)
    results["pipeline_rss_within_bound"] = all(
        r["peak_rss_bytes"] <= 1.5 * r["stage_state_bytes"] + 2**30 for r in got["ranks"])
    results["pipeline_ranks"] = got["ranks"]
    results["memory_command"] = "python bench/scaling.py --only memory"
    return results


def speed(args: argparse.Namespace) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for processes in ((1, 2) if args.smoke else (1, 2, 4)):
            for rts in ((False,) if processes == 1 else (False, True)):
                rows.append(launch(processes, rts, args.steps, args.bucket_mb, Path(tmp) / f"{processes}-{int(rts)}.json",
                                   smoke=args.smoke))
                print(f"measured {processes} process(es), rts={rts}", flush=True)
    reference = rows[0]["losses"]
    for row in rows:  # correctness first: the same global batches give the same losses
        worst = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], reference))
        if worst > 1e-5:
            raise SystemExit(f"{row['processes']} processes rts={row['rts']}: losses {row['losses']} differ from "
                             f"one process {reference} by {worst:.2e} relative")
    whole = {r["processes"]: r for r in rows if not r["rts"]}
    model = model_config(args.smoke).model
    print(f"\nGroupBERT h{model.hidden_size} L{model.num_layers} seq {model.sequence_length}, "
          f"{rows[0]['parameters'] / 1e6:.1f} M parameters, global batch {batch_sizes(args.smoke)[0]}; "
          f"CPU: {cpu_model()} ({os.cpu_count()} cores)")
    print(f"{'procs':>5} {'RTS':>4} {'thr':>3} {'step s':>7} {'tok/s':>8} {'state MB':>9} {'vs whole':>8} "
          f"{'grad MB':>8} {'vs whole':>8} {'sent MB':>8} {'theory MB':>9}")
    for r in rows:
        base = whole[r["processes"]]
        print(f"{r['processes']:>5} {'on' if r['rts'] else 'off':>4} {r['threads_per_process']:>3} "
              f"{r['step_s']:>7.3f} {r['tokens_per_s']:>8.0f} {r['optimizer_state_bytes'] / 2**20:>9.1f} "
              f"{r['optimizer_state_bytes'] / base['optimizer_state_bytes']:>8.3f} "
              f"{r['gradient_bytes'] / 2**20:>8.1f} {r['gradient_bytes'] / base['gradient_bytes']:>8.3f} "
              f"{r['sent_bytes_per_step'] / 2**20:>8.1f} {r['theoretical_bytes_per_step'] / 2**20:>9.1f}")
    sharded = {r["processes"]: r for r in rows if r["rts"]}
    summary = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "command": "python bench/scaling.py",
        "gradient_bucket_mb": args.bucket_mb, "load_average": os.getloadavg(), "rows": rows,
    }
    for n in sharded:
        summary[f"rts_state_fraction_{n}"] = sharded[n]["optimizer_state_bytes"] / whole[n]["optimizer_state_bytes"]
        summary[f"rts_gradient_fraction_{n}"] = sharded[n]["gradient_bytes"] / whole[n]["gradient_bytes"]
    return summary


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
