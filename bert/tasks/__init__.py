"""The tasks: one `TaskSpec` per `Task` (spec.py), read by everything that differs by task,
what a labelled task predicts (targets.py), and the jobs on the run loop: pre-training
(pretraining.py), SQuAD (squad.py), the tasks of labelled files (labelled.py), with the
fine-tunes' shared rows (rows.py), the figures (metrics.py) and the unigram baseline."""
from bert.tasks.spec import LABELLED, SPECS, Task, TaskSpec, named

__all__ = ["LABELLED", "SPECS", "Task", "TaskSpec", "named"]
