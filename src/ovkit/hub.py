"""What names a Hub dataset or model, and whether the Hub answers: facts that data/, models/, cards and the config
checks share, in a leaf module (no ovkit import beyond errors, no pyarrow, no torch), so a config check that a
`DATA` or `--model` exists runs before anything heavy imports: a typo costs a fraction of a second, not a
torch import.

A name is local when it exists, starts with `.`, `/` or `~`, has no `/` or more than one, or ends with a data file
suffix; only the remaining `ORG/NAME` shapes are looked up on the Hub, so a mistyped local path is never sent there.
A dataset is named `BASE[:CONFIG][@SPLIT]` (ovkit.data.sources reads it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ovkit.errors import OvkitError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SPEC = re.compile(r"(?P<base>[^:@]+)(?::(?P<config>[^:@]+))?(?:@(?P<split>[^@]+))?")
FILE_SUFFIXES = (".parquet", ".json", ".jsonl", ".csv", ".tsv", ".arrow", ".txt", ".zip", ".tar")
PROBE_TIMEOUT_S = 3.0


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
    the config check, naming the argument, before torch and the model load."""
    for text in texts:
        spec = parse_spec(text)
        if not Path(spec.base).expanduser().exists() and not is_hub_id(spec.base):
            raise OvkitError(f"{name} {text}: no such file or directory")


def is_remote(text: str | Path) -> bool:
    """A spec that names a Hub dataset (so it has no local fingerprint)."""
    spec = parse_spec(text)
    return not Path(spec.base).expanduser().exists() and is_hub_id(spec.base)


def probe_hub(subject: str, hint: str) -> None:
    """One HEAD request with a short timeout: `datasets` and transformers would retry an unreachable Hub for half a
    minute to minutes. `subject` names what was asked for (a dataset spec, `--model ID`); `hint` says what to do."""
    # heavy: huggingface_hub loads on first use, not at CLI start or in config checks
    from huggingface_hub import constants, get_session

    endpoint = constants.ENDPOINT
    try:
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 -- any transport failure means the same thing here
        raise OvkitError(
            f"{subject}: no local file or directory of that name, and the Hugging Face Hub ({endpoint}) cannot be "
            f"reached ({type(e).__name__}: {e}); {hint}"
        ) from None


def check_model(path: Path | str, flag: str = "--model") -> None:
    """A local directory that exists, or a name shaped like a Hub id (ORG/NAME): a mistyped local path fails here,
    in a config check before torch imports, and is never sent to the Hub (`locate` looks the Hub id up later)."""
    text = str(path)
    if Path(text).expanduser().exists():
        return
    if text.startswith((".", "/", "~")) or text.count("/") != 1 or not HUB_ID.fullmatch(text):
        raise OvkitError(
            f"{flag} {text}: no such directory (expected a model saved with save_pretrained, e.g. by `ovkit "
            f"init-model`)"
        )
