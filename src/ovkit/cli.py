"""The ovkit command table: every subcommand, one line each."""

from __future__ import annotations

import functools
import os
import sys
import traceback

import typer

from ovkit import __version__, faults, launch
from ovkit.errors import OvkitError

app = typer.Typer(
    name="ovkit",
    help="Run and study the LLaVA-OneVision-1.5 recipe end to end. Each command reads and writes plain files. "
    "Options take dashes or underscores (--output-dir, --output_dir).",
    no_args_is_help=True,
    # typer's --install-completion / --show-completion (SHELL with _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION)
    add_completion=True,
    pretty_exceptions_enable=False,
    # `--output_dir` is `--output-dir` (HF's argument parser takes both spellings), also for command names (rl_train)
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 110,
        "token_normalize_func": lambda t: t.replace("_", "-"),
    },
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ovkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks for expected errors too."),
) -> None:
    if debug:
        os.environ["OVKIT_DEBUG"] = "1"


_registered = False


def _register() -> None:
    """The command table. Command modules and their stage configs are torch-free (their libraries import lazily), so
    this stays cheap."""
    global _registered
    if _registered:
        return
    _registered = True
    from ovkit.commands import (  # one module per command (align, midtrain and sft: train); add yours here
        balance,
        caption,
        convert,
        eval,
        init_model,
        mismatch_report,
        pack,
        rl_curate,
        rl_train,
        science_report,
        synth,
        train,
    )
    from ovkit.commands._common import register

    # Every command's options are built from its stage config's fields; its --help shows the config's defaults,
    # required marks and an example (ovkit.commands._common.StageCommand).
    command = functools.partial(register, app)
    # The whole command surface, one line each (add yours in pipeline order):
    command("synth", synth.synth)
    command("balance", balance.balance)
    command("caption", caption.caption)
    command("convert", convert.convert)
    command("init-model", init_model.init_model)
    command("pack", pack.pack)
    command("align", train.align)
    command("midtrain", train.midtrain)
    command("sft", train.sft)
    command("eval", eval.evaluate)
    command("rl-curate", rl_curate.rl_curate)
    command("rl-train", rl_train.rl_train)
    command("mismatch-report", mismatch_report.mismatch_report)
    command("science-report", science_report.science_report)


def _command() -> str:
    return next((a for a in sys.argv[1:] if not a.startswith("-")), "ovkit")


def main() -> None:
    _register()
    try:
        with faults.signals():  # SIGINT/SIGTERM: a learner checkpoints at the step's end, a data stage stops now
            # prog_name: `python -m ovkit` would otherwise name the completion script's command "python -m ovkit"
            app(prog_name="ovkit")  # standalone: typer turns usage errors into exit 2 itself
    except faults.Interrupted as e:  # stopped on purpose: how to go on, no traceback, the shell's 128 + signal
        if os.environ.get("OVKIT_DEBUG"):
            traceback.print_exc()
        print(f"{e.message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except OvkitError as e:
        if os.environ.get("OVKIT_DEBUG"):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)  # 2; 3 for out of memory
    except Exception as e:  # noqa: BLE001 -- anything else is a bug: say so, exit 1
        if os.environ.get("OVKIT_DEBUG"):
            traceback.print_exc()
        if faults.is_out_of_memory(e):  # a data stage that runs a model (caption, eval, rl-curate): exit 3
            print(f"error: {faults.out_of_memory_message(_command(), e)}", file=sys.stderr)
            sys.exit(3)
        failure = faults.write_failure(e, "the output")  # disk full or read-only where no stage caught it: exit 2
        if failure is not None:
            print(f"error: {_command()}: {failure}", file=sys.stderr)
            sys.exit(failure.exit_code)
        print(f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        sys.exit(1)
    finally:
        launch.close()  # under torchrun / accelerate launch: the process group goes before the interpreter does
        faults.release_all()  # the run is over: its OUT.lock files go (a killed process's lock goes with it anyway)
