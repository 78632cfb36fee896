"""The cuDNN attention guard on the CPU: what it decides, that the guarded attention computes exactly transformers'
SDPA, and that a run shows and records it. Its effect on cuDNN itself is tested on a GPU (test_cudnn_guard_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from prorl_trl.attention import GUARDED_SDPA, install_cudnn_attention_guard, probe_cudnn_backward
from prorl_trl.attention.cudnn_guard import (
    ROUTED_THROUGH_GUARD,
    cudnn_cannot_run,
    guarded_length,
    left_padded_causal_mask,
    probe_dtype,
    probe_key,
    report_after_probe,
    set_guard,
    use_guarded_sdpa,
)
from prorl_trl.config import ProRLConfig
from prorl_trl.rollout.gqa_attention import GQA_DECODE_ATTENTION, use_gqa_decode_attention
from prorl_trl.tiny import build_tiny
from tests._prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model


@pytest.fixture(autouse=True)
def unguarded():
    yield
    set_guard(False)  # the guard is per process: leave it as the next test expects


def test_the_length_rule_covers_the_guarded_remainders_of_either_length_or_every_length():
    set_guard(False, {64})
    assert [guarded_length(n, n) for n in (64, 192, 4160, 63, 65, 128, 4096)] == [True] * 3 + [False] * 4
    assert guarded_length(1, 192) and not guarded_length(1, 191)  # a query shorter than the keys: either counts
    set_guard(True)
    assert guarded_length(65, 65)
    set_guard(False)
    assert not guarded_length(64, 64)


def test_on_the_cpu_nothing_is_probed_or_switched_and_the_report_says_why():
    model, _ = build_tiny(seed=0)
    assert model.config._attn_implementation == "sdpa"
    report = install_cudnn_attention_guard(model, "auto")
    assert not report.active and report.probe_failing is None and "no CUDA device" in report.message
    assert model.config._attn_implementation == "sdpa"
    assert probe_cudnn_backward(torch.device("cpu"), torch.bfloat16, 14, 64) is None
    eager, _ = build_tiny(seed=0)
    eager.set_attn_implementation("eager")
    assert "'eager', not SDPA" in install_cudnn_attention_guard(eager, "auto").message
    with pytest.raises(ValueError, match="one of \\['auto', 'always', 'off'\\]"):
        install_cudnn_attention_guard(model, "sometimes")


def test_after_the_probe_auto_guards_64_and_what_failed_or_nothing_where_cudnn_cannot_train_the_shape():
    """Each answer the GPU probe can give, decided without a GPU. cuDNN refusing the shape (None) happens on a GPU under
    `full_determinism`: its report once raised a TypeError and stopped every worker before its first step."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    clean = report_after_probe("auto", (), 0.91, "torch x, H200", "2 heads of 64, torch.bfloat16")
    assert clean.active and clean.remainders == (64,) and clean.probe_failing == ()
    assert "found no NaN gradient" in clean.message and "[64] mod 128" in clean.message
    failing = report_after_probe("auto", (96, 64), 1.234, "torch x, H200", "2 heads of 64, torch.bfloat16")
    assert failing.remainders == (64, 96) and failing.probe_failing == (96, 64) and failing.probe_seconds == 1.23
    refused = report_after_probe("auto", None, 0.05, "torch x, H200", "2 heads of 64, torch.bfloat16")
    assert not refused.active and refused.remainders == () and refused.probe_failing is None
    assert "not needed" in refused.message and "shape or dtype" in refused.message
    torch.use_deterministic_algorithms(True)
    try:
        deterministic = report_after_probe("auto", None, 0.05, "torch x, H200", "2 heads of 64, torch.bfloat16")
    finally:
        torch.use_deterministic_algorithms(before)
    assert "deterministic algorithms are on" in deterministic.message and deterministic.as_dict()["remainders"] == ()


