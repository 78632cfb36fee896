"""`consolidate_frozen_parts`: each reset joins a layer's frozen parts into one, so the forward pays for one part;
the delta is kept to float32 rounding (no longer to the bit), the reference still equals the policy, and a saved run
loads back to the same bits."""

from __future__ import annotations

import copy

import pytest
import torch
from _prorl_helpers import lora, prompts_dataset, tiny_args
from peft import get_peft_model
from transformers import TrainerCallback

from prorl_trl import PhaseConfig, ProRLConfig, ProRLTrainer
from prorl_trl.reset import frozen_layers, frozen_state_dict, load_frozen_
from prorl_trl.reset.frozen import FrozenDelta
from prorl_trl.rollout.engine import model_fingerprint
from prorl_trl.tiny import build_tiny

PROBE = torch.arange(3, 40).reshape(1, -1)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def random_parts(dtype=torch.float32, ranks=(4, 4, 2), scalings=(2.0, 0.5, 1.5)) -> FrozenDelta:
    generator = torch.Generator().manual_seed(0)
    frozen = FrozenDelta()
    for rank, scaling in zip(ranks, scalings, strict=True):
        down = torch.randn(rank, 16, generator=generator).to(dtype)
        up = (torch.randn(12, rank, generator=generator) * 1e-3).to(dtype)
        frozen.append(down, up, scaling)
    return frozen


def test_joined_part_has_the_parts_product_and_their_total_rank():
    frozen = random_parts()
    dense, x = frozen.weight_delta(), torch.randn(5, 16)
    separate = frozen.add_to(torch.zeros(5, 12), x)
    assert frozen.consolidate() and len(frozen.scalings) == 1 and frozen.rank == 10 and frozen.scalings == [1.0]
    torch.testing.assert_close(frozen.weight_delta(), dense, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(frozen.add_to(torch.zeros(5, 12), x), separate, rtol=1e-5, atol=1e-8)
    assert not frozen.consolidate()  # one part: nothing to join


def test_room_for_later_resets_is_zeros_that_later_parts_fill_in_place():
    """A joined part with room computes what the join without room computes, and a later part is written into the
    room: same tensors, same shapes (the rollout engine's graphs stay valid), the values of a join without room."""
    frozen, plain = random_parts(ranks=(4,), scalings=(2.0,)), random_parts(ranks=(4,), scalings=(2.0,))
    x = torch.randn(5, 16)
    assert not plain.consolidate()  # one part, no room asked: left as it is
    assert frozen.consolidate(room=8) and frozen.parts[0][0].shape == (12, 16) and frozen.rank == 4
    assert frozen.used == [4] and not frozen.parts[0][0][4:].any() and not frozen.parts[0][1][:, 4:].any()
    torch.testing.assert_close(frozen.add_to(torch.zeros(5, 12), x), plain.add_to(torch.zeros(5, 12), x))
    torch.testing.assert_close(frozen.weight_delta(), plain.weight_delta(), rtol=1e-6, atol=1e-9)
    storage = [t.data_ptr() for t in frozen.parts[0][:2]]
    for reset, (rank, scaling) in enumerate([(4, 0.5), (2, 1.5)]):
        generator = torch.Generator().manual_seed(10 + reset)
        down, up = torch.randn(rank, 16, generator=generator), torch.randn(12, rank, generator=generator) * 1e-3
        for delta in (frozen, plain):
            delta.append(down, up, scaling)
        assert frozen.consolidate(room=rank) and plain.consolidate()
        assert [t.data_ptr() for t in frozen.parts[0][:2]] == storage and frozen.parts[0][0].shape == (12, 16)
    assert frozen.rank == plain.rank == 10 and frozen.used == [10] and len(frozen.scalings) == 1
    joined_down, joined_up, _ = plain.parts[0]
    assert torch.equal(frozen.parts[0][0][:10], joined_down) and torch.equal(frozen.parts[0][1][:, :10], joined_up)
    frozen.append(torch.randn(3, 16), torch.randn(12, 3), 1.0)  # past the room: joined into new, larger tensors
    assert frozen.consolidate() and frozen.rank == 13 and frozen.parts[0][0].shape == (13, 16)
    assert frozen.parts[0][0].data_ptr() != storage[0]
    capped = random_parts(ranks=(4,), scalings=(2.0,))
    assert capped.consolidate(room=100) and capped.parts[0][0].shape == (12, 16)  # room up to min(out, in) only


def test_bf16_parts_are_left_apart():
    """A bf16 (QLoRA) adapter's parts would round the scaled `up` to bf16: they stay one part per reset."""
    frozen = random_parts(dtype=torch.bfloat16)
    assert not frozen.consolidate() and len(frozen.scalings) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_three_joined_resets_move_the_outputs_by_float32_rounding_only(dtype):
    """Three resets with joined parts against the same three with one part each (bitwise no-ops, see
    test_exact_resets): float32 outputs agree to float32 rounding. In bf16 a hidden value whose float32 sum sat on a
    rounding boundary flips one step and later layers and positions carry it on, so many logits may differ, but by
    less than one bf16 step of the largest logit. The adapters' initial A (PEFT draws it from the global generator)
    is seeded to a case where that happens (26: a quarter of the logits differ). The reference (adapter disabled)
    equals the policy after every reset."""
    from prorl_trl.reset import freeze_lora_delta, reinit_adapter

    torch.manual_seed(26)
    model = get_peft_model(build_tiny(seed=0)[0].to(dtype), lora(r=4, targets=TARGETS)).eval()
    models = {False: model, True: copy.deepcopy(model)}  # the same initial adapters
    for reset in range(3):
        for joined, model in models.items():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(reset)
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(std=1e-2)
            freeze_lora_delta(model, consolidate=joined)
            reinit_adapter(model, seed=reset)
    parts = {joined: {len(f.scalings) for _, _, f in frozen_layers(model)} for joined, model in models.items()}
    assert parts == {False: {3}, True: {1}}
    separate, joined = (models[j](input_ids=PROBE).logits.float() for j in (False, True))
    with models[True].disable_adapter():
        assert torch.equal(models[True](input_ids=PROBE).logits.float(), joined)  # the reference is the policy
    if dtype == torch.float32:
        torch.testing.assert_close(joined, separate, rtol=1e-5, atol=1e-5)
    else:
        assert (joined != separate).any()  # the case this test is about
        assert (joined - separate).abs().max() <= separate.abs().max() / 256  # one bf16 step of the largest logit


def test_a_trained_run_joins_its_parts_at_every_reset_and_loads_back_to_the_bit(tmp_path):
    model, tokenizer = build_tiny(seed=0)
    args = tiny_args(tmp_path, max_steps=-1, learning_rate=1e-2, save_merged_on_reset=False,
                     consolidate_frozen_parts=True, phases=[PhaseConfig(max_steps=1)] * 3)  # fmt: skip
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **kw: [0.0, 1.0] * 2],
        args=args, train_dataset=prompts_dataset(), peft_config=lora(r=4, targets=TARGETS),
    )  # fmt: skip
    trainer.train()
    layers = frozen_layers(trainer.model)
    assert trainer.prorl_resets == 2 and layers
    assert all(len(frozen.scalings) == 1 and frozen.rank == 8 for _, _, frozen in layers)
    state = frozen_state_dict(trainer.model)
    with torch.no_grad():
        before = trainer.model(input_ids=PROBE).logits
        load_frozen_(trainer.model, state)
        assert torch.equal(trainer.model(input_ids=PROBE).logits, before)


