"""`--quiet` means quiet: ovkit's own tqdm bars take `disable=cfg.quiet`, but the libraries ovkit calls draw their
own (transformers' "Loading weights" and "Writing model shards", huggingface_hub's downloads, datasets' loading and
map bars), each behind its own switch. This turns those switches off for one command and back on after it: the
CLI for a --quiet command, and `honours_quiet` for the library functions called from Python with `quiet=True`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ovkit.options import StageConfig

F = TypeVar("F", bound=Callable[..., Any])


def silence_library_bars() -> Callable[[], None]:
    """Turn off the progress bars of transformers, huggingface_hub and datasets; returns the function that restores
    them as they were. (Importing transformers' and datasets' switches costs about 2 s, paid only under --quiet.)"""
    import datasets.utils as datasets_bars
    import huggingface_hub.utils as hub_bars
    import transformers.utils.logging as transformers_bars

    was = (
        hub_bars.are_progress_bars_disabled(),
        transformers_bars.is_progress_bar_enabled(),
        datasets_bars.are_progress_bars_disabled(),
    )
    hub_bars.disable_progress_bars()
    transformers_bars.disable_progress_bar()  # after the hub's: transformers turns the hub's off too
    datasets_bars.disable_progress_bars()

    def restore() -> None:
        hub_off, transformers_on, datasets_off = was
        if transformers_on:
            transformers_bars.enable_progress_bar()  # turns the hub's back on as well; set it below
        if not hub_off:
            hub_bars.enable_progress_bars()
        else:
            hub_bars.disable_progress_bars()
        if not datasets_off:
            datasets_bars.enable_progress_bars()

    return restore


def honours_quiet(fn: F) -> F:
    """`fn(cfg, ...)` (train, train_rl, run_eval) with the libraries' bars off while it runs when `cfg.quiet`: from
    Python, `quiet=True` is as quiet as `--quiet` (transformers' "Loading weights" bar came through before)."""

    @functools.wraps(fn)
    def run(cfg: StageConfig, *args: Any, **kwargs: Any) -> Any:
        if not getattr(cfg, "quiet", False):
            return fn(cfg, *args, **kwargs)
        restore = silence_library_bars()
        try:
            return fn(cfg, *args, **kwargs)
        finally:
            restore()

    return run  # type: ignore[return-value]
