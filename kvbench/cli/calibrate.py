"""`kvbench calibrate`: a calibrated policy's artifact, computed from the model itself
(kvbench/calibration/calibrate.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import typer
from rich.markup import escape

from kvbench.calibration.methods import METHODS, SIZES, check_writable, dtype_name, require_method
from kvbench.cli.app import DTYPE, app, progress_bar, stderr, stdout, user_errors

KVZAP_SMALL, KVZAP_PAPER = SIZES["kvzap-mlp"]


def sizes(field: str) -> str:
    """Each method's default `field` and its paper's, for --help (kvzap-linear and kvzap-mlp share theirs)."""
    methods = [method for method in SIZES if method != "kvzap-linear"]
    return (", ".join(f"{method.removesuffix('-mlp')} {getattr(SIZES[method][0], field)}" for method in methods)
            + "; --paper: " + ", ".join(str(getattr(SIZES[method][1], field)) for method in methods))


@app.command()
@user_errors
def calibrate(
    model: str = typer.Option(..., "--model", "-m", help="Hub id, local folder, .gguf file, an embedded model "
                              "(smollm2-135m, gemma3-270m) or random:<shape>."),
    method: str = typer.Option(..., "--method", help=f"What to compute: {', '.join(METHODS)} (Q-Filters; KVzap's "
                               "surrogate of KVzip+, ridge or MLP; Expected Attention's query statistics)."),
    corpus: str = typer.Option("embedded", "--corpus", help="Text to calibrate on: embedded (the haystack prose "
                               "kvbench ships), a .txt file, a folder of .txt files, or hf:<dataset>."),
    output: Path | None = typer.Option(None, "--output", "-o", file_okay=False, help="Folder to write (kvpress's "
                                       "format); default: the model's folder in $KVBENCH_CACHE/<method>/, where the "
                                       "policy looks."),
    documents: int | None = typer.Option(None, "--documents", min=1, help=f"Corpus windows to run (default "
                                         f"{sizes('documents')})."),
    tokens: int | None = typer.Option(None, "--tokens", min=1, help=f"Tokens per window ({sizes('tokens')})."),
    samples: int | None = typer.Option(None, "--samples", min=1, help=f"qfilter: query vectors per head the SVD "
                                       f"sees ({SIZES['qfilter'][0].samples}); kvzap: positions per document it "
                                       f"trains on ({KVZAP_SMALL.samples}; --paper {KVZAP_PAPER.samples})."),
    held_out: int | None = typer.Option(None, "--held-out", min=0, help=f"kvzap: documents kept out of training, "
                                        f"scored (R^2, kept-set agreement) (default {KVZAP_SMALL.held_out}; --paper "
                                        f"{KVZAP_PAPER.held_out})."),
    paper: bool = typer.Option(False, "--paper", help="The papers' size (for a GPU; the options above still "
                               "override)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the windows and the samples (and random weights)."),
    dtype: str = DTYPE,
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
) -> None:
    """Compute a calibrated policy's artifact from MODEL itself.

    Saved in kvpress's format, so kvpress's own press loads the same folder: qfilter (QFilters, for the qfilter
    policy), kvzap-linear and kvzap-mlp (KVzapModel, for kvzap; with its R^2 on held-out text), expected-attention
    (ExpectedAttentionStats, for expected_attention_stats). Each window starts as the policy's prompts do (the
    tokenizer's start token; for kvzap the chat template's user turn, where there is one). Computed once per model,
    settings and calibration format: a second run reads the result back, one made by an older kvbench is recomputed."""
    from kvbench.calibration.calibrate import calibrate as run_calibration
    from kvbench.engine.models import load_model

    require_method(method)  # before the model loads
    if output is not None:
        check_writable(output)
    size = SIZES[method][1 if paper else 0]
    given = {"documents": documents, "tokens": tokens, "samples": samples, "held_out": held_out}
    settings = replace(size, seed=seed, **{key: value for key, value in given.items() if value is not None})
    lm = load_model(model, dtype=dtype, device=device, seed=seed)
    with progress_bar(disable=False) as progress:
        bar = progress.add_task(f"{method}: documents", total=settings.documents)
        done = run_calibration(lm, method, corpus, settings, output,
                               advance=lambda finished, total: progress.update(bar, completed=finished),
                               notice=lambda line: stderr.print(escape(line), highlight=False, soft_wrap=True))
    how = f"in {done.seconds:.1f} s" if done.computed else "read back from the per-model cache"
    scored = "" if math.isnan(done.quality.get("held_out_r2", math.nan)) else \
        (f"; on {settings.held_out} held-out documents R^2 {done.quality['held_out_r2']:.3f}, kept sets agree "
         f"{done.quality['kept_agreement']:.3f} (Jaccard, half of each)")
    stdout.print(f"kvbench calibrate: {method} for {escape(model)} ({dtype_name(lm)}) from {done.documents} "
                 f"documents of {done.tokens} tokens of {escape(corpus)}, {how}{scored}: {escape(str(done.folder))}",
                 highlight=False, soft_wrap=True)