def test_only_an_error_that_means_cudnn_cannot_run_switches_the_guard_off():
    """Before 2026-11-29 any error of the probe (out of memory on a GPU shared by several runs, one failed plan) read
    as "cuDNN cannot train this shape": the guard guarded nothing, not even length 64, for the whole process."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    assert cudnn_cannot_run(RuntimeError("No available kernel. Aborting execution."))
    assert not cudnn_cannot_run(torch.cuda.OutOfMemoryError("CUDA out of memory. No available kernel"))
    assert not cudnn_cannot_run(RuntimeError("cuDNN Frontend error: no valid execution plan"))
    alert = RuntimeError("_scaled_dot_product_cudnn_attention_backward does not have a deterministic implementation")
    try:
        torch.use_deterministic_algorithms(False)
        assert not cudnn_cannot_run(alert)
        torch.use_deterministic_algorithms(True)
        assert cudnn_cannot_run(alert)  # strictly deterministic: cuDNN never takes the backward
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_the_probe_runs_in_the_dtype_training_attention_runs_in():
    """Half-precision weights run attention in their dtype; float32 weights in autocast's: float16 under `fp16`
    (before 2026-11-29 the probe took bfloat16 there and answered for kernels that training never ran)."""
    assert probe_dtype(torch.bfloat16, None) == torch.bfloat16 and probe_dtype(torch.float16, None) == torch.float16
    assert probe_dtype(torch.float32, torch.float16) == torch.float16
    assert probe_dtype(torch.float32, None) == torch.bfloat16 and probe_dtype(torch.bfloat16, torch.float16) == (
        torch.bfloat16
    )


def test_a_probe_made_under_strict_deterministic_algorithms_is_not_reused_once_they_are_off():
    """Its answer (None: cuDNN never trains) would otherwise leave a later trainer's attention unguarded."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    shape = (torch.device("cuda", 0), torch.bfloat16, 14, 64)
    try:
        torch.use_deterministic_algorithms(False)
        free = probe_key(*shape)
        torch.use_deterministic_algorithms(True, warn_only=True)  # cuDNN still runs (with a warning): same answer
        assert probe_key(*shape) == free
        torch.use_deterministic_algorithms(True)
        assert probe_key(*shape) != free and probe_key(*shape)[:4] == free[:4]
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_the_guarded_attention_is_transformers_sdpa_bit_for_bit_forward_and_backward_with_checkpointing():
    """On the CPU the guard never steers (no cuDNN), so a model switched to it must compute exactly what "sdpa"
    computes, left padding and gradient checkpointing's recomputation included."""
    results = []
    for guarded in (False, True):
        model, _ = build_tiny(seed=0)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        if guarded:
            set_guard(True)  # every length: the CPU still keeps transformers' own call
            assert use_guarded_sdpa(model) and model.config._attn_implementation == GUARDED_SDPA
        ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[0, :7] = 0  # left padding: the first rows of sequence 0 see no key
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.float().square().mean().backward()
        results.append(
            (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (want_logits, want_grads), (got_logits, got_grads) = results
    assert torch.equal(want_logits, got_logits)
    assert want_grads.keys() == got_grads.keys() and all(torch.equal(want_grads[n], got_grads[n]) for n in want_grads)


def test_the_guard_composes_with_grouped_query_decode_attention_and_off_switches_back():
    assert GQA_DECODE_ATTENTION in ROUTED_THROUGH_GUARD  # its training path calls the guarded forward
    model, _ = build_tiny(seed=0)
    assert use_guarded_sdpa(model)
    assert use_gqa_decode_attention(model) and model.config._attn_implementation == GQA_DECODE_ATTENTION
    assert use_guarded_sdpa(model)  # already routed through the guard: left as it is
    guarded, _ = build_tiny(seed=0)
    use_guarded_sdpa(guarded)
    report = install_cudnn_attention_guard(guarded, "off")
    assert guarded.config._attn_implementation == "sdpa" and not report.active and "off" in report.message


def test_the_probe_mask_is_the_one_transformers_builds_for_left_padding():
    from transformers.masking_utils import sdpa_mask

    padding = torch.ones(2, 10, dtype=torch.long)
    padding[0, :5] = 0
    import inspect

    query = (
        {"q_length": 10}
        if "q_length" in inspect.signature(sdpa_mask).parameters
        else {"cache_position": torch.arange(10)}
    )
    want = sdpa_mask(batch_size=2, kv_length=10, attention_mask=padding, allow_is_causal_skip=False, **query)
    assert torch.equal(left_padded_causal_mask(10, 5, torch.device("cpu")), want)


def test_settings_are_checked_and_a_trainer_keeps_its_report(tmp_path):
    with pytest.raises(ValueError, match="cudnn_attention_guard must be one of"):
        ProRLConfig(output_dir=str(tmp_path), cudnn_attention_guard="yes", use_cpu=True)
    with pytest.raises(ValueError, match="needs stop_on_nonfinite: true"):
        ProRLConfig(output_dir=str(tmp_path), stop_on_nonfinite=False, max_nonfinite_skips=2, use_cpu=True)
    from prorl_trl.trainer import ProRLTrainer

    model, tokenizer = tiny_model()
    trainer = ProRLTrainer(
        model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=tiny_args(tmp_path),
        train_dataset=prompts_dataset(), processing_class=tokenizer, peft_config=lora(),
    )  # fmt: skip
    assert trainer.args.cudnn_attention_guard == "auto" and not trainer.cudnn_attention_guard.active
    assert trainer.cudnn_attention_guard.as_dict()["message"].startswith("cuDNN attention guard not needed")
