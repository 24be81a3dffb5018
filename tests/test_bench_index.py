"""bench/: every bench is indexed in bench/README.md, prints its final table through bench/_result.py (one result
format, JSON lines with BENCH_JSON), and every `bench/...` path the documents and the Makefile cite exists."""

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
BENCHES = sorted(p for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_"))


def test_every_bench_is_in_the_index():
    index = (BENCH / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in BENCHES if f"`{p.name}`" not in index]
    assert not missing, f"bench/README.md does not index {missing}"


def test_every_python_bench_prints_its_table_through_result():
    for path in BENCHES:
        if path.suffix == ".py":
            assert "_result.table(" in path.read_text(encoding="utf-8"), f"{path.name} does not use bench/_result.py"


def test_cited_bench_paths_exist():
    cited = set()
    for doc in [ROOT / "BENCHMARKS.md", ROOT / "README.md", ROOT / "Makefile", BENCH / "README.md"]:
        cited |= set(re.findall(r"bench/([\w.-]+\.(?:py|sh))", doc.read_text(encoding="utf-8")))
    for doc in [*(ROOT / "docs").glob("*.md"), *(ROOT / "commands").glob("*.md")]:
        cited |= set(re.findall(r"bench/([\w.-]+\.(?:py|sh))", doc.read_text(encoding="utf-8")))
    assert cited and not [c for c in cited if not (BENCH / c).is_file()]


def test_result_prints_markdown_and_appends_json_lines(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("_result", BENCH / "_result.py")
    result = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(result)
    out = tmp_path / "bench.jsonl"
    monkeypatch.setenv("BENCH_JSON", str(out))
    rows = [{"method": "ovkit", "seconds": 1.23456, "packs": 1200}, {"method": "trl", "seconds": None, "packs": 7}]
    result.table("pack", "a title", rows, formats={"seconds": ".2f", "packs": ",d"})
    result.table("pack", "a title", rows[:1])
    printed = capsys.readouterr().out
    assert "| method | seconds | packs |" in printed and "| ovkit | 1.23 | 1,200 |" in printed
    assert "| trl | n/a | 7 |" in printed
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 3  # appended, one line per row
    assert lines[0]["bench"] == "pack" and lines[0]["table"] == "a title" and lines[0]["seconds"] == 1.23456
    assert lines[1]["seconds"] is None and "commit" in lines[0] and "time" in lines[0]
