"""What the ``quantkit`` commands print to: one stderr console, one-line errors, device checks."""
from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

console = Console(stderr=True)


def fail(message: str) -> NoReturn:
    """Print a one-line error (its text as written, not Rich markup) and exit with status 2."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def check_device(device: str | None) -> None:
    """End the command with a clear error if ``--device`` names no device torch knows, one quantkit
    does not run on (it runs on ``cpu`` and ``cuda[:N]``), or CUDA where torch sees no GPU."""
    if device is None:
        return
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as error:
        fail(f"--device {device}: {error}")
    if kind not in ("cpu", "cuda"):
        fail(f"--device {device}: quantkit runs on cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        fail(f"--device {device}: torch {torch.__version__} sees no CUDA GPU")


def wide(out: Console) -> Console:
    """``out``, or where no terminal gives the width (a log, a pipe) a 160-column console on the
    same stream: rich would fold table cells to 80 columns there."""
    return out if out.is_terminal else Console(file=out.file, width=160)
