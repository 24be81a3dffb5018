"""ovkit and the tools ML engineers already use: dataset cards that `datasets.load_dataset(DIR)` reads with every
split, Hub ids and `datasets` directories as inputs (offline from the HF cache, never the network in tests), TRL's
conversational VLM format both ways, chat templates on converted rows, and model cards.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import micro_spec
from PIL import Image

from ovkit.cards import CARD
from ovkit.data import read_samples, sources
from ovkit.data.convert import content_parts
from ovkit.data.schema import image_cell, samples_table
from ovkit.data.sources import front_matter
from ovkit.errors import OvkitError
from ovkit.hub import is_hub_id, parse_spec

datasets = pytest.importorskip("datasets")

requires_trl = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="TRL is not installed (pip install -e '.[bench]')"
)
HUB_ID = "ovkit-test/tiny-vlm"


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    """Each test gets its own HF datasets cache and ovkit cache, and starts with nothing loaded."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setenv("OVKIT_CACHE", str(tmp_path / "ovkit-cache"))
    monkeypatch.setattr(sources, "_loaded", {})
    monkeypatch.setattr(sources, "_described", {})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, cli) -> Path:
    """`ovkit synth` through the command, so the output went through the Stage and carries its card."""
    out = tmp_path_factory.mktemp("synth") / "data"
    code, _, err = cli("synth", "--out", out, "--scale", "0.02", "--quiet")
    assert code == 0, err
    return out


def load(path, *args, **kw):
    return datasets.load_dataset(str(path), *args, **kw)


def card_meta(directory: Path) -> dict:
    return front_matter((directory / CARD).read_text())


def split_rows(corpus: Path) -> dict[str, int]:
    return json.loads((corpus / "ovkit.json").read_text())["metrics"]["splits"]


# ------------------------------------------------------------------------------------------------ dataset cards


def test_synth_card_loads_every_split_with_its_rows_and_pil_images(corpus):
    expected = split_rows(corpus)
    ds = load(corpus)
    assert {name: d.num_rows for name, d in ds.items()} == expected
    assert isinstance(ds["eval"][0]["images"][0], Image.Image)
    # the subsets' columns differ, so each is a config of its own with all of its columns
    pretrain, eval_ = load(corpus, "pretrain")["pretrain"], load(corpus, "eval", split="eval")
    assert "lang" in pretrain.column_names and "answer" not in pretrain.column_names
    assert eval_.num_rows == expected["eval"] and "answer" in eval_.column_names
    assert set(ds["instruct"].column_names) == set(pretrain.column_names) & set(eval_.column_names)
    meta = card_meta(corpus)
    assert [c["config_name"] for c in meta["configs"]] == ["default", "eval", "instruct", "pretrain", "rl", "val"]


