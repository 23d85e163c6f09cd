"""Tasks by short name: the entry-point group ``fed_dp.tasks``, read from the installed metadata.

A run names its task by ``task.ref``: a registered short name (``heavy-tail``), or ``package.module:factory``.
fed-dp's own tasks are registered in pyproject.toml's ``[project.entry-points."fed_dp.tasks"]``, any other
installed package can register its own the same way, and the core reads the names here without importing a task
(``fed_dp.run_schema.TaskSettings`` checks ``task.ref`` against them; ``fed_dp.clients.task.load_task`` loads one).
"""

from __future__ import annotations

import functools
import importlib.metadata

from fed_dp.validation import require as _check

#: The entry-point group of tasks by short name (``task.ref = "heavy-tail"``): fed-dp's own built-in tasks
#: (``fed_dp.simulations.tasks.builtin``, declared in pyproject.toml's ``[project.entry-points."fed_dp.tasks"]``)
#: and those any other installed package registers the same way. Any other task is named ``package.module:factory``.
TASK_GROUP = "fed_dp.tasks"


@functools.cache
def registered_tasks() -> dict[str, str]:
    """Short name → ``package.module:factory`` of every task registered under :data:`TASK_GROUP` by an installed
    distribution, read from the installed metadata (``importlib.metadata``) without importing any task: the core
    finds the built-in tasks without naming the layer that defines them. A name two distributions register with
    different factories is refused."""
    tasks: dict[str, str] = {}
    for entry in importlib.metadata.entry_points(group=TASK_GROUP):
        _check(tasks.get(entry.name, entry.value) == entry.value,
               f"the task name {entry.name!r} is registered twice under the entry-point group {TASK_GROUP!r}, as "
               f"{tasks.get(entry.name)!r} and {entry.value!r}: uninstall one of the packages that register it")
        tasks[entry.name] = entry.value
    return tasks


def _unknown_task(ref: str) -> str:
    """What to say about a ``task.ref`` that is neither a registered name nor ``package.module:factory``."""
    names = registered_tasks()
    if not names:
        return (f"task.ref {ref!r} is not 'package.module:factory', and no task names are registered (entry-point "
                f"group {TASK_GROUP!r}): fed-dp's installed metadata is missing or stale; reinstall it "
                "(pip install -e . in a checkout)")
    return f"task.ref {ref!r} is neither a built-in task ({', '.join(names)}) nor 'package.module:factory'"
