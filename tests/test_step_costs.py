"""The training step's host side (#25): what the forward would work out from ids and grids is computed on the host
ahead of the step and gives the same numbers, and an optimiser step reads the device back a bounded number of times
whatever the batch (bench/_syncs.py: on a GPU each read stalls the host; on a CPU box the reads are counted)."""

from __future__ import annotations

import pytest
import torch
from helpers import config, make_rows, pack_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainable_model(root):
    """The tiny model as a learner has it: the learner's attention (varlen for packed rows and the vision tower)."""
    from ovkit.models import attention as attn
    from ovkit.models import load

    model, processor = load(root / "model")
    attn.apply(model, attn.resolve("auto", "cpu", train=True))
    return model, processor


def _loss_and_grads(model, batch):
    from ovkit.models.precompute import model_inputs
    from ovkit.runtime.loss import nll_sum

    model.zero_grad(set_to_none=True)
    loss = nll_sum(model, model_inputs(batch, "cpu"), batch["labels"], index=batch.get("target_index"))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-6)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_host_computed_positions_and_vision_layout_give_the_models_own_loss_and_gradients(deep):
    from ovkit.models.encode import decode_images, encode_sample
    from ovkit.pack.batches import collate_padded
    from ovkit.pack.packed import PackLayout

    root, _ = deep
    model, processor = _trainable_model(root)
    encoded = [encode_sample(processor, r["messages"], decode_images(r["images"])) for r in make_rows(6)]
    assert (
        len({e.length for e in encoded}) > 1 and len({tuple(e.mm["image_grid_thw"][0].tolist()) for e in encoded}) == 2
    )
    layout = PackLayout.for_model(model)
    host = collate_padded(encoded, 0, layout)
    for key in ("position_ids", "image_cu_seqlens", "image_window_index", "image_cu_window_seqlens", "target_index"):
        assert key in host, key
    plain = {k: v for k, v in collate_padded(encoded, 0).items() if k not in ("target_index", "num_targets")}
    _assert_same(_loss_and_grads(model, host), _loss_and_grads(model, plain))
    # a batch without padding goes without a mask (plain causal attention)
    same = [encoded[0]] * 3
    host = collate_padded(same, 0, layout)
    assert "attention_mask" not in host
    plain = {k: v for k, v in collate_padded(same, 0).items() if k not in ("target_index", "num_targets")}
    _assert_same(_loss_and_grads(model, host), _loss_and_grads(model, plain))


def test_packed_rows_with_host_boundaries_give_the_loss_of_the_boundary_search(deep, cli):
    from ovkit.train.data import PackedSource

    root, _ = deep
    model, processor = _trainable_model(root)
    plan, n_packs = pack_plan(cli, root, 128)
    source = PackedSource(plan, root / "data", processor, model, max_len=128)
    assert source.dataset.layout.attention == "positions"
    batch = source.collate([source[0]], 0)
    assert int(batch["cu_seq_lens_q"].numel()) > 2 and batch["max_length_q"] > 0  # several samples in the row
    searched = {
        k: v for k, v in batch.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    }
    _assert_same(_loss_and_grads(model, batch), _loss_and_grads(model, searched))


def _syncs_per_step(cfg) -> list[int]:
    from helpers import SyncCounter

    from ovkit.train import train

    with SyncCounter(steps=True) as syncs:
        train(cfg)
    return syncs.step_counts()


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_an_optimiser_step_reads_the_device_back_once_whatever_the_batch(assets, tmp_path, precision):
    """The step's metrics (loss and gradient norm, read together after the optimiser step), nothing else: not inside
    transformers' Qwen-VL forward either, whose image merge (a token count check read twice, the features split by
    `grid_thw.tolist()`) the learner does itself from host-computed positions. Before #25: 107 at batch 8 and 53 at
    batch 2 (the per-sample rope index, the vision windows, per-layer boundary reads, the counts)."""
    small = _syncs_per_step(
        config("SFTConfig", assets, tmp_path / "b2", batch_size=2, max_steps=4, precision=precision)
    )
    large = _syncs_per_step(
        config("SFTConfig", assets, tmp_path / "b8", batch_size=8, max_steps=4, precision=precision)
    )
    assert len(small) == len(large) == 3  # the periods from the end of one step to the end of the next
    assert small == large == [1, 1, 1], (small, large)
    accumulated = _syncs_per_step(
        config("SFTConfig", assets, tmp_path / "a4", batch_size=2, grad_accum=4, max_steps=4, precision=precision)
    )
    assert accumulated == [1, 1, 1]  # micro-batches add none
