"""On CUDA only: cuDNN's SDPA backward returns NaN at lengths of 64 mod 128 with a left-padded mask (PyTorch issue
196678), and the package's training path does not.

First a torch-only reproduction; where this torch/cuDNN does not have the bug, every test here is skipped and says so.
Then the same inputs through the guarded attention, and a real `ProRLTrainer` step on a left-padded batch whose padded
length is 192: with `cudnn_attention_guard: "off"` it stops on a NaN gradient, with the default ("auto") it trains.
Skipped without a GPU (CI); on the device machine: `CUDA_VISIBLE_DEVICES=0 python -m pytest -q
tests/test_cudnn_guard_gpu.py` (conftest.py hides the GPUs unless the variable is set).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from prorl_trl.attention import install_cudnn_attention_guard, probe_cudnn_backward
from prorl_trl.attention.cudnn_guard import guarded_sdpa_attention_forward, left_padded_causal_mask
from prorl_trl.tiny import build_tiny_model, build_tiny_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN's SDPA backend)")

HEADS, HEAD_DIM = 14, 64  # Qwen2-0.5B's attention


class Layer(torch.nn.Module):
    """What transformers' SDPA forward reads from an attention layer."""

    num_key_value_groups, is_causal = 1, True


def attention_inputs(length: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(2, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
        for _ in range(3)
    ]


def gradients(inputs: list[torch.Tensor], attend) -> list[torch.Tensor]:
    q, k, v = (tensor.clone().requires_grad_() for tensor in inputs)
    attend(q, k, v).float().square().mean().backward()
    return [q.grad, k.grad, v.grad]


def cudnn_forced(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=left_padded_causal_mask(q.shape[2], 5, q.device)
        )


@pytest.fixture(scope="module")
def bug_present():
    """Skip the module where this torch/cuDNN gives finite gradients (no bug to guard)."""
    try:
        grads = gradients(attention_inputs(192), cudnn_forced)
    except RuntimeError as error:
        pytest.skip(f"cuDNN's SDPA does not run here: {error}")
    if all(bool(torch.isfinite(grad).all()) for grad in grads):
        pytest.skip(
            f"torch {torch.__version__} with cuDNN {torch.backends.cudnn.version()} gives finite gradients at length "
            "192: "
            "this stack does not have PyTorch issue 196678, nothing to guard"
        )
    return True


def test_torch_alone_reproduces_the_bug_only_on_the_guarded_remainder(bug_present):
    for length in (64, 192, 320):
        assert not all(bool(torch.isfinite(g).all()) for g in gradients(attention_inputs(length), cudnn_forced)), length
    for length in (65, 128, 191, 256):
        assert all(bool(torch.isfinite(g).all()) for g in gradients(attention_inputs(length), cudnn_forced)), length
    assert 64 in probe_cudnn_backward(torch.device("cuda"), torch.bfloat16, HEADS, HEAD_DIM)


def test_the_guarded_attention_gives_the_reference_gradients_on_the_same_inputs(bug_present):
    model = build_tiny_model(build_tiny_tokenizer(), seed=0).cuda().to(torch.bfloat16)
    report = install_cudnn_attention_guard(model, "auto")
    assert report.active and 64 in report.remainders and report.probe_failing and 64 in report.probe_failing
    inputs = attention_inputs(192)
    mask = left_padded_causal_mask(192, 5, torch.device("cuda"))
    guarded = gradients(inputs, lambda q, k, v: guarded_sdpa_attention_forward(Layer(), q, k, v, mask)[0])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    reference = gradients([t.double() for t in inputs], lambda q, k, v: sdpa(q, k, v, attn_mask=mask))
    for got, want in zip(guarded, reference):
        assert torch.isfinite(got).all()
        assert (got.double() - want).norm() / want.norm() < 2e-2  # bf16 operands
    install_cudnn_attention_guard(model, "off")
    unguarded = gradients(inputs, lambda q, k, v: guarded_sdpa_attention_forward(Layer(), q, k, v, mask)[0])
    assert not all(bool(torch.isfinite(g).all()) for g in unguarded)  # off: cuDNN again, NaN again


def distinct_characters(completions, **kwargs):
    return [float(len(set(completion))) for completion in completions]


def left_padded_run(tmp_path, guard: str):
    """One ProRLTrainer step on prompts of 100 and 128 tokens (left padding in every batch) with completions forced to
    64 tokens: every training forward is 192 tokens long (64 mod 128)."""
    from peft import LoraConfig

    from prorl_trl.config import ProRLConfig
    from prorl_trl.trainer import NonFiniteUpdate, ProRLTrainer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                             num_key_value_heads=2, num_hidden_layers=2).cuda().to(torch.bfloat16)  # fmt: skip
    prompts = ["a" * 100, "b" * 128]  # both in every batch (2 prompts per step): left padding in every step
    args = ProRLConfig(
        output_dir=str(tmp_path / guard), max_steps=2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=64, generation_kwargs={"min_new_tokens": 64}, learning_rate=1e-3, beta=0.0,
        report_to=[], logging_steps=1, save_strategy="no", bf16=True, cudnn_attention_guard=guard,
    )  # fmt: skip
    trainer = ProRLTrainer(
        model=model, reward_funcs=[distinct_characters], args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )  # fmt: skip
    try:
        trainer.train()
        stop = None
    except NonFiniteUpdate as error:
        stop = error
    # the micro-batches of the last step taken (kept for a replay while stop_on_nonfinite is on): their padded lengths
    lengths = [sum(batch[key].shape[1] for key in ("prompt_ids", "completion_ids")) for batch in trainer._step_batches]
    return trainer, lengths, stop


def test_the_training_path_trains_where_cudnn_makes_the_gradients_nan(bug_present, tmp_path):
    trainer, lengths, stop = left_padded_run(tmp_path, "off")
    assert stop is not None and stop.global_step == 1 and lengths and all(n % 128 == 64 for n in lengths), (
        lengths,
        stop,
    )
    trainer, lengths, stop = left_padded_run(tmp_path, "auto")
    assert stop is None and trainer.state.global_step == 2 and lengths and all(n % 128 == 64 for n in lengths)
    assert (
        trainer.cudnn_attention_guard.active
        and trainer.model.get_base_model().config._attn_implementation == "sdpa_cudnn_guard"
    )