def test_same_named_outputs_load_their_own_rows_from_one_cache(corpus, tmp_path, monkeypatch):
    """`datasets` keys the cache of `load_dataset(DIR)` by DIR's name and a hash of the card's configs (relative
    globs): a/data and b/data once shared an entry, and b/data returned a/data's rows. The card's content key keeps
    them apart."""
    from ovkit.cards import write_card

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    a, b = tmp_path / "a" / "data", tmp_path / "b" / "data"
    shutil.copytree(corpus, a)
    shutil.copytree(corpus, b)
    for sub in ("eval", "instruct", "pretrain", "rl", "val"):  # b: the first half of each split, its own card
        for f in (b / sub).glob("part-*.parquet"):
            t = pq.read_table(f)
            pq.write_table(t.slice(0, t.num_rows // 2), f)
    (b / CARD).unlink()
    write_card(b, json.loads((b / "ovkit.json").read_text()), b)
    rows = split_rows(corpus)
    assert load(a, "eval", split="eval").num_rows == rows["eval"]
    assert load(b, "eval", split="eval").num_rows == rows["eval"] // 2
    assert {k: v.num_rows for k, v in load(b).items()} == {k: n // 2 for k, n in rows.items() if n}
    assert {k: v.num_rows for k, v in load(a).items()} == {k: n for k, n in rows.items() if n}


def test_card_prose_comes_from_provenance(corpus):
    text = (corpus / CARD).read_text()
    prov = json.loads((corpus / "ovkit.json").read_text())
    assert f"`ovkit synth --out {corpus} --scale 0.02 --quiet`" in text
    assert f"ovkit version: {prov['ovkit_version']}" in text and f"seed: {prov['seed']}" in text
    assert f'load_dataset("{corpus}")' in text
    for split, n in split_rows(corpus).items():
        assert f"| {split} | {split} | `{split}/part-*.parquet` | {n} |" in text


def test_ovkit_reads_a_card_directory_by_config_and_split(corpus):
    rows = split_rows(corpus)
    assert read_samples(f"{corpus}:instruct").table.num_rows == rows["instruct"]
    assert read_samples(f"{corpus}@rl").table.num_rows == rows["rl"]
    with pytest.raises(OvkitError, match="choose one with"):
        read_samples(corpus)  # four subsets with different columns are not one table
    with pytest.raises(OvkitError, match="no config 'nope'"):
        read_samples(f"{corpus}:nope")


def test_sharded_output_card_covers_every_part_and_no_temporary_directory(corpus, tmp_path, cli):
    out = tmp_path / "sharded"
    cards = []
    for i in (1, 0):  # parts finish in any order; each writes the top-level card
        code, _, err = cli(
            "convert", f"{corpus}@instruct", "--shard", f"{i}/2", "--out", out, "--rows-per-file", "10", "--quiet"
        )
        assert code == 0, err
        cards.append((out / CARD).read_bytes())
    assert cards[0] == cards[1]  # same bytes whichever part wrote last
    assert "--shard I/2" in cards[0].decode()
    # a part being written by another process right now must not be read
    shutil.copytree(out / "part-00000-of-00002", out / "part-00000-of-00002.tmp-999")
    n = split_rows(corpus)["instruct"]
    assert load(out, split="train").num_rows == n
    assert (
        read_samples(out).table.column("id").to_pylist()
        == read_samples(f"{corpus}:instruct").table.column("id").to_pylist()
    )
    assert card_meta(out / "part-00001-of-00002")["configs"][0]["data_files"][0]["path"] == "part-*.parquet"


def test_subsets_side_tables_and_empty_tables(tmp_path):
    """rl-curate's layout: stage1/stage2 subsets are configs, rollouts/ (no chat rows) is not, an empty subset is
    left out of the configs (`datasets` cannot load an empty split)."""
    from ovkit.cards import write_card
    from ovkit.data import write_samples, write_table

    out = tmp_path / "curated"
    rows = [
        {
            "id": f"r{i}",
            "images": [image_cell(Image.new("RGB", (28, 28), "red"))],
            "messages": [{"role": "user", "content": "<image>\nq"}],
            "source": "t",
            "answer": "1",
        }
        for i in range(3)
    ]
    write_samples(samples_table(rows), out / "stage1")
    write_samples(samples_table(rows[:0]), out / "stage2")
    write_table(
        pa.table(
            {
                "prompt_id": ["r0"],
                "images": pa.array([[]], pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
            }
        ),
        out / "rollouts" / "part-00000-of-00001.parquet",
    )
    write_card(out, {"command": "rl-curate", "ovkit_version": "0", "argv": [], "metrics": {}}, out)
    meta = card_meta(out)
    assert [c["config_name"] for c in meta["configs"]] == ["default", "stage1"]
    assert "`stage2`" in (out / CARD).read_text()
    assert load(out)["stage1"].num_rows == 3
    from ovkit.data import parquet_files

    assert parquet_files(f"{out}@stage2") == [out / "stage2" / "part-00000-of-00001.parquet"]  # still reachable by name


def test_images_decode_whatever_columns_a_stage_adds(tmp_path):
    """Non-string columns (balance weights, pass rates, lists) used to drop the `datasets` feature metadata."""
    from ovkit.data import write_samples

    rows = [
        {
            "id": "a",
            "images": [image_cell(Image.new("RGB", (28, 28), "blue"))],
            "messages": [{"role": "user", "content": "<image>"}],
            "source": "t",
        }
    ]
    table = samples_table(rows).append_column("weight", pa.array([0.5])).append_column("ks", pa.array([[1, 2]]))
    write_samples(table, tmp_path / "ds")
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "ds" / "*.parquet"), split="train")
    assert isinstance(ds[0]["images"][0], Image.Image) and ds[0]["weight"] == 0.5 and ds[0]["ks"] == [1, 2]


# ------------------------------------------------------------------------------------------------ TRL's format


def test_trl_round_trip_is_lossless_on_every_synth_split(corpus, tmp_path, cli):
    for split in ("pretrain", "instruct", "rl", "eval"):
        trl, back = tmp_path / f"{split}-trl", tmp_path / f"{split}-back"
        assert cli("convert", f"{corpus}@{split}", "--to", "trl", "--out", trl, "--quiet")[0] == 0
        code, stdout, err = cli("convert", trl, "--out", back, "--quiet")
        assert code == 0, err
        assert "convert: trl (detected)" in stdout
        assert read_samples(back).table.equals(read_samples(f"{corpus}@{split}").table), split
        assert read_samples(trl).table.equals(read_samples(f"{corpus}@{split}").table)  # a TRL directory reads directly


def test_trl_layout_has_image_parts_and_no_markers(corpus, tmp_path, cli):
    assert cli("convert", f"{corpus}@instruct", "--to", "trl", "--out", tmp_path / "trl", "--quiet")[0] == 0
    ds = load(tmp_path / "trl", split="train")
    for row in ds.select(range(10)):
        parts = [p for m in row["messages"] for p in m["content"]]
        assert all("<image>" not in (p["text"] or "") for p in parts)
        assert sum(p["type"] == "image" for p in parts) == len(row["images"]) >= 1
        assert all(isinstance(im, Image.Image) for im in row["images"])
    assert content_parts("a<image>b<image>") == [
        {"type": "text", "text": "a"},
        {"type": "image", "text": None},
        {"type": "text", "text": "b"},
        {"type": "image", "text": None},
    ]


def test_trl_prompt_completion_single_image_and_inline_images(tmp_path):
    png = lambda c: image_cell(Image.new("RGB", (28, 28), c))  # noqa: E731
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    turn = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    img = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(
        pa.table(
            {
                "image": pa.array([png("red")], img),
                "prompt": pa.array(
                    [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]],
                    pa.list_(turn),
                ),
                "completion": pa.array(
                    [[{"role": "assistant", "content": [{"type": "text", "text": "red"}]}]], pa.list_(turn)
                ),
            }
        ),
        tmp_path / "pc.parquet",
    )
    got = read_samples(tmp_path / "pc.parquet").table.to_pylist()[0]
    assert got["messages"] == [{"role": "user", "content": "<image>colour?"}, {"role": "assistant", "content": "red"}]
    assert got["id"] == "pc-0" and got["source"] == "pc" and got["images"][0]["bytes"] == png("red")["bytes"]
    # text content and images without markers: TRL puts the images before the first user turn's text
    records = [
        {
            "messages": [{"role": "user", "content": "two?"}, {"role": "assistant", "content": "yes"}],
            "images": [png("red")["bytes"], png("blue")["bytes"]],
            "image": None,
        }
    ]
    ds = datasets.Dataset.from_list(records)
    ds.save_to_disk(str(tmp_path / "saved"))
    got = read_samples(tmp_path / "saved").table.to_pylist()[0]
    assert got["messages"][0]["content"] == "<image>\n<image>\ntwo?" and len(got["images"]) == 2


def test_chat_template_renders_image_tokens_for_a_converted_row(corpus, tmp_path, micro_model, cli):
    """The issue: `processor.apply_chat_template(row["messages"])` printed `<image>` on an ovkit row."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(micro_model)
    ovkit_row = read_samples(f"{corpus}@eval").table.to_pylist()[0]
    assert "<image>" in processor.apply_chat_template(ovkit_row["messages"], tokenize=False)  # the problem
    assert cli("convert", f"{corpus}@eval", "--to", "trl", "--out", tmp_path / "trl", "--quiet")[0] == 0
    row = load(tmp_path / "trl", split="train")[0]
    text = processor.apply_chat_template(row["messages"], tokenize=False)
    assert "<image>" not in text and text.count("<|image_pad|>") == len(row["images"]) == 1
    enc = processor(text=[text], images=row["images"], return_tensors="pt")
    n_pad = int((enc["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    merge = processor.image_processor.merge_size**2
    assert n_pad == int(enc["image_grid_thw"].prod()) // merge > 0


@requires_trl
def test_trl_sft_trainer_trains_on_converted_data_unchanged(corpus, tmp_path, micro_model, cli):
    """TRL's SFTTrainer, as documented for VLMs, on `ovkit convert --to trl` output: every parameter moves."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    assert cli("convert", f"{corpus}@instruct", "--to", "trl", "--out", tmp_path / "trl", "--quiet")[0] == 0
    train = load(tmp_path / "trl", split="train")
    model = AutoModelForImageTextToText.from_pretrained(micro_model)
    processor = AutoProcessor.from_pretrained(micro_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SFTConfig(
        output_dir=str(tmp_path / "trl-out"),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        max_length=None,
        dataloader_num_workers=0,
    )
    result = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=processor).train()
    assert result.global_step == 2 and result.training_loss > 0
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------ Hub ids and datasets
# dirs


def cache_as_hub_dataset(parquet_dir: Path, hub_id: str) -> None:
    """Put a dataset in the HF datasets cache the way `load_dataset(hub_id)` leaves it after a download
    (NAMESPACE___NAME/default/VERSION/HASH/NAME-train.arrow), without any network."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    cache = Path(datasets.config.HF_DATASETS_CACHE)
    namespace, name = hub_id.split("/")
    files = sorted(glob.glob(str(parquet_dir / "part-*.parquet")))
    Parquet(
        cache_dir=str(cache), dataset_name=name, hash="0123abcd", data_files={"train": files}
    ).download_and_prepare()
    (config_dir,) = (cache / name).glob("default-*")
    config_dir.rename(cache / name / "default")
    (cache / name).rename(cache / f"{namespace}___{name}")


def test_cached_hub_id_loads_offline_through_a_command(corpus, tmp_path, monkeypatch, cli):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert cli("convert", f"{corpus}@instruct", "--to", "trl", "--out", tmp_path / "trl", "--quiet")[0] == 0
    cache_as_hub_dataset(tmp_path / "trl", HUB_ID)
    expected = read_samples(f"{corpus}@instruct").table
    assert read_samples(HUB_ID).table.equals(expected)
    assert read_samples(f"{HUB_ID}@train[:5]").table.equals(expected.slice(0, 5))
    code, stdout, err = cli("convert", f"{HUB_ID}@train", "--out", tmp_path / "from-hub", "--quiet")
    assert code == 0, err
    assert read_samples(tmp_path / "from-hub").table.equals(expected)
    prov = json.loads((tmp_path / "from-hub" / "ovkit.json").read_text())
    assert prov["inputs"][0] == {
        "path": f"{HUB_ID}@train",
        "hub": HUB_ID,
        "source_fingerprint": datasets.load_dataset(HUB_ID, split="train")._fingerprint,
    }


def test_model_trained_on_a_hub_id_has_a_card_naming_base_model_and_dataset(
    corpus, tmp_path, monkeypatch, micro_model, cli
):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert cli("convert", f"{corpus}@instruct", "--to", "trl", "--out", tmp_path / "trl", "--quiet")[0] == 0
    cache_as_hub_dataset(tmp_path / "trl", HUB_ID)
    out = tmp_path / "sft"
    code, _, err = cli(
        "sft",
        HUB_ID,
        "--model",
        micro_model,
        "--out",
        out,
        "--max-steps",
        "1",
        "--batch-size",
        "2",
        "--precision",
        "fp32",
        "--quiet",
    )
    assert code == 0, err
    text = (out / CARD).read_text()
    meta = front_matter(text)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "image-text-to-text"
    assert meta["base_model"] == str(micro_model) and meta["datasets"] == [HUB_ID]
    assert {"ovkit", "sft"} <= set(meta["tags"])
    assert f'AutoModelForImageTextToText.from_pretrained("{out}")' in text and "| `lr` |" in text
    prov = json.loads((out / "ovkit.json").read_text())
    assert prov["inputs"][0]["hub"] == HUB_ID and prov["inputs"][0]["converted"]["files"] >= 1


def test_uncached_hub_id_offline_fails_fast_with_exit_2(tmp_path, monkeypatch, cli):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    code, _, err = cli("convert", "ovkit-test/not-cached", "--out", tmp_path / "out")
    assert code == 2 and time.perf_counter() - started < 15
    assert "ovkit-test/not-cached" in err and "not in the HF cache" in err and "HF_HUB_OFFLINE=1" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_unreachable_hub_fails_after_one_probe_not_datasets_retries(tmp_path, monkeypatch):
    import huggingface_hub

    class Down:
        def head(self, *a, **kw):
            raise ConnectionError("Name or service not known")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_session", lambda: Down())
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: pytest.fail("must not reach datasets' retry loop"))
    with pytest.raises(OvkitError, match="cannot be reached.*HF_HUB_OFFLINE=1"):
        read_samples("some-org/some-data")


@pytest.mark.parametrize(
    "text", ["./org/name", "/org/name", "~/name", "a/b/c", "name", "org/name.parquet", "org/data.jsonl"]
)
def test_local_looking_names_are_never_sent_to_the_hub(text, monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: pytest.fail("a local path went to the Hub"))
    assert not is_hub_id(parse_spec(text).base)
    with pytest.raises(OvkitError, match="no such file or directory"):
        read_samples(text)


def test_spec_syntax():
    assert parse_spec("HuggingFaceM4/ChartQA:default@test[:100]") == sources.Spec(
        "HuggingFaceM4/ChartQA:default@test[:100]", "HuggingFaceM4/ChartQA", "default", "test[:100]"
    )
    assert parse_spec("org/name@validation").split == "validation" and is_hub_id("org/name")


def test_saved_dataset_dict_needs_a_split(corpus, tmp_path):
    table = read_samples(f"{corpus}@rl").table
    ds = datasets.load_dataset(str(corpus), "rl")
    datasets.DatasetDict({"train": ds["rl"], "test": ds["rl"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(OvkitError, match="choose one with"):
        read_samples(tmp_path / "saved")
    assert read_samples(f"{tmp_path / 'saved'}@test").table.equals(table)


def test_other_layouts_name_the_missing_column_and_the_fix(tmp_path):
    img = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    png = image_cell(Image.new("RGB", (28, 28), "red"))
    datasets.Dataset.from_dict({"image": [png], "query": ["q"], "label": [["a"]]}).cast_column(
        "image", datasets.Image()
    ).save_to_disk(str(tmp_path / "chartqa"))
    with pytest.raises(OvkitError, match=r"column 'messages': not a sample table .*ovkit convert"):
        read_samples(tmp_path / "chartqa")
    pq.write_table(
        pa.table(
            {"id": ["a"], "image": pa.array([png], img), "conversations": [[{"from": "human", "value": "<image>q"}]]}
        ),
        tmp_path / "llava.parquet",
    )
    with pytest.raises(OvkitError, match="looks like --from llava"):
        read_samples(tmp_path / "llava.parquet")


# ------------------------------------------------------------------------------------------------ model cards


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory, corpus) -> Path:
    """A ~90K-parameter Qwen2.5-VL-architecture model with a tokenizer trained on the corpus text, built through
    `init-model`'s library with a smaller spec, wrapped in a Stage so it carries ovkit.json and its card."""
    from dataclasses import dataclass

    from ovkit.data.synth import corpus_texts
    from ovkit.models.tiny import build_tiny
    from ovkit.runs import Stage

    @dataclass
    class InitCfg:
        preset: str = "micro"
        corpus: str = str(corpus)

    spec = micro_spec()
    out = tmp_path_factory.mktemp("models") / "micro"
    with Stage("init-model", InitCfg(), out, inputs=[corpus]) as stage:
        build_tiny(stage.path, corpus_texts(corpus), spec=spec)
    return out


def test_init_model_card(micro_model):
    text = (micro_model / CARD).read_text()
    meta = yaml.safe_load(text.split("---")[1])
    assert meta["library_name"] == "transformers" and "base_model" not in meta
    assert meta["tags"] == ["ovkit", "init-model", "qwen2_5_vl"]
    assert "built from scratch" in text and "| `preset` | micro |" in text


def test_card_base_model_is_a_hub_id_or_an_absolute_path(micro_model, tmp_path, monkeypatch):
    import os

    from ovkit.cards import model_card

    def base_model(path: str):
        meta = front_matter(model_card(micro_model, {"command": "sft", "parent": {"path": path, "command": None}}, "m"))
        return meta.get("base_model")

    monkeypatch.chdir(tmp_path)
    typed = os.path.relpath(micro_model, tmp_path)  # `--model ../micro` as a user types it
    assert not Path(typed).is_absolute()
    assert base_model(typed) == str(micro_model.resolve())
    assert base_model("Qwen/Qwen2.5-VL-3B-Instruct") == "Qwen/Qwen2.5-VL-3B-Instruct"  # a Hub id stays one
    assert base_model("./gone/model") is None  # a relative path no longer here: unknown, not written


def test_a_failing_card_never_costs_the_output(tmp_path, monkeypatch, capsys):
    from dataclasses import dataclass

    from ovkit import runs

    @dataclass
    class Cfg:
        x: int = 1

    monkeypatch.setattr(runs, "write_card", lambda *a: 1 / 0)
    with runs.Stage("synth", Cfg(), tmp_path / "out") as stage:
        (stage.path / "f.txt").write_text("done")
    assert (
        tmp_path / "out" / "f.txt"
    ).read_text() == "done" and "could not write its README.md" in capsys.readouterr().err


def test_card_front_matter_parses_for_every_output_kind(corpus, micro_model):
    for directory in (corpus, micro_model):
        assert isinstance(card_meta(directory), dict) and card_meta(directory)
