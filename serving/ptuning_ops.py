"""The p-tuning admin operations as typed requests, from the gateway's routes to a model's replica.

serving/ptuning_api.py builds one per admin call and the model's backend carries it (in process, or
through Ray to one ModelServer replica), where serving.ptuning_admin.PtuningAdmin.run calls the
method it names. Values come as the client sent them (JSON): the replica checks them and its errors
name the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ListTasks:
    """The model's loaded p-tuned tasks."""


@dataclass(frozen=True)
class AddTask:
    """Copy the PEFT prompt adapter at `path` into the model's ptuning/<name> and load it."""

    name: Any
    path: Any


@dataclass(frozen=True)
class DeleteTask:
    name: Any


@dataclass(frozen=True)
class StartJob:
    """Train task `task` on `data` (inline JSONL) or the file at `dataset_path`, with `recipe`
    overrides of training.ptune_recipe.PtuneRecipe."""

    task: Any
    data: Any = None
    dataset_path: Any = None
    recipe: Any = None


@dataclass(frozen=True)
class GetJob:
    job_id: Any


@dataclass(frozen=True)
class ListJobs:
    """Every job of the model, oldest first."""


@dataclass(frozen=True)
class CancelJob:
    job_id: Any


PtuningOp = ListTasks | AddTask | DeleteTask | StartJob | GetJob | ListJobs | CancelJob
