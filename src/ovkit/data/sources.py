"""Where a sample table comes from, and how it reaches the stages as parquet files.

Every command that reads a sample table accepts, besides a parquet file or a directory of parquet shards:
- a directory with a dataset card (README.md with `configs:`, as every ovkit data output has, or a dataset repository
  cloned from the Hub): its default config, or `DIR:CONFIG` / `DIR@SPLIT` / `DIR:CONFIG@SPLIT`;
- a directory written by `datasets` `save_to_disk` (`DIR@SPLIT` picks a split of a DatasetDict);
- a Hugging Face Hub dataset id, `ORG/NAME[:CONFIG][@SPLIT]` (`@test[:100]`: `datasets` split slicing), loaded with
  `datasets.load_dataset` into the HF cache. With HF_HUB_OFFLINE=1 a cached dataset loads and an uncached one fails at
  once; online, an unreachable Hub fails after one 3-second probe instead of `datasets`' retries.

A name is local when it exists, starts with `.`, `/` or `~`, has no `/` or more than one, or ends with a data file
suffix; only the remaining `ORG/NAME` shapes are looked up on the Hub, so a mistyped local path is never sent there
(ovkit.hub holds that rule and the spec parser, for the config checks that must not import this package).

Rows must be in ovkit's layout (ovkit.data.schema) or TRL's conversational VLM layout (`images` +
`messages` whose content is text or [{type: text|image}] parts, or `prompt` + `completion`; ShareGPT's `messages` +
`images` is the same shape). Parquet files in ovkit's
layout are read where they are; anything else (a Hub dataset, a saved dataset, TRL parquet) is converted once with
`ovkit convert`'s mapping into `$OVKIT_CACHE/datasets/` (default ~/.cache/ovkit), keyed by the source's fingerprint,
and read from there (ovkit.data.io.sample_files), so every stage (and the pack plan's row numbers) sees ordinary part
files. Other layouts (LLaVA,
ShareGPT, verl, ...) are refused with the missing column named: `ovkit convert` handles them with options they need.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ovkit.data.formats import Input, input_of
from ovkit.data.parts import REJECTS, check_parts, local_parquet_files
from ovkit.errors import OvkitError
from ovkit.hub import Spec, is_hub_id, parse_spec, probe_hub

CARD = "README.md"

_loaded: dict[str, Any] = {}  # spec -> datasets.Dataset: loading a cached dataset still takes a second
_described: dict[str, dict[str, Any]] = {}  # spec -> provenance of a converted source, for ovkit.json


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
                    f"{spec.text}: ':CONFIG' / '@SPLIT' choose from a directory with a dataset card, a saved "
                    f"dataset or a Hub dataset, not from a file"
                )
            return Located(spec, files=[local])
        if is_saved_dataset(local):
            return Located(spec, dataset=_load(spec, lambda: _load_saved(local, spec)))
        check_parts(local)  # a sharded output is one dataset only once every part is complete
        configs = card_configs(local)
        if configs is not None:
            files = _empty_subset(local, configs, spec) or card_files(local, configs, spec.config, spec.split)
            if files is not None:
                return Located(spec, files=files)
            return Located(spec, dataset=_load(spec, lambda: _load_with_datasets(str(local), spec, hub=False)))
        if spec.selects:
            raise OvkitError(
                f"{spec.base}: no dataset card (README.md with `configs:`) to choose "
                f"{spec.text[len(spec.base) :]!r} from"
            )
        return Located(spec, files=local_parquet_files(local))
    if is_hub_id(spec.base):
        return Located(spec, dataset=_load(spec, lambda: _load_with_datasets(spec.base, spec, hub=True)))
    raise OvkitError(f"{spec.base}: no such file or directory")


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
    # heavy: yaml loads on first use, not at CLI start or in config checks
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
            f"{where}: config {name!r} has splits {', '.join(chosen)}; choose one with {where}@SPLIT (or "
            f"{where}:CONFIG)"
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
    # heavy: datasets loads on first use, not at CLI start or in config checks
    import datasets

    if isinstance(ds, (datasets.DatasetDict, dict)):
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise OvkitError(f"{spec.text}: has splits {', '.join(ds)}; choose one with {spec.text}@SPLIT")
    return ds


def _load_saved(directory: Path, spec: Spec) -> Any:
    # heavy: datasets loads on first use, not at CLI start or in config checks
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
    # heavy: datasets loads on first use, not at CLI start or in config checks
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
                f"{spec.text}: no local file or directory of that name, and the Hub dataset {spec.base!r} is not in "
                f"the "
                f"HF cache ({datasets.config.HF_DATASETS_CACHE}) while HF_HUB_OFFLINE=1; load it once online to "
                f"cache it"
            ) from None
        raise OvkitError(
            f"{spec.text}: no local file or directory of that name, and the Hub cannot give it ({type(e).__name__}: "
            f"{e})"
        ) from None
    return _one_split(ds, spec)


def _probe_hub(spec: Spec) -> None:
    probe_hub(spec.text, "a dataset cached earlier loads with HF_HUB_OFFLINE=1")


def open_input(path: Path | str) -> Input:
    """The input named by `path`, for the converter to read record by record: a local file or directory, or what
    `locate` finds (Hub id, card dir, saved dataset)."""
    return input_of(locate(path))


def note_converted(text: str, provenance: dict[str, Any]) -> None:
    """What `describe` reports for a source that a stage read through its converted copy (ovkit.data.io)."""
    _described[text] = provenance
