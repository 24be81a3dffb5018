"""Where a sample table comes from, and how it reaches the stages as parquet files.

Every command that reads a sample table accepts, besides a parquet file or a directory of parquet shards:
- a directory with a dataset card (README.md with `configs:`, as every ovkit data output has, or a dataset repository
  cloned from the Hub): its default config, or `DIR:CONFIG` / `DIR@SPLIT` / `DIR:CONFIG@SPLIT`;
- a directory written by `datasets` `save_to_disk` (`DIR@SPLIT` picks a split of a DatasetDict);
- a Hugging Face Hub dataset id, `ORG/NAME[:CONFIG][@SPLIT]` (`@test[:100]`: `datasets` split slicing), loaded with
  `datasets.load_dataset` into the HF cache. With HF_HUB_OFFLINE=1 a cached dataset loads and an uncached one fails at
  once; online, an unreachable Hub fails after one 3-second probe instead of `datasets`' retries.

A name is local when it exists, starts with `.`, `/` or `~`, has no `/` or more than one, or ends with a data file
suffix; only the remaining `ORG/NAME` shapes are looked up on the Hub, so a mistyped local path is never sent there.

Rows must be in ovkit's layout (DESIGN.md, "The sample table") or TRL's conversational VLM layout (`images` +
`messages` whose content is text or [{type: text|image}] parts, or `prompt` + `completion`; ShareGPT's `messages` +
`images` is the same shape). Parquet files in ovkit's
layout are read where they are; anything else (a Hub dataset, a saved dataset, TRL parquet) is converted once with
`ovkit convert`'s mapping into `$OVKIT_CACHE/datasets/` (default ~/.cache/ovkit), keyed by the source's fingerprint,
and read from there, so every stage (and the pack plan's row numbers) sees ordinary part files. Other layouts (LLaVA,
ShareGPT, verl, ...) are refused with the missing column named: `ovkit convert` handles them with options they need.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError
from ovkit.files import fingerprint, is_complete, write_json

CARD = "README.md"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SPEC = re.compile(r"(?P<base>[^:@]+)(?::(?P<config>[^:@]+))?(?:@(?P<split>[^@]+))?")
FILE_SUFFIXES = (".parquet", ".json", ".jsonl", ".csv", ".tsv", ".arrow", ".txt", ".zip", ".tar")
# The layouts a stage reads directly; other formats go through `ovkit convert`. `messages` + `images` with text content
# is both ShareGPT's and TRL's layout (the detector calls it sharegpt), and maps the same way.
READABLE = ("ovkit", "trl", "sharegpt")
PROBE_TIMEOUT_S = 3.0

_loaded: dict[str, Any] = {}  # spec -> datasets.Dataset: loading a cached dataset still takes a second
_described: dict[str, dict[str, Any]] = {}  # spec -> provenance of a converted source, for ovkit.json


@dataclass(frozen=True)
class Spec:
    """`BASE[:CONFIG][@SPLIT]`; BASE is a local path or a Hub id."""

    text: str
    base: str
    config: str | None = None
    split: str | None = None

    @property
    def selects(self) -> bool:
        return self.config is not None or self.split is not None


def parse_spec(text: str | Path) -> Spec:
    text = str(text)
    if Path(text).expanduser().exists():  # an existing path is itself, colons and all
        return Spec(text, text)
    m = SPEC.fullmatch(text)
    if m is None:
        return Spec(text, text)
    return Spec(text, m["base"], m["config"], m["split"])


def is_hub_id(base: str) -> bool:
    """`ORG/NAME` that is not a local path (see the module docstring for the rule)."""
    return (
        not base.startswith((".", "/", "~"))
        and base.count("/") == 1
        and HUB_ID.fullmatch(base) is not None
        and not base.lower().endswith(FILE_SUFFIXES)
        and not Path(base).exists()
    )


def check_exists(texts: list[str | Path], name: str = "DATA") -> None:
    """Each input exists here (a `:CONFIG` / `@SPLIT` suffix aside) or names a Hub dataset: a mistyped path fails in
    the config check, naming the argument, before torch and the model load (#29)."""
    for text in texts:
        spec = parse_spec(text)
        if not Path(spec.base).expanduser().exists() and not is_hub_id(spec.base):
            raise OvkitError(f"{name} {text}: no such file or directory")


def is_remote(text: str | Path) -> bool:
    """A spec that names a Hub dataset (so it has no local fingerprint)."""
    spec = parse_spec(text)
    return not Path(spec.base).expanduser().exists() and is_hub_id(spec.base)


@dataclass
class Located:
    """A source: local files (read where they are, whatever they hold), or a `datasets.Dataset`."""

    spec: Spec
    files: list[Path] | None = None
    dataset: Any = None


def locate(text: str | Path) -> Located:
    spec = parse_spec(text)
    local = Path(spec.base).expanduser()
    if local.exists():
        if local.is_file():
            if spec.selects:
                raise OvkitError(
                    f"{spec.text}: ':CONFIG' / '@SPLIT' choose from a directory with a dataset card, a saved dataset or a Hub dataset, not from a file"
                )
            return Located(spec, files=[local])
        if is_saved_dataset(local):
            return Located(spec, dataset=_load(spec, lambda: _load_saved(local, spec)))
        from ovkit.data.io import check_parts

        check_parts(local)  # a sharded output is one dataset only once every part is complete
        configs = card_configs(local)
        if configs is not None:
            files = _empty_subset(local, configs, spec) or card_files(local, configs, spec.config, spec.split)
            if files is not None:
                return Located(spec, files=files)
            return Located(spec, dataset=_load(spec, lambda: _load_with_datasets(str(local), spec, hub=False)))
        if spec.selects:
            raise OvkitError(
                f"{spec.base}: no dataset card (README.md with `configs:`) to choose {spec.text[len(spec.base) :]!r} from"
            )
        from ovkit.data.io import local_parquet_files

        return Located(spec, files=local_parquet_files(local))
    if is_hub_id(spec.base):
        return Located(spec, dataset=_load(spec, lambda: _load_with_datasets(spec.base, spec, hub=True)))
    raise OvkitError(f"{spec.base}: no such file or directory")


def sample_files(text: str | Path) -> list[Path]:
    """The parquet files of the sample table named by `text`, in row order (converted into the cache if needed)."""
    loc = locate(text)
    if loc.dataset is None and len(loc.files) == 1 and not is_parquet(loc.files[0]):
        return materialize(loc)  # a JSON file: TRL's / ShareGPT's layout is read, any other is named with its --from
    if loc.dataset is None:
        fmt = _parquet_layout(loc.files)
        if fmt is None or fmt == "ovkit":
            return (
                loc.files
            )  # parquet in ovkit's layout, or not parquet / not a known layout: the reader says what is wrong
    return materialize(loc)


def describe(text: str | Path) -> dict[str, Any]:
    """Provenance of an input that is not a local path: the spec, the `datasets` fingerprint of what was loaded, and
    the converted copy's fingerprint where a stage read it through the cache."""
    if str(text) in _described:
        return _described[str(text)]
    loaded = _loaded.get(str(text))
    return {
        "path": str(text),
        "hub": parse_spec(text).base,
        **({"source_fingerprint": loaded._fingerprint} if loaded is not None else {}),
    }


# ------------------------------------------------------------------------------------------------ dataset cards


def card_configs(directory: Path) -> list[dict[str, Any]] | None:
    """The `configs:` of DIR/README.md's YAML front matter, or None without a card or without configs."""
    card = Path(directory) / CARD
    if not card.is_file():
        return None
    meta = front_matter(card.read_text(encoding="utf-8", errors="replace"))
    configs = meta.get("configs") if isinstance(meta, dict) else None
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        return None
    return configs


def front_matter(text: str) -> dict[str, Any]:
    """The YAML block between the leading `---` lines of a card ({} when there is none or it does not parse)."""
    import yaml

    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    try:
        meta = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def pick_config(configs: list[dict[str, Any]], name: str | None, where: str) -> dict[str, Any]:
    """The config called `name`, else the default one by `datasets`' rule (named default, `default: true`, or alone)."""
    names = [str(c.get("config_name", "default")) for c in configs]
    if name is not None:
        if name not in names:
            raise OvkitError(f"{where}: no config {name!r} in its dataset card (configs: {', '.join(names)})")
        return configs[names.index(name)]
    defaults = [c for c, n in zip(configs, names) if n == "default" or c.get("default")]
    if len(configs) == 1 or len(defaults) == 1:
        return configs[0] if len(configs) == 1 else defaults[0]
    raise OvkitError(
        f"{where}: its dataset card has configs {', '.join(names)} and no default; choose one with {where}:CONFIG"
    )


def split_patterns(config: dict[str, Any]) -> dict[str, list[str]] | None:
    """data_files as {split: [patterns]} (a plain string or list means the split `train`), None when absent."""
    data_files = config.get("data_files")
    if data_files is None:
        return None
    if isinstance(data_files, str):
        return {"train": [data_files]}
    if all(isinstance(d, str) for d in data_files):
        return {"train": list(data_files)}
    splits: dict[str, list[str]] = {}
    for d in data_files:
        path = d.get("path") if isinstance(d, dict) else None
        splits.setdefault(str(d.get("split", "train")), []).extend(
            [path] if isinstance(path, str) else list(path or [])
        )
    return splits


def _empty_subset(directory: Path, configs: list[dict[str, Any]], spec: Spec) -> list[Path] | None:
    """`DIR:NAME` / `DIR@NAME` where the card has no NAME but DIR/NAME is a subset of ovkit part files: a subset
    without rows, which an ovkit card leaves out because `datasets` cannot load an empty split."""
    name = spec.config if spec.split is None else spec.split if spec.config is None else None
    names = {str(c.get("config_name", "default")) for c in configs} | {
        s for c in configs for s in (split_patterns(c) or {})
    }
    if name is None or name in names or not (directory / name).is_dir():
        return None
    from ovkit.data.io import local_parquet_files

    return local_parquet_files(directory / name)


def card_files(
    directory: Path, configs: list[dict[str, Any]], config: str | None, split: str | None
) -> list[Path] | None:
    """The local parquet files of one config (and split) of a card, in order; None where `datasets` must read them
    (no data_files, split slicing such as `train[:10]`, or files that are not parquet)."""
    where = str(directory)
    cfg = pick_config(configs, config, where)
    splits = split_patterns(cfg)
    if splits is None:
        return None
    if split is not None and split not in splits:
        if "[" in split:
            return None
        raise OvkitError(
            f"{where}: no split {split!r} in config {cfg.get('config_name', 'default')!r} (splits: {', '.join(splits)})"
        )
    chosen = [split] if split is not None else list(splits)
    if len(chosen) > 1:
        name = cfg.get("config_name", "default")
        raise OvkitError(
            f"{where}: config {name!r} has splits {', '.join(chosen)}; choose one with {where}@SPLIT (or {where}:CONFIG)"
        )
    root = directory / cfg["data_dir"] if cfg.get("data_dir") else directory
    files = glob_data_files(root, splits[chosen[0]])
    if not files:
        raise OvkitError(
            f"{where}: no files match {', '.join(splits[chosen[0]])} (split {chosen[0]!r} of its dataset card)"
        )
    return files if all(f.suffix == ".parquet" for f in files) else None


def glob_data_files(root: Path, patterns: list[str]) -> list[Path]:
    """Files matching the patterns under root, each pattern's matches sorted, without hidden files or the temporary
    directories of a run in progress (`.tmp-<pid>`, `.old-<pid>`), and without rejects."""
    from ovkit.data.io import REJECTS

    out: list[Path] = []
    for pattern in patterns:
        for rel in sorted(glob.glob(pattern, root_dir=root, recursive=True)):
            parts = Path(rel).parts
            if any(p.startswith(".") or ".tmp-" in p or ".old-" in p for p in parts) or parts[-1] == REJECTS:
                continue
            f = root / rel
            if f.is_file() and f not in out:
                out.append(f)
    return out


# ------------------------------------------------------------------------------------------------ loading with datasets


def is_saved_dataset(directory: Path) -> bool:
    d = Path(directory)
    return (d / "dataset_dict.json").is_file() or ((d / "state.json").is_file() and (d / "dataset_info.json").is_file())


def _load(spec: Spec, load) -> Any:
    if spec.text not in _loaded:
        _loaded[spec.text] = load()
    return _loaded[spec.text]


def _one_split(ds: Any, spec: Spec) -> Any:
    """A DatasetDict with one split is that split; with several the user must choose (train and test never mix)."""
    import datasets

    if isinstance(ds, (datasets.DatasetDict, dict)):
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise OvkitError(f"{spec.text}: has splits {', '.join(ds)}; choose one with {spec.text}@SPLIT")
    return ds


def _load_saved(directory: Path, spec: Spec) -> Any:
    import datasets

    if spec.config is not None:
        raise OvkitError(f"{spec.text}: a saved dataset has no configs (use {spec.base}@SPLIT)")
    ds = datasets.load_from_disk(str(directory))
    if spec.split is not None:
        if not isinstance(ds, datasets.DatasetDict) or spec.split not in ds:
            have = ", ".join(ds) if isinstance(ds, datasets.DatasetDict) else "none: it is one Dataset"
            raise OvkitError(f"{spec.text}: no split {spec.split!r} (splits: {have})")
        return ds[spec.split]
    return _one_split(ds, spec)


def _load_with_datasets(path: str, spec: Spec, *, hub: bool) -> Any:
    """`datasets.load_dataset`, with its failures as one message and no retry loop when the Hub is unreachable."""
    import datasets

    offline = bool(datasets.config.HF_HUB_OFFLINE)
    if hub and not offline:
        _probe_hub(spec)
    try:
        ds = datasets.load_dataset(path, spec.config, split=spec.split)
    except (
        OSError,
        ValueError,
    ) as e:  # ConnectionError / DatasetNotFoundError are OSErrors; unknown config/split ValueErrors
        if not hub:
            raise OvkitError(f"{spec.text}: `datasets` cannot load it ({type(e).__name__}: {e})") from None
        if offline and not isinstance(e, ValueError):
            raise OvkitError(
                f"{spec.text}: no local file or directory of that name, and the Hub dataset {spec.base!r} is not in the "
                f"HF cache ({datasets.config.HF_DATASETS_CACHE}) while HF_HUB_OFFLINE=1; load it once online to cache it"
            ) from None
        raise OvkitError(
            f"{spec.text}: no local file or directory of that name, and the Hub cannot give it ({type(e).__name__}: {e})"
        ) from None
    return _one_split(ds, spec)


def _probe_hub(spec: Spec) -> None:
    probe_hub(spec.text, "a dataset cached earlier loads with HF_HUB_OFFLINE=1")


def probe_hub(subject: str, hint: str) -> None:
    """One HEAD request with a short timeout: `datasets` and transformers would retry an unreachable Hub for half a
    minute to minutes. `subject` names what was asked for (a dataset spec, `--model ID`); `hint` says what to do."""
    from huggingface_hub import constants, get_session

    endpoint = constants.ENDPOINT
    try:
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 -- any transport failure means the same thing here
        raise OvkitError(
            f"{subject}: no local file or directory of that name, and the Hugging Face Hub ({endpoint}) cannot be "
            f"reached ({type(e).__name__}: {e}); {hint}"
        ) from None


# ------------------------------------------------------------------------------------------------ conversion to parquet


def _parquet_layout(files: list[Path]) -> str | None:
    """The layout of local parquet files (from the first file's schema), None when not parquet or not recognised."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ovkit.data.convert import detect_format, schema_has_parts

    if not files or files[0].suffix != ".parquet":
        return None
    try:
        schema = pq.read_schema(files[0])
    except (pa.ArrowInvalid, OSError):
        return None
    try:
        fmt, _ = detect_format(schema.names, parts=schema_has_parts(schema))
    except OvkitError:
        return None
    if fmt not in READABLE:
        raise not_a_sample_table(str(files[0]), schema.names, fmt)
    return fmt


def is_parquet(path: Path) -> bool:
    """Whether a file starts with parquet's magic bytes (whatever its name)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"PAR1"
    except OSError:
        return path.suffix == ".parquet"  # unreadable: the parquet reader names the problem


def not_a_sample_table(where: str, names: list[str], fmt: str | None = None) -> OvkitError:
    from ovkit.data.convert import FORMATS

    missing = next((c for c in ("messages", "images") if c not in names), "messages")
    if fmt:
        how = f"it looks like --from {fmt}: convert it first with `ovkit convert {where} --from {fmt} --out DIR`"
    else:
        how = f"convert it first with `ovkit convert {where} --from {{{','.join(FORMATS)}}} --out DIR`"
    return OvkitError(
        f"{where}, column '{missing}': not a sample table (columns: {', '.join(names[:20])}); stages read ovkit's layout and "
        f"TRL's (images + messages); {how}"
    )


def not_convertible(where: str) -> OvkitError:
    """A file that is neither parquet nor JSON (a CSV, a TSV, an archive) given where a sample table is expected."""
    from ovkit.data.convert import FORMATS

    kind = Path(where).suffix.lstrip(".").upper() or "this"
    return OvkitError(
        f"file {where}: not a sample table: stages read parquet (a file, or a directory of shards), and `ovkit convert` turns "
        f"parquet, JSON and JSON lines in the layouts {', '.join(FORMATS)} into one; a {kind} file: write it as JSON lines or "
        f'parquet first (e.g. `datasets.load_dataset("csv", data_files=...)["train"].to_json("data.jsonl")`), then '
        f"`ovkit convert data.jsonl --from FORMAT --out DIR`"
    )


def cache_dir() -> Path:
    return Path(os.environ.get("OVKIT_CACHE") or Path.home() / ".cache" / "ovkit") / "datasets"


def materialize(loc: Located) -> list[Path]:
    """Convert a source in ovkit's or TRL's layout into the cache (once per content) and return its part files."""
    from ovkit import __version__
    from ovkit.data.convert import ConvertConfig, convert, detect_format, input_of
    from ovkit.data.io import REJECTS, local_parquet_files

    spec = loc.spec
    try:
        inp = input_of(loc)
    except OvkitError:
        if loc.dataset is None and loc.files and not is_parquet(loc.files[0]):
            raise not_convertible(spec.text) from None
        raise
    keys, _ = inp.keys()
    try:
        fmt, _ = detect_format(keys, parts=inp.parts())
    except OvkitError:
        raise not_a_sample_table(spec.text, keys) from None
    if fmt not in READABLE:
        raise not_a_sample_table(spec.text, keys, fmt)
    key = hashlib.sha256(f"{spec.text}\0{inp.fingerprint()}\0{fmt}\0{__version__}".encode()).hexdigest()[:16]
    slug = re.sub(r"[^\w.-]+", "_", spec.text.strip("/~."))[-80:]
    out = cache_dir() / f"{slug}-{key}"
    if not is_complete(out):
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            metrics = convert(ConvertConfig(input=spec.text, from_format=fmt, out=tmp, quiet=True), tmp, inp=inp)
        except OvkitError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            # the reading command may have no --on-error of its own: the way past bad rows is convert's
            reason = str(e).replace(f" (use --on-error skip to move bad records to {REJECTS})", "")
            raise OvkitError(
                f"{reason}; to read the rows that are good, convert it first: `ovkit convert {spec.text} --on-error skip --out DIR`"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_json(
            tmp / "ovkit.json",
            {
                "command": "read",
                "source": spec.text,
                "source_fingerprint": inp.fingerprint(),
                "ovkit_version": __version__,
                "metrics": metrics,
            },
        )
        try:
            tmp.rename(out)
        except OSError:  # another process converted the same source first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    _described[spec.text] = {
        "path": spec.text,
        "format": fmt,
        "source_fingerprint": inp.fingerprint(),
        "converted": fingerprint(out),
    }
    if is_hub_id(spec.base) and not Path(spec.base).exists():
        _described[spec.text]["hub"] = spec.base
    return local_parquet_files(out)
