"""Where running cells sends what it produces: the run folder and the progress display (`FolderOutcomes`), or a
list a Ray worker returns for the driver to replay (`CollectedOutcomes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvbench.config.cells import Cell
from kvbench.runs.run_folder import RunFolder, union_models


@dataclass
class Progress:
    """What the progress display shows; the sweep calls `update` as it goes."""

    cells_total: int
    samples_total: int
    update: Callable[[Progress], None] = lambda progress: None
    cells_done: int = 0
    samples_done: int = 0
    current: str = ""
    model: str = ""  # the model and dtype running, when the grid has several
    log: list[str] = field(default_factory=list)  # cells that failed, to tell the user
    notes: list[str] = field(default_factory=list)  # what an executor tells as it goes (Ray's workers)

    def log_failure(self, cell: Cell, message: str) -> None:
        self.log.append(f"{self.model}: {cell.label}: {message}" if self.model else f"{cell.label}: {message}")


class Outcomes(Protocol):
    """Where running cells sends what it produces, in the order it happens. A local sweep's is the run folder
    (`FolderOutcomes`); a Ray worker's collects them (`CollectedOutcomes`) for the driver to replay into its own."""

    def model_loaded(self, described: dict[str, Any]) -> None:
        """A model loaded to run cells: `LoadedModel.describe()`."""

    def running(self, label: str) -> None:
        """The (cell, sample) starting now."""

    def record(self, record: dict[str, Any], traces: list[dict[str, Any]] | None) -> None:
        """A scored sample, with its memory time series when tracing."""

    def cell(self, status: dict[str, Any], failure: str | None) -> None:
        """A cell's final status line; `failure` is what to tell the user when it failed."""


class FolderOutcomes:
    """Outcomes written into the run folder as they come, and counted on the progress display."""

    def __init__(self, folder: RunFolder, progress: Progress) -> None:
        self.folder = folder
        self.progress = progress

    def model_loaded(self, described: dict[str, Any]) -> None:
        current = self.folder.manifest() or {}
        models = union_models(current.get("models", []), [described])
        if models != current.get("models"):
            self.folder.write_manifest({**current, "models": models})

    def running(self, label: str) -> None:
        self.progress.current = label
        self.progress.update(self.progress)

    def record(self, record: dict[str, Any], traces: list[dict[str, Any]] | None) -> None:
        self.folder.add_record(record)
        if traces is not None:
            self.folder.add_trace(record["cell_id"], record["sample_id"], traces)
        self.progress.samples_done += 1
        self.progress.update(self.progress)

    def cell(self, status: dict[str, Any], failure: str | None) -> None:
        self.folder.add_cell(status)
        self.progress.cells_done += 1
        if failure:
            self.progress.log_failure(Cell(status["cell"]), failure)
        self.progress.update(self.progress)


class CollectedOutcomes:
    """Outcomes kept in order, to be replayed into another sink: what a Ray worker returns for a group."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[Any, ...]]] = []

    def model_loaded(self, described: dict[str, Any]) -> None:
        self.events.append(("model_loaded", (described,)))

    def running(self, label: str) -> None:
        """Not kept: once the group is back it has finished, and the driver shows its own progress."""

    def record(self, record: dict[str, Any], traces: list[dict[str, Any]] | None) -> None:
        self.events.append(("record", (record, traces)))

    def cell(self, status: dict[str, Any], failure: str | None) -> None:
        self.events.append(("cell", (status, failure)))

    def replay(self, outcomes: Outcomes) -> None:
        for method, arguments in self.events:
            getattr(outcomes, method)(*arguments)
