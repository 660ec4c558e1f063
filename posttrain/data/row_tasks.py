"""Each row's task in a mixture, for multi-teacher distillation (``multi_teacher_distill``, ``--teachers TASK=MODEL``).

A row's task is the value of one column: ``task_column`` when the run names one; else, on a reasoning-gym row, its
family (``rg_entry["family"]``, :mod:`posttrain.data.tasks.reasoning_gym`), so ``reasoning-gym:chain_sum=2,
basic_arithmetic`` has the tasks ``chain_sum`` and ``basic_arithmetic``; else the column ``task`` of a ``--dataset``.
Values are compared as text, so a column of numbers names its tasks ``--teachers 0=...``.

Every row's task must have a teacher, and every teacher's task must appear in the rows: a teacher that never
scores a row is a mistyped task, not a spare.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from posttrain.config.sections import ConfigError, DataConfig
from posttrain.data.prompts import DataError

DATASET_COLUMN = "task"
"""The column naming a ``--dataset`` row's task when the run names none."""


def task_of(row: dict[str, Any], column: str | None) -> str | None:
    """``row``'s task as text (module docstring), or None when it names none."""
    if column is None and isinstance(row.get("rg_entry"), dict):
        return row["rg_entry"].get("family")
    value = row.get(column or DATASET_COLUMN)
    return None if value is None or value == "" else str(value)


def row_tasks(rows: list[dict[str, Any]], data: DataConfig, teachers: Collection[str], source: str) -> list[str]:
    """Each row's task, checked against the tasks that have ``teachers``: a DataError naming the first row that
    names no task, a ConfigError naming the first row whose task has no teacher, and one naming the teachers
    whose task no row has."""
    column = data.task_column
    tasks = []
    for number, row in enumerate(rows, start=1):
        task = task_of(row, column)
        if task is None:
            where = f"column {column or DATASET_COLUMN!r}" + ("" if column else " (nor a reasoning-gym family)")
            raise DataError(f"{source}: row {number} has no task in its {where}, which picks its teacher "
                            f"(columns: {', '.join(row)}); name the column that holds each row's task with "
                            "--task-column")
        if task not in teachers:
            raise ConfigError(f"teachers: {source}: row {number}'s task {task!r} has no teacher (teachers for: "
                              f"{', '.join(sorted(teachers))}); add --teachers {task}=MODEL")
        tasks.append(task)
    unused = sorted(set(teachers) - set(tasks))
    if unused:
        raise ConfigError(f"teachers: no row of {source} has the task {', '.join(map(repr, unused))} (tasks: "
                          f"{', '.join(sorted(set(tasks)))}); drop its --teachers entry or fix its name")
    return tasks
