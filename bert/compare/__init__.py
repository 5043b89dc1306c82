"""`python bert.py compare spec.yaml [--output-dir DIR]`: two or more configurations compared at
an equal budget of training FLOPs (or seconds), each at its best point of a grid (learning rates,
through the sweeps), over several seeds, each winner fine-tuned on a labelled task (and SQuAD), in
one report.

- `spec`: the YAML read and checked (`load_compare`);
- `run`: the sweeps of each stage, resumable and shared by several workers (`run_compare`);
- `report`: the report from the runs' own files, "FLOPs to reach" included (`write_compare_report`).

docs/quality.md describes the YAML, the report, and a study recorded with it.
"""
from bert.compare.report import Reach, curve, mean_curve, plateau_note, reach, write_compare_report
from bert.compare.run import CompareRuns, run_compare
from bert.compare.spec import CompareSpec, compare_from_dict, load_compare

__all__ = ["CompareRuns", "CompareSpec", "Reach", "compare", "compare_from_dict", "curve", "load_compare",
           "mean_curve", "reach", "run_compare", "write_compare_report"]


def compare(path, output_dir=None, overrides=None, use_wandb: bool = False, progress: bool = True) -> dict:
    """The whole command: read the spec, run (or continue) its sweeps, write the report."""
    spec = load_compare(path, overrides)
    runs = run_compare(spec, output_dir, use_wandb=use_wandb, progress=progress)
    report = write_compare_report(spec, runs, use_wandb=use_wandb)
    print(f"report: {report['report']} (and runs.csv, curves.csv, reach.csv, *.png)", flush=True)
    for line in report["verdict"]:
        print(line.strip().removeprefix("- ").replace("**", "").replace("`", ""), flush=True)
    for r in report["reach"]:
        note = plateau_note(r, report["stuck"])
        note = f" ({note})" if note else ""
        if r.flops is None:
            print(f"{r.x} does not reach {r.y}'s final {spec.metric} {r.target:.4g} within its budget{note}", flush=True)
            continue
        low, high = r.bracket
        refused = report["seconds_refused"][(r.x, r.y)]
        seconds = (f"seconds not compared: {refused}" if refused else
                   f"{r.bound}{r.seconds:.4g} s ({r.bound}{r.seconds_ratio:.3f} of {r.y}'s)")
        print(f"{r.x} reaches {r.y}'s final {spec.metric} {r.target:.4g} at {r.bound}{r.flops:.4g} FLOPs "
              f"({r.bound}{r.flops_ratio:.3f} of {r.y}'s, between {low:.3f} and {high:.3f}) and {seconds}{note}",
              flush=True)
    return report
