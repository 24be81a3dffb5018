import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def cli():
    """Invoke `ovkit ...` in-process through main(): returns (exit_code, stdout, stderr)."""
    import contextlib
    import io
    import sys

    from ovkit import cli as cli_mod

    def run(*args: str):
        out, err = io.StringIO(), io.StringIO()
        old = sys.argv
        sys.argv = ["ovkit", *map(str, args)]
        code = 0
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                cli_mod.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = old
        return code, out.getvalue(), err.getvalue()

    return run
