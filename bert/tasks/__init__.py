"""The tasks: one `TaskSpec` per `Task` (spec.py), read by everything that differs by task."""
from bert.tasks.spec import SPECS, Task, TaskSpec, named

__all__ = ["SPECS", "Task", "TaskSpec", "named"]
