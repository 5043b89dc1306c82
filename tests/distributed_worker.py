"""Scenarios run under torchrun by tests/test_distributed.py: `torchrun ... distributed_worker.py SCENARIO OUT`.

Each scenario trains tiny models with real torch.distributed processes (gloo) and
writes what the test compares, from rank 0, into OUT: losses per step, final weights
(.pt), byte counts. The references (one process) are computed by the test itself.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bert import build_model  # noqa: E402
from session import SessionOptions, distributed  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402
from tests.helpers import random_batch, tiny_config  # noqa: E402

STEPS = 5
MICRO = 4


def make_session(cfg, kind="lamb", **options) -> TrainingSession:
    lr = 0.002 if kind == "lion" else 0.02  # Lion's step is ±lr per element
    own = {"sgd": {"momentum": 0.8, "nesterov": True}}.get(kind, {})
    spec = OptimizerSpec(kind=kind, schedule=Schedule(lr, 2, 10), max_grad_norm=5.0, hyperparameters=own)
    return TrainingSession(build_model(cfg, seed=3).builder.model_proto(), optimizer=spec,
                           options=SessionOptions(**options), seed=3)


def global_batch(cfg, step: int, rows: int) -> dict:
    """The rows of one step, the same for every topology (padding and unused slots included)."""
    return random_batch(cfg, rows, seed=100 + step, pad_from=2)


def my_rows(batch: dict, replica: int, replicas: int) -> dict:
    rows = next(iter(batch.values())).shape[0] // replicas
    return {k: v[replica * rows : (replica + 1) * rows] for k, v in batch.items()}


def train(session: TrainingSession, cfg, steps, rows: int) -> list[float]:
    topo = session.topology
    losses = []
    for step in steps:
        batch = my_rows(global_batch(cfg, step, rows), topo.replica, topo.replicas)
        losses.append(session.run(batch if session.needs_data else None)["loss"])
    return losses


def weights(session: TrainingSession) -> dict:
    proto = session.model_proto()  # collective
    if proto is None:
        return {}
    import onnx.numpy_helper

    return {t.name: torch.from_numpy(onnx.numpy_helper.to_array(t).copy()) for t in proto.graph.initializer}


def write(out: Path, name: str, payload) -> None:
    if dist.get_rank() == 0:
        torch.save(payload, out / f"{name}.pt")


def scenario_replicas(out: Path) -> None:
    """2 replicas, whole gradients (several buckets), and sharded, LAMB and AdamW."""
    cfg = tiny_config("groupbert")
    for kind in ("lamb", "adamw"):
        for rts in (False, True):
            session = make_session(cfg, kind, replicated_tensor_sharding=rts, gradient_bucket_mb=0.02)
            losses = train(session, cfg, range(STEPS), 2 * MICRO)
            payload = {"losses": losses, "weights": weights(session),
                       "state_bytes": session.optimizer.state_bytes(),
                       "gradient_bytes": session.reducer.gradient_bytes(),
                       "buckets": len(session.optimizer.layout.buckets),
                       "bucket_bytes": 4 * max(b - a for a, b in session.optimizer.layout.buckets)}
            if kind == "lamb" and rts:
                # A sharded checkpoint after 3 steps, then the two losses that follow it.
                session = make_session(cfg, kind, replicated_tensor_sharding=True, gradient_bucket_mb=0.02)
                train(session, cfg, range(3), 2 * MICRO)
                session.save(out / "checkpoint-3", {"note": f"rank {dist.get_rank()}"})
                payload["after_checkpoint"] = train(session, cfg, range(3, 5), 2 * MICRO)
            write(out, f"{kind}_rts{int(rts)}", payload)


def _rule_sharded(out: Path, kind: str) -> None:
    """A rule sharded over every process (2 or 4 replicas), and (2 processes) whole; a sharded
    checkpoint after 3 steps, the losses that follow it, and those of sharded replicas that
    resume from it."""
    cfg = tiny_config("groupbert")
    world = dist.get_world_size()
    for rts in (True, False) if world == 2 else (True,):
        session = make_session(cfg, kind, replicated_tensor_sharding=rts, gradient_bucket_mb=0.02)
        losses = train(session, cfg, range(3), 2 * MICRO)
        if rts:
            session.save(out / f"{kind}-{world}-checkpoint-3")
        losses += train(session, cfg, range(3, STEPS), 2 * MICRO)
        payload = {"losses": losses, "weights": weights(session), "state_bytes": session.optimizer.state_bytes()}
        if rts:
            resumed = make_session(cfg, kind, replicated_tensor_sharding=True, gradient_bucket_mb=0.02)
            resumed.load(out / f"{kind}-{world}-checkpoint-3")
            payload["resumed"] = train(resumed, cfg, range(3, STEPS), 2 * MICRO)
            payload["resumed_weights"] = weights(resumed)
        write(out, f"{kind}_{world}_rts{int(rts)}", payload)


def scenario_lion(out: Path) -> None:
    _rule_sharded(out, "lion")


def scenario_sgd(out: Path) -> None:
    _rule_sharded(out, "sgd")


def scenario_resume4(out: Path) -> None:
    """A checkpoint of 2 sharded replicas resumed by 4 sharded replicas; their state bytes."""
    cfg = tiny_config("groupbert")
    session = make_session(cfg, replicated_tensor_sharding=True, gradient_bucket_mb=0.02)
    extra = session.load(out / "checkpoint-3")
    losses = train(session, cfg, range(3, 5), 2 * MICRO)
    whole = make_session(cfg, replicated_tensor_sharding=False)
    write(out, "resume4", {"losses": losses, "extra": extra, "step": session.step,
                           "state_bytes": session.optimizer.state_bytes(),
                           "whole_state_bytes": whole.optimizer.state_bytes()})


def scenario_pipeline(out: Path) -> None:
    """GroupBERT and BERT cut into stages (heads back on virtual graph 0), M micro-batches;
    with 4 processes: 2 stages × 2 replicas, sharded within each stage's replicas."""
    replicas = int(os.environ["WORLD_SIZE"]) // 2
    for architecture in ("groupbert", "bert"):
        cfg = tiny_config(architecture, layers_per_stage=(1, 1))
        session = make_session(cfg, pipelining=True, gradient_accumulation=MICRO // replicas,
                               replicated_tensor_sharding=replicas > 1, recompute=True)
        losses = train(session, cfg, range(STEPS), 2 * MICRO)
        events = _hook_events(session, cfg) if architecture == "groupbert" else []
        write(out, f"pipeline_{architecture}_{dist.get_world_size()}",
              {"losses": losses, "weights": weights(session), "stages": sorted(session.executor.graphs),
               "hook_events": events})