def test_joining_parts_without_frozen_resets_is_refused(tmp_path):
    with pytest.raises(ValueError, match="consolidate_frozen_parts"):
        ProRLConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, lora_reset_mode="merge", consolidate_frozen_parts=True
        )


class FrozenStorage(TrainerCallback):
    """The storage of every parameter and buffer (pointers, shapes, dtypes) at the start of each step: what the
    rollout engine's captured graphs depend on (`model_fingerprint`)."""

    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.seen.append(model_fingerprint(model)[0])


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "separate"])
def test_planned_resets_after_the_first_keep_the_storage_the_rollout_engine_captured(tmp_path, joined):
    """With joined parts the first reset leaves room for the two more the phases plan, and they fill it in place: the
    model's storage from phase 1 on is what the engine captured, so it replays its graphs. Separate parts add new
    buffers at every reset. A resumed run loads the room and the used rank back."""
    model, tokenizer = build_tiny(seed=0)
    args = tiny_args(tmp_path, max_steps=-1, learning_rate=1e-2, save_merged_on_reset=False,
                     consolidate_frozen_parts=joined, phases=[PhaseConfig(max_steps=1)] * 4)  # fmt: skip
    storage = FrozenStorage()
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **kw: [0.0, 1.0] * 2],
        args=args, train_dataset=prompts_dataset(), peft_config=lora(r=4, targets=TARGETS), callbacks=[storage],
    )  # fmt: skip
    trainer.train()
    assert trainer.prorl_resets == 3 and len(storage.seen) == 4 and storage.seen[0] != storage.seen[1]
    assert (storage.seen[1] == storage.seen[2] == storage.seen[3]) is joined
    layers = frozen_layers(trainer.model)
    assert layers and all(frozen.rank == 12 and len(frozen.scalings) == (1 if joined else 3) for _, _, frozen in layers)
    state = frozen_state_dict(trainer.model)
    with torch.no_grad():
        before = trainer.model(input_ids=PROBE).logits
        load_frozen_(trainer.model, state)
        assert torch.equal(trainer.model(input_ids=PROBE).logits, before)
    assert all(frozen.rank == 12 for _, _, frozen in frozen_layers(trainer.model))


def test_a_saved_part_with_room_loads_back_with_its_room(tmp_path):
    model = get_peft_model(build_tiny(seed=0)[0], lora(r=4, targets=TARGETS)).eval()
    from prorl_trl.reset import freeze_lora_delta, reinit_adapter

    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=1e-2)
    freeze_lora_delta(model, consolidate=True, room_for=2)
    reinit_adapter(model, seed=0)
    state = frozen_state_dict(model)
    assert any(key.endswith(".0.rank") for key in state)
    with torch.no_grad():
        before = model(input_ids=PROBE).logits
        load_frozen_(model, state)
        assert torch.equal(model(input_ids=PROBE).logits, before)
    assert all(f.used == [4] and f.parts[0][0].shape[0] == 12 for _, _, f in frozen_layers(model))
    key = next(key for key in state if key.endswith(".0.rank"))
    with pytest.raises(ValueError, match="says rank 13 of 12"):
        load_frozen_(model, {**state, key: torch.tensor([13])})
