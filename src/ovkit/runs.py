"""Outputs are complete or absent, and say where they came from.

A stage writes into `OUT.tmp-<pid>` beside its target and renames it to `OUT` at the end, with `config.yaml` (the
resolved options), `ovkit.json` (provenance: command, version, config, input fingerprints, parent checkpoint, seed,
times, headline metrics) and, for a data or model output, a `README.md` card generated from it (ovkit.cards). A part
of a sharded output (`OUT/part-I-of-N`) also writes `OUT/README.md`, covering every part. A complete `OUT` (one with
`ovkit.json`) is left alone unless `overwrite`; re-run with other options it is refused (exit 2, naming them:
`finished`). The file utilities the stage uses (provenance, fingerprints, atomic JSON) are the leaf module
ovkit.files, which the lower layers import without this orchestrator.

A run killed without a chance to clean up (kill -9, a lost node) leaves its `OUT.tmp-<pid>` (or, mid-swap, the
replaced `OUT.old-<pid>`). The next run of the same `OUT` removes those whose pid is no live process on this machine;
a live one belongs to a concurrent run and is left alone (the --shard parts of one output have different names).
A full disk or an unwritable place (ovkit.faults.write_failure) ends in one line naming the path and the free space,
exit 2, with the temp dir removed. A failure at the end (config.yaml, ovkit.json, the rename) removes it too, or, for a
learner, moves it back to `OUT.partial` (`restore_to`) so that --resume still finds its checkpoints.
A second run of the same `OUT` (or `OUT/part-I-of-N`) does not get that far: every run holds `OUT.lock` for its life
(ovkit.faults) and a second one exits 2 naming the first one's pid and host.

Only what ovkit wrote is ever removed, moved or replaced (`claim`). An existing `OUT` that is neither a complete ovkit
output (an `ovkit.json` of ovkit's shape) nor an empty directory is refused, exit 2 naming it, with or without
`--overwrite`: it may be the user's own directory or file. Every temp dir starts with a mark (ovkit.files.MARK), so the
`OUT.tmp-<pid>` / `OUT.old-<pid>` a killed run left are told from a user's path that happens to share the name; the
lock file (ovkit.faults), a learner's `OUT.partial` and caption's work directory follow the same rule.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ovkit import __version__
from ovkit.cards import PART_DIR, write_card, write_parts_card
from ovkit.config import dump_yaml, option_default, to_plain, to_plain_values
from ovkit.data.sources import describe
from ovkit.errors import OvkitError
from ovkit.faults import Interrupted, hold, write_failure
from ovkit.files import MARK, PROVENANCE, fingerprint, is_complete, mark, read_provenance, write_json, written_by_ovkit
from ovkit.hub import is_remote, parse_spec
from ovkit.options import StageConfig, specs


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclasses.dataclass(frozen=True)
class LearnerRun:
    """What a learner's run is beyond its option groups (ovkit.runtime.Runtime): the entry point (train, train_rl)
    builds it from its stage config. `config` is written whole (config.yaml, ovkit.json) and its flat options are
    what a resume compares; everything the runtime decides by is a field here or in a group."""

    command: str
    config: StageConfig
    out: Path
    model: Path  # the parent checkpoint: ovkit.json's `parent`
    seed: int
    overwrite: bool
    quiet: bool
    inputs: dict[Path, str]  # {input path: the option it came from (DATA, --plan, --model)}: fingerprinted for --resume
    trajectory: tuple[str, ...]  # the options a resumed run must keep
    lr: float  # named when the run diverges
    smaller: tuple[str, ...]  # the stage's options that shrink a micro-batch, named when memory runs out

    @classmethod
    def of(
        cls,
        cfg: StageConfig,
        command: str,
        trajectory: Iterable[str],
        *,
        smaller: Iterable[str],
        plan: Path | None = None,
    ) -> LearnerRun:
        """The run of a learner's stage config (DATA, --model, --out, --seed, --overwrite, --quiet, --lr: every
        learner declares them); `plan` is a pack plan it reads besides DATA."""
        named = [*((p, "DATA") for p in cfg.data), (plan, "--plan"), (cfg.model, "--model")]
        inputs = {Path(p): role for p, role in named if p is not None}  # a Hub id is noted, not fingerprinted
        return cls(
            command=command,
            config=cfg,
            out=cfg.out,
            model=cfg.model,
            seed=cfg.seed,
            overwrite=cfg.overwrite,
            quiet=cfg.quiet,
            inputs=inputs,
            trajectory=tuple(trajectory),
            lr=cfg.lr,
            smaller=tuple(smaller),
        )

    @property
    def partial(self) -> Path:
        """Where the run lives until it completes (renamed to OUT at the end)."""
        return self.out.parent / f"{self.out.name}.partial"


class Stage:
    """One run of a command that produces the directory `out`.

    >>> stage = Stage("synth", cfg, out, inputs=[], overwrite=False)
    >>> if stage.skipped: ...             # a complete output is already there
    >>> with stage:                        # writes into stage.path, renamed to `out` on success
    ...     stage.metrics["rows"] = 10
    """

    def __init__(
        self,
        command: str,
        cfg: StageConfig,
        out: Path,
        *,
        inputs: Iterable[Path] = (),
        overwrite: bool = False,
        seed: int | None = None,
        parent: Path | None = None,
    ):
        self.command = command
        self.cfg = cfg
        self.out = Path(out)
        self.inputs = [Path(p) for p in inputs]
        self.overwrite = overwrite
        self.seed = seed
        self.parent = parent
        self.metrics: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}  # more top-level provenance keys (e.g. `runtime`: device, precision, attention)
        # Where the temp dir goes back on failure instead of being removed (a learner's OUT.partial: Runtime.finish).
        self.restore_to: Path | None = None
        claim(self.out)  # before anything is written beside it: a path ovkit did not write is refused, exit 2
        self.lock = hold(self.out, command)  # one writer per output (ovkit.faults): exit 2 naming the holder
        self.skipped = finished(self.out, cfg, overwrite)
        if self.skipped:
            self.lock.release()
        self.path = self.out.parent / f"{self.out.name}.tmp-{os.getpid()}"
        self.started = _now()
        for stale in remove_stale(self.out):
            print(f"removed {stale}: left by a run that was killed", file=sys.stderr)

    def __enter__(self) -> Stage:
        if self.skipped:
            raise RuntimeError("a skipped stage must not be entered")
        if self.path.exists() or self.path.is_symlink():
            claim(self.path, what="its temporary directory")
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        mark(self.path, self.command)  # first: a killed run's temp dir is told from a path of the user's
        self._input_prints = [f for f in map(input_print, self.inputs) if f is not None]
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, Interrupted) and exc.message.startswith("stopped"):  # a data stage, stopped by a signal
            exc.message = (
                f"{self.command}: {exc.message}; its partial output was removed, run the same command again to redo it"
            )
        try:
            if exc_type is not None:
                self._discard()
            else:
                try:
                    self._commit()
                except BaseException as e:
                    self._discard()
                    raise (self._write_failure(e) or e) from None
        finally:
            self.lock.release()
        failure = self._write_failure(exc) if exc is not None else None
        if failure is not None:  # disk full or not writable: one line naming the path, exit 2
            raise failure from exc

    def _write_failure(self, e: BaseException) -> OvkitError | None:
        then = ("then run the same command again" if self.restore_to is None else
                f"then run the same command with --resume: it continues from {self.restore_to}")  # fmt: skip
        return write_failure(e, self.path, then=then, within=self.out.parent)

    def _discard(self) -> None:
        """Leave nothing a later run would trip on: the temp dir goes, or goes back where it came from (restore_to:
        a learner's OUT.partial, which --resume continues), without the end's config.yaml and ovkit.json."""
        if self.restore_to is not None and self.path.is_dir() and not self.restore_to.exists():
            for name in ("config.yaml", PROVENANCE):
                (self.path / name).unlink(missing_ok=True)
            os.replace(self.path, self.restore_to)
        else:
            shutil.rmtree(self.path, ignore_errors=True)

    def _commit(self) -> None:
        (self.path / "config.yaml").write_text(dump_yaml(self.cfg))
        prov = self.provenance()
        write_json(self.path / PROVENANCE, prov)
        _card(write_card, self.path, prov, self.out)
        if self.out.exists() or self.out.is_symlink():
            claim(self.out)  # again: a learner ran for hours, and the user may have made OUT meanwhile
            old = self.out.parent / f"{self.out.name}.old-{os.getpid()}"
            self.out.rename(old)
            try:
                self.path.rename(self.out)
            except BaseException:
                old.rename(self.out)  # the previous output stays whole
                raise
            if old.is_symlink():  # OUT was a link to an output of ovkit's: the link goes, what it points to stays
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
        else:
            self.path.rename(self.out)
        (self.out / MARK).unlink(missing_ok=True)  # complete now: its ovkit.json says whose it is
        if PART_DIR.fullmatch(self.out.name):
            _card(write_parts_card, self.out.parent, self.out, prov)

    def adopt(self, run_dir: Path) -> None:
        """Make `run_dir` (a learner's OUT.partial) this stage's temp dir, marked as its own."""
        (self.path / MARK).unlink(missing_ok=True)
        self.path.rmdir()
        os.replace(run_dir, self.path)
        mark(self.path, self.command)

    def provenance(self) -> dict[str, Any]:
        parent = read_provenance(self.parent) if self.parent else None
        return {
            "command": self.command,
            "argv": sys.argv,
            "ovkit_version": __version__,
            "config": to_plain(self.cfg),
            "inputs": [describe(i["path"]) if "hub" in i else i for i in self._input_prints],
            "parent": {"path": str(self.parent), "command": parent.get("command") if parent else None}
            if self.parent
            else None,
            "seed": self.seed,
            "started": self.started,
            "finished": _now(),
            "metrics": self.metrics,
            **self.extra,
        }


def finished(out: Path, cfg: StageConfig, overwrite: bool) -> bool:
    """Whether `out` is a complete output this run skips: complete, no `overwrite`, and no option of `cfg` set to
    another value than the one `out` was made with. Such a run exits 2 naming each option (old -> new) and
    --overwrite: a skip would keep the old result under the new options' name. Compared: the options a resumed
    learner must keep (every one but the run-control ones: --out, --quiet, --overwrite, how it checkpoints, logs and
    computes), so a skip and a --resume agree on what "the same run" is; and of those only the ones set to other
    than their default, so the short re-run `ovkit CMD ... --out OUT` (what `make` does after an edit elsewhere) still
    just finds OUT complete."""
    if overwrite or not is_complete(out):
        return False
    changed = changed_options(read_provenance(out).get("config") or {}, cfg)
    if changed:
        raise OvkitError(
            f"--out {out} is complete but was made with other options ({', '.join(changed)}); use --overwrite to "
            f"replace it, or give its options to keep it"
        )
    return True


def changed_options(saved: dict[str, Any], cfg: StageConfig) -> list[str]:
    """`--flag old -> new` for every option of `cfg` set to other than its default (run-control ones aside) whose
    value differs from `saved` (the config an output recorded; an option it does not name ran as its default)."""
    if not dataclasses.is_dataclass(cfg):
        return []
    now = to_plain(cfg)
    init = {f.name for f in dataclasses.fields(cfg) if f.init}
    out = []
    for name, meta in specs(type(cfg)).items():
        key = name.replace("_", "-")
        if meta.run_control or name not in init or key not in now:
            continue
        default = _left_at_default(cfg, name)
        if now[key] == default:
            continue
        # an option the output's config does not name did not exist when it was made: it ran as its default
        old = saved[key] if key in saved else to_plain_values({name: option_default(type(cfg), name)})[key]
        if old != now[key]:
            out.append(f"{meta.cli_name(name)} {old!r} -> {now[key]!r}")
    return out


_UNSET = object()


def _left_at_default(cfg: StageConfig, name: str) -> Any:
    """The value option `name` takes when left at its declared default, the others as they are: a stage's
    `__post_init__` fills some in (align's --lr is 1e-4, --vision-lr is --lr), so the declared default alone would
    call a short re-run's value changed. `_UNSET` when the default is refused beside the other options."""
    try:
        value = getattr(dataclasses.replace(cfg, **{name: option_default(type(cfg), name)}), name)
    except OvkitError:
        return _UNSET
    return to_plain_values({name: value})[name.replace("_", "-")]


def claim(out: Path, *, what: str = "--out", partial: Path | None = None) -> None:
    """Exit 2 unless ovkit may replace `out`: it does not exist, or ovkit wrote it (ovkit.files.written_by_ovkit:
    a complete output, a marked temp or run directory, an empty directory). `partial`: a learner's run directory,
    held to the same rule. For a part of a sharded output (`OUT/part-I-of-N`) the card written into OUT must not
    replace a README.md of the user's: OUT holds only parts (and their side files) and, with them, their card."""
    out = Path(out)
    for path, named in ((out, what), (partial, "its run directory")):
        if path is None or not (path.exists() or path.is_symlink()) or written_by_ovkit(path):
            continue
        kind = "a file" if not path.is_dir() else "a directory without ovkit's ovkit.json"
        raise OvkitError(
            f"{named} {path} exists and is {kind}: ovkit did not write it, so it never removes, moves or replaces it "
            f"(--overwrite replaces only outputs ovkit wrote); choose another --out, or move {path} away yourself"
        )
    if PART_DIR.fullmatch(out.name) and out.parent.is_dir():
        names = [p.name for p in out.parent.iterdir()]
        parts = [n for n in names if PART_DIR.match(n)]
        others = sorted(n for n in names if not PART_DIR.match(n.removeprefix(".")) and n != "README.md")
        if others or ("README.md" in names and not parts):
            listed = ", ".join(others[:3] or ["README.md"]) + (", ..." if len(others) > 3 else "")
            raise OvkitError(
                f"--out {out.parent} holds files that are not parts of an ovkit output ({listed}); a --shard run "
                f"writes its part and the output's README.md there: choose another --out, or move them away yourself"
            )


def remove_stale(out: Path) -> list[Path]:
    """Remove the `OUT.tmp-<pid>` / `OUT.old-<pid>` beside `out` whose process is gone and that ovkit wrote (a
    marked temp dir, a replaced output); a path of that name that ovkit did not write stays. Returns what was
    removed."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    pattern = re.compile(re.escape(out.name) + r"\.(?:tmp|old)-(\d+)")
    removed = []
    for p in sorted(out.parent.iterdir()):
        m = pattern.fullmatch(p.name)
        if m is None or int(m[1]) == os.getpid() or pid_alive(int(m[1])):
            continue
        if p.is_symlink() or not written_by_ovkit(p):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a process on this machine (someone else's counts: it may be another user's run)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # not a pid at all
        return False
    return True


def input_print(path: Path) -> dict[str, Any] | None:
    """An input's fingerprint: of the path, of the directory a `DIR:CONFIG@SPLIT` selects from, or, for a Hub
    dataset, a note filled in at the end (ovkit.data.sources.describe: the converted copy's fingerprint)."""
    if path.exists():
        return fingerprint(path)
    base = Path(parse_spec(path).base).expanduser()
    if base.exists():
        return {**fingerprint(base), "path": str(path)}
    return {"path": str(path), "hub": None} if is_remote(path) else None


def _card(write, *args) -> None:
    """A card is documentation: failing to write one must not lose the finished output it describes."""
    try:
        write(*args)
    except Exception as e:  # noqa: BLE001
        print(f"warning: {args[0]}: could not write its README.md card ({type(e).__name__}: {e})", file=sys.stderr)