def _hook_events(session: TrainingSession, cfg) -> list[tuple]:
    """What the pipelined executor tells GradientHooks in one step on rank 0 (its stages 0 and 2)."""
    from tests.test_training import RecordingHooks

    hooks = RecordingHooks()
    batch = my_rows(global_batch(cfg, 0, 2 * MICRO), session.topology.replica, session.topology.replicas)
    session.executor.train_step(session._feeds(batch if session.needs_data else None, session.input_names), 1.0,
                                hooks)
    session.optimizer.zero_grad()
    return hooks.events


def scenario_whole_gradient_modes(out: Path) -> None:
    """Whole-gradient replicas (no sharding) in the two reducer modes the other scenarios
    leave out: 4 replicas at gradient accumulation 2, and 2 pipelines of 2 stages at
    accumulation 2 (the reduction waits for each weight's last micro-batch)."""
    cfg = tiny_config("groupbert")
    session = make_session(cfg, gradient_accumulation=2, gradient_bucket_mb=0.02)
    write(out, "whole_accumulated", {"losses": train(session, cfg, range(STEPS), 2 * MICRO),
                                     "weights": weights(session)})
    session.close()
    for architecture in ("groupbert", "bert"):
        cfg = tiny_config(architecture, layers_per_stage=(1, 1))
        session = make_session(cfg, pipelining=True, gradient_accumulation=2, gradient_bucket_mb=0.02)
        losses = train(session, cfg, range(STEPS), 2 * MICRO)
        write(out, f"whole_pipeline_{architecture}", {"losses": losses, "weights": weights(session)})
        session.close()


