"""`kvbench calibrate`: a calibrated policy's artifact, computed from the model itself (kvbench/calibrate.py)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from kvbench.calibrate import METHODS, PAPER, QFilterSettings, dtype_name, require_method
from kvbench.cli.app import DTYPE, app, progress_bar, stdout, user_errors

SMALL = QFilterSettings()


@app.command()
@user_errors
def calibrate(
    model: str = typer.Option(..., "--model", "-m", help="Hub id, local folder, .gguf file, an embedded model "
                              "(smollm2-135m, gemma3-270m) or random:<shape>."),
    method: str = typer.Option(..., "--method", help=f"What to compute: {', '.join(METHODS)} (Q-Filters: one "
                               "direction per layer and KV head, from an SVD of the model's queries)."),
    corpus: str = typer.Option("embedded", "--corpus", help="Text to calibrate on: embedded (the haystack prose "
                               "kvbench ships), a .txt file, a folder of .txt files, or hf:<dataset>."),
    output: Path | None = typer.Option(None, "--output", "-o", file_okay=False, help="Folder to write (kvpress's "
                                       "format); default: the model's folder in $KVBENCH_CACHE/<method>/, where the "
                                       "policy looks."),
    documents: int | None = typer.Option(None, "--documents", min=1, help=f"Corpus windows to run (default "
                                         f"{SMALL.documents}; {PAPER.documents} with --paper)."),
    tokens: int | None = typer.Option(None, "--tokens", min=1, help=f"Tokens per window (default {SMALL.tokens}; "
                                      f"{PAPER.tokens} with --paper)."),
    samples: int = typer.Option(SMALL.samples, "--samples", min=1, help="Query vectors per head the SVD sees."),
    paper: bool = typer.Option(False, "--paper", help=f"The paper's size: {PAPER.documents} documents of "
                               f"{PAPER.tokens} tokens (for a GPU; --documents and --tokens still override)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the windows and the sampled queries (and random weights)."),
    dtype: str = DTYPE,
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
) -> None:
    """Compute a calibrated policy's artifact from MODEL itself.

    qfilter: the Q-Filters the qfilter policy reads, saved as kvpress's QFilters (QFilterPress loads the same
    folder). Computed once per model and settings: a second run reads the result back."""
    from kvbench.calibrate import calibrate as run_calibration
    from kvbench.models import load_model

    require_method(method)  # before the model loads
    size = PAPER if paper else SMALL
    settings = QFilterSettings(documents=documents or size.documents, tokens=tokens or size.tokens,
                               samples=samples, seed=seed)
    lm = load_model(model, dtype=dtype, device=device, seed=seed)
    with progress_bar(disable=False) as progress:
        bar = progress.add_task(f"{method}: documents", total=settings.documents)
        done = run_calibration(lm, method, corpus, settings, output,
                               advance=lambda finished, total: progress.update(bar, completed=finished))
    how = f"in {done.seconds:.1f} s" if done.computed else "read back from the per-model cache"
    stdout.print(f"kvbench calibrate: {method} for {escape(model)} ({dtype_name(lm)}) from {done.documents} "
                 f"documents of {done.tokens} tokens of {escape(corpus)}, {how}: {escape(str(done.folder))}",
                 highlight=False, soft_wrap=True)