def scenario_live_gradients(out: Path) -> None:
    """RTS over 2 replicas on a model whose tied word embedding is most of it: its uses taken
    as produced (`early_uses`, the default), added up by autograd instead, and taken early
    but reduced by reduce-scatter (NCCL's way; gloo's default is an all-reduce in place).
    In bf16, as bench/scaling.py measures. Each run's losses and weights, the live-gradient
    counter's readings and, over the third step, the allocator's own events (torch.profiler
    with profile_memory: every allocation and free, with its address) beside the counter's
    markers and a marker for each storage autograd saves for backward (activations, the
    bf16 copies of weights: not gradients), for the test to replay."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from scaling import watch_live_gradients

    cfg = tiny_config("groupbert", vocab_size=6007, max_predictions=2)
    payload = {}
    for name, early, in_place in (("early", True, True), ("summed", False, True), ("reduce_scatter", True, False)):
        session = make_session(cfg, replicated_tensor_sharding=True, gradient_bucket_mb=0.25, gradient_accumulation=2,
                               precision="bf16")
        session.reducer.early_uses, session.reducer.in_place = early, in_place
        live = watch_live_gradients(session, mark=True)
        losses = train(session, cfg, range(2), 2 * MICRO)
        live.readings.clear()
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, profile_memory=True) as profile, \
                torch.autograd.graph.saved_tensors_hooks(mark_saved, lambda saved: saved):
            losses += train(session, cfg, range(2, 3), 2 * MICRO)
        readings, live.mark = live.readings, False
        losses += train(session, cfg, range(3, STEPS), 2 * MICRO)
        layout = session.optimizer.layout
        payload[name] = {
            "losses": losses, "weights": weights(session),
            "peak": live.peak, "peak_held": live.peak_held, "readings": readings, "timeline": allocator_timeline(profile),
            "whole": 4 * sum(layout.numels), "largest": 4 * max(layout.numels),
            "bucket": 4 * max(b - a for a, b in layout.buckets), "shard": session.optimizer.holding.grad_shard.nbytes,
            "threads": torch.get_num_threads(),
            "before": [session.optimizer.holding.grad_shard.untyped_storage().data_ptr()]}
        session.close()
    write(out, "live_gradients", payload)


def scenario_weight_shadow(out: Path) -> None:
    """bf16 with the weights' copy made once per step (weight_cast=shadow) and with a cast at
    each use: 2 sharded replicas of a model whose tied word embedding's projection use the
    reducer takes as it is produced (through the copy, as through a cast), and 2 pipeline
    stages with recompute. Each run's losses and weights, for the test to compare."""
    payload = {}
    for weight_cast in ("shadow", "autocast"):
        kernels = {"weight_cast": weight_cast}
        cfg = tiny_config("groupbert", vocab_size=6007, max_predictions=2)
        session = make_session(cfg, replicated_tensor_sharding=True, gradient_bucket_mb=0.25, gradient_accumulation=2,
                               precision="bf16", kernels=kernels)
        payload[f"replicas_{weight_cast}"] = {"losses": train(session, cfg, range(STEPS), 2 * MICRO),
                                              "weights": weights(session), "policy": session.policy.weight_cast}
        session.close()
        cfg = tiny_config("bert", layers_per_stage=(1, 1))
        session = make_session(cfg, pipelining=True, gradient_accumulation=MICRO, recompute=True, precision="bf16",
                               kernels=kernels)
        payload[f"pipeline_{weight_cast}"] = {"losses": train(session, cfg, range(STEPS), 2 * MICRO),
                                              "weights": weights(session), "policy": session.policy.weight_cast}
        session.close()
    write(out, "weight_shadow", payload)


def mark_saved(tensor: torch.Tensor) -> torch.Tensor:
    """A pack hook: a profiler marker "saved <address>" for the storage autograd saves."""
    with torch.profiler.record_function(f"saved {tensor.untyped_storage().data_ptr()}"):
        return tensor


def allocator_timeline(profile) -> list[tuple]:
    """The CPU allocator's events of a profile in time order: ("alloc", address, bytes) (bytes < 0:
    a free) and ("mark", name) for each record_function marker of the counter's and mark_saved's."""
    events, stack = [], list(profile.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            events.append((event.start_time_ns, ("alloc", fields.ptr, fields.alloc_size)))
        elif event.name.startswith(("live-gradients ", "saved ")):
            events.append((event.start_time_ns, ("mark", event.name)))
    return [e for _, e in sorted(events, key=lambda item: item[0])]


def scenario_slow_step(out: Path) -> None:
    """fault_timeout 2 s, and one step of rank 1 that takes over 6 s: the run goes on."""
    import time

    cfg = tiny_config("groupbert")
    session = make_session(cfg, gradient_accumulation=1)
    started = time.monotonic()
    for step in range(3):
        if step == 1 and dist.get_rank() == 1:
            time.sleep(6.5)  # computing (the heartbeat thread goes on), not waiting for a peer
        session.run(my_rows(global_batch(cfg, step, 8), session.topology.replica, session.topology.replicas))
    write(out, "slow_step", {"seconds": time.monotonic() - started, "steps": session.step})


def scenario_slow_rank(out: Path) -> None:
    """Rank 1's forward and backward take 0.4 s longer each step: every rank's record of each
    rank's work shows it (rank 1's wait for rank 0 in the gradient reduction is no work)."""
    import time

    cfg = tiny_config("groupbert")
    session = make_session(cfg, gradient_accumulation=1)
    if dist.get_rank() == 1:
        inner = session.executor.train_step

        def slow(*args, **kwargs):
            time.sleep(0.4)
            return inner(*args, **kwargs)

        session.executor.train_step = slow
    seen = []
    for step in range(3):
        session.run(my_rows(global_batch(cfg, step, 8), session.topology.replica, session.topology.replicas))
        seen.append(list(session.rank_seconds))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, seen)
    write(out, "slow_rank", every)


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    import signal
    import threading

    handler = signal.getsignal(signal.SIGTERM)
    with distributed.launch("cpu", fault_timeout=2 if scenario == "slow_step" else 60):
        globals()[f"scenario_{scenario}"](out)
    # The launch context leaves nothing behind: no watchdog thread, the signal handler it
    # replaced, no process group.
    assert not [t for t in threading.enumerate() if t.name == "groupbert-watchdog"]
    assert signal.getsignal(signal.SIGTERM) is handler and not dist.is_initialized()
