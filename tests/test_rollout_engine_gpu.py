"""On CUDA only: the rollout engine's CUDA graphs (compiled step) against `generate`, and what they must see.

A graph replays fixed addresses: it must follow in-place optimizer steps without a recapture, and recapture (not
replay stale memory) after a `.data` swap or a LoRA merge. Also: the Triton split-K attention against the reference
at the recipe's shapes, same seed -> same tokens (graph vs graph, graph vs the same compiled step without a graph), and
the compiled sampler's distribution (16-way top-p search) against the exact warped distribution, and the kernel
switches (`fused_mlp`, live attention splits) on and off against `generate`. Skipped without a GPU
(CI); on the device machine: `python -m pytest -q tests/test_rollout_engine_gpu.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import GenerationConfig

from prorl_trl.rollout.decode_attention import gqa_decode_attention_reference, kernel_supports
from prorl_trl.rollout.engine import RolloutEngine
from prorl_trl.tiny import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")


@pytest.fixture(scope="module")
def lora_model():
    from peft import LoraConfig, get_peft_model

    model, tokenizer = build_tiny(seed=0)
    model = get_peft_model(model.cuda(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj"]))
    model.train()  # as inside GRPOTrainer.training_step; no dropout, so the engine may run it in eval mode
    return model, tokenizer


def inputs(pad: int, batch: int = 6, width: int = 10):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 250, (batch, width), generator=generator)
    mask = torch.ones_like(input_ids)
    for row in range(batch):
        mask[row, : row % 3] = 0
        input_ids[row, : row % 3] = pad
    return input_ids.cuda(), mask.cuda()


def greedy_config(tokenizer, new_tokens: int = 20) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip


def reference(model, input_ids, mask, config):
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)[:, input_ids.shape[1]:]


def train_then_generate(engine, model, tokenizer, params, lr: float, before: torch.Tensor) -> torch.Tensor:
    """Three in-place AdamW steps, then a greedy generation: no recapture (the graph reads the live storage), the tokens
    equal `generate`'s and differ from `before` (else the updates were not seen, or the test proves nothing)."""
    input_ids, mask = inputs(tokenizer.pad_token_id)
    config = greedy_config(tokenizer)
    optimizer = torch.optim.AdamW(params, lr=lr)
    for _ in range(3):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    updated = engine.generate(model, input_ids, mask, config).tokens
    assert engine.stats.last["capture_reasons"] in ([], ["generation buffers moved"]), engine.stats.last
    assert torch.equal(updated, reference(model, input_ids, mask, config)) and not torch.equal(updated, before)
    return updated


@pytest.mark.parametrize("switches", ["defaults", "unfused_mlp", "fixed_splits"])
def test_graphs_follow_weights_like_generate(lora_model, switches, monkeypatch):
    """Greedy tokens equal `generate` (float32) after capture, after in-place AdamW steps (no recapture), after a
    `.data` swap and a merge (recaptured), and each change changed the output (else the test proves nothing). By
    default the MLP's first half (up_proj adapted) is `fused_mlp`'s kernel and attention splits the live keys into
    shares; each also switched off."""
    from prorl_trl.rollout import decode_attention, fused_mlp, lora_epilogue

    monkeypatch.setattr(fused_mlp, "FUSED_MLP", switches != "unfused_mlp")
    monkeypatch.setattr(decode_attention, "LIVE_SPLITS", switches != "fixed_splits")
    model, tokenizer = lora_model
    input_ids, mask = inputs(tokenizer.pad_token_id)
    config = greedy_config(tokenizer)
    engine = RolloutEngine(steps_per_graph=8)
    before = engine.generate(model, input_ids, mask, config).tokens
    assert engine.stats.captures == 1 and engine.stats.compile_error is None, engine.stats
    assert torch.equal(before, reference(model, input_ids, mask, config))
    assert torch.equal(engine.generate(model, input_ids, mask, config).tokens, before)

    updated = train_then_generate(engine, model, tokenizer, [p for p in model.parameters() if p.requires_grad], 0.5, before)

    generator = torch.Generator(device="cuda").manual_seed(1)
    for name, weight in model.named_parameters():
        if "lora_B" in name:
            weight.data = torch.randn(weight.shape, device="cuda", generator=generator) * 0.5
    swapped = engine.generate(model, input_ids, mask, config).tokens
    assert "parameter storage (shapes, dtypes or addresses)" in engine.stats.last["capture_reasons"]
    assert torch.equal(swapped, reference(model, input_ids, mask, config)) and not torch.equal(swapped, updated)
    model.merge_adapter()
    assert torch.equal(engine.generate(model, input_ids, mask, config).tokens, reference(model, input_ids, mask, config))
    model.unmerge_adapter()
    assert torch.equal(engine.generate(model, input_ids, mask, config).tokens, swapped)


def test_graphs_follow_full_fine_tuning_of_stacked_weights():
    """Full fine-tuning: the engine stacks copies of q/k/v's and gate/up's weights in its arena for each generation
    (`fused_weights`), leaving the Parameters where they are, and AdamW steps on every weight still reach the next
    generation (the graph reads the fresh copies and the live storage); greedy tokens equal `generate`."""
    model, tokenizer = build_tiny(seed=1)
    model = model.cuda().train()
    input_ids, mask = inputs(tokenizer.pad_token_id)
    config = greedy_config(tokenizer)
    engine = RolloutEngine(steps_per_graph=8)
    pointers = [p.data_ptr() for p in model.parameters()]
    before = engine.generate(model, input_ids, mask, config).tokens
    parts = engine._decoder_parts(model)
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert len(parts.stacks) == 2 * len(parts.layers)  # q/k/v and gate/up of every layer were stacked ...
    assert all(f is None for f in parts.fused_qkv + parts.fused_gate_up)  # ... and let go with the arena
    assert torch.equal(before, reference(model, input_ids, mask, config))
    train_then_generate(engine, model, tokenizer, list(model.parameters()), 0.05, before)


def test_capture_keeps_no_cublas_workspace_beside_training():
    """cuBLAS keeps a workspace (32 MiB on Hopper) per stream it ran on. The engine clears the workspaces around its
    capture, so its stream's workspace lives in the graph's private pool: after a generation (KV buffers released)
    and a training-side GEMM, allocated memory is what it was plus the engine's small state, not one more workspace."""
    assert hasattr(torch._C, "_cuda_clearCublasWorkspaces"), "torch moved the hook engine.clear_cublas_workspaces uses"
    model, tokenizer = build_tiny(seed=1)
    model = model.cuda().train()
    input_ids, mask = inputs(tokenizer.pad_token_id)
    square = torch.ones(256, 256, device="cuda")
    (square @ square).sum().item()  # the default stream's workspace exists, as in training
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = RolloutEngine(steps_per_graph=8)
    tokens = engine.generate(model, input_ids, mask, greedy_config(tokenizer)).tokens
    (square @ square).sum().item()  # training's next GEMM on the default stream
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    assert engine.stats.captures == 1 and not engine._arena.held
    assert kept < 2 * 2**20, f"{kept / 2**20:.1f} MiB still allocated after the generation"
    assert torch.equal(tokens, reference(model, input_ids, mask, greedy_config(tokenizer)))  # and it replayed right


def test_one_capture_while_the_arena_goes_back_to_the_driver_between_generations(lora_model):
    """The generation arena's memory leaves the process after every generation (training gets all of it) and comes
    back at the same addresses (`fixed_addresses`), whatever training allocated in between: one capture for three
    generations, each equal to `generate`."""
    model, tokenizer = lora_model
    input_ids, mask = inputs(tokenizer.pad_token_id)
    config = greedy_config(tokenizer)
    engine = RolloutEngine(steps_per_graph=8)
    expected = reference(model, input_ids, mask, config)
    kept = []
    for _ in range(3):
        assert torch.equal(engine.generate(model, input_ids, mask, config).tokens, expected)
        assert engine._arena.fixed_address_pool and not engine._arena.held
        kept.append(torch.empty(engine._arena.nbytes // 2, dtype=torch.uint8, device="cuda"))  # training's tensors
    assert engine.stats.captures == 1, engine.stats.last


@pytest.mark.parametrize("switch", ["fused_mlp", "live_splits", "lora_epilogue", "both"])
@torch.no_grad()
def test_bf16_decode_step_with_each_kernel_switch(switch, monkeypatch):
    """A bf16 model with float32 LoRA adapters on q, k and up (as the recipe loads it): one decode step's logits and KV
    writes with a kernel switch on equal those with it off within bf16 rounding, and the switch took effect
    ("lora_epilogue": q/k/v's folded B products; "both": every switch)."""
    from peft import LoraConfig, get_peft_model

    from prorl_trl.rollout import decode_attention, fused_mlp, lora_epilogue
    from prorl_trl.rollout.decoder import decoder_parts, refresh_fusions
    from test_lora_decode import decode_step_on_random_cache

    model, _ = build_tiny(seed=0)
    model = get_peft_model(model.cuda().to(torch.bfloat16),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "up_proj"]))  # fmt: skip
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05)
    parts = decoder_parts(model.eval())
    refresh_fusions(parts)
    step = decode_step_on_random_cache(parts, batch=32, columns=300, write_at=120, starts_below=40)

    settings = {  # switch: (module, attribute, the op that must then run; None: the same op, other splits)
        "fused_mlp": (fused_mlp, "FUSED_MLP", "prorl_rollout::gated_activation"),
        "live_splits": (decode_attention, "LIVE_SPLITS", None),
        "lora_epilogue": (lora_epilogue, "LORA_EPILOGUE", "prorl_rollout::lora_epilogue"),
    }
    for module, attribute, _ in settings.values():
        monkeypatch.setattr(module, attribute, False)
    default = step()
    expected_ops = set()
    monkeypatch.setattr(lora_epilogue, "MIN_RANK", 1)  # r8 here; the engine's threshold is measured
    for name, (module, attribute, op) in settings.items():
        if switch in (name, "both"):
            monkeypatch.setattr(module, attribute, True)
            expected_ops |= {op} - {None}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        switched = step()
    ran = {event.key for event in profile.key_averages()}
    assert expected_ops <= ran, expected_ops - ran  # the switch took effect
    if switch == "live_splits":
        assert not torch.equal(switched, default)  # other split boundaries, other float32 merge order
    error = ((switched - default).norm() / default.norm()).item()
    assert error < 2e-2, error


@pytest.mark.parametrize("top_p", [0.8, 1.0])
def test_same_seed_same_tokens_with_and_without_graphs(lora_model, monkeypatch, top_p):
    """Same seed, same tokens: graph replays, the same step launched eagerly, the softmax as torch ops
    (`SOFTMAX_KERNEL` off), and the sampler's torch-ops race (`RACE_KERNEL` off: `scores - log E` instead of the
    kernel's `p / E`, from the same uniforms; at top_p 1.0 the race on the logits against the same torch ops)."""
    from prorl_trl.rollout import sampler

    model, tokenizer = lora_model
    input_ids, mask = inputs(tokenizer.pad_token_id)
    config = GenerationConfig(max_new_tokens=24, do_sample=True, top_p=top_p, top_k=0, temperature=1.0,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    graphs = RolloutEngine(steps_per_graph=8)
    first = graphs.generate(model, input_ids, mask, config, seed=5).tokens
    assert torch.equal(graphs.generate(model, input_ids, mask, config, seed=5).tokens, first)
    assert not torch.equal(graphs.generate(model, input_ids, mask, config, seed=6).tokens, first)
    no_graphs = RolloutEngine(steps_per_graph=8, cuda_graphs=False)  # the same compiled step, launched eagerly
    assert torch.equal(no_graphs.generate(model, input_ids, mask, config, seed=5).tokens, first)
    monkeypatch.setattr(sampler, "SOFTMAX_KERNEL", False)
    torch_softmax = RolloutEngine(steps_per_graph=8)
    assert torch.equal(torch_softmax.generate(model, input_ids, mask, config, seed=5).tokens, first)
    monkeypatch.setattr(sampler, "RACE_KERNEL", False)
    torch_race = RolloutEngine(steps_per_graph=8)
    assert torch.equal(torch_race.generate(model, input_ids, mask, config, seed=5).tokens, first)


@pytest.mark.parametrize("top_p", [0.7, 1.0])
def test_compiled_sampler_distribution_matches_exact(lora_model, top_p):
    """20k first tokens through the compiled step (16-way top-p search, or at top_p 1.0 the race on the logits)
    against transformers' warped softmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    model, tokenizer = lora_model
    draws = 20_000
    prompt = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(2)).cuda()
    config = GenerationConfig(max_new_tokens=3, do_sample=True, top_p=top_p, top_k=0, temperature=1.2,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=0)  # fmt: skip
    tokens = RolloutEngine(steps_per_graph=2).generate(
        model, prompt.expand(draws, -1).contiguous(), torch.ones(draws, 6, dtype=torch.long, device="cuda"), config, seed=3
    ).tokens
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[:, -1].float()
        # The second token: condition on the most frequent first token, exact distribution from one forward pass.
        first = int(tokens[:, 0].mode().values)
        follow = model(input_ids=torch.cat([prompt, torch.tensor([[first]], device="cuda")], 1)).logits[:, -1].float()
    for position, scores, rows in ((0, logits, slice(None)), (1, follow, tokens[:, 0] == first)):
        warped = TemperatureLogitsWarper(1.2)(None, scores)
        exact = torch.softmax(TopPLogitsWarper(top_p)(None, warped) if top_p < 1 else warped, -1)[0]
        observed = np.bincount(tokens[rows, position].cpu().numpy(), minlength=exact.numel()).astype(float)
        expected = exact.double().cpu().numpy() * observed.sum()
        assert observed[expected == 0].sum() == 0, "a filtered-out token was drawn"
        big = expected >= 5
        table_obs = np.append(observed[big], observed[~big].sum())
        table_exp = np.append(expected[big], expected[~big].sum())
        keep = table_exp > 0
        if keep.sum() < 2:  # a peaked conditional: every draw in a one-cell support is all there is to check
            continue
        table_exp = table_exp[keep] * table_obs[keep].sum() / table_exp[keep].sum()
        assert stats.chisquare(table_obs[keep], table_exp).pvalue > 1e-3, position


@pytest.mark.parametrize("live_splits", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_attention_matches_reference(dtype, live_splits, monkeypatch):
    """At the recipe's shape, short, medium and full live lengths; with fixed column splits and with live shares."""
    from prorl_trl.rollout import decode_attention

    monkeypatch.setattr(decode_attention, "LIVE_SPLITS", live_splits)
    generator = torch.Generator(device="cuda").manual_seed(0)
    batch, kv_heads, groups, cache_len, head_dim = 32, 2, 7, 4352, 64
    query = torch.randn(batch, kv_heads * groups, 1, head_dim, device="cuda", generator=generator, dtype=dtype)
    keys, values = torch.randn(2, batch, kv_heads, cache_len, head_dim, device="cuda", generator=generator, dtype=dtype)
    assert kernel_supports(query, keys)
    for end in (5, 700, cache_len - 1):
        start = torch.randint(0, min(end, 200) + 1, (batch,), device="cuda", generator=generator)
        stop = torch.tensor([end], device="cuda")
        got = torch.ops.prorl_rollout.gqa_decode_attention(query, keys, values, start, stop, 0.125)
        want = gqa_decode_attention_reference(query, keys, values, start, stop, 0.125)
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert error < (1e-2 if dtype == torch.bfloat16 else 1e-5), (end, error)
        graph = torch.cuda.CUDAGraph()  # the last split to finish merges: same result whichever it is, replay after
        with torch.cuda.graph(graph):  # replay (the arrival counters go back to 0)
            replayed = torch.ops.prorl_rollout.gqa_decode_attention(query, keys, values, start, stop, 0.125)
        for _ in range(20):
            graph.replay()
            assert torch.equal(replayed, got), end


def assert_top_p_cut(probs: torch.Tensor, top_p: float, tau: torch.Tensor, tolerance: float = 1e-5) -> None:
    """`tau` is the top-p cut up to float32 summation: in float64, the mass at or below it exceeds 1 - top_p and the
    mass strictly below it does not (each within `tolerance`); it never exceeds the row's largest probability."""
    exact = probs.double()
    target = 1.0 - top_p
    up_to = (exact * (probs <= tau)).sum(-1)
    below = (exact * (probs < tau)).sum(-1)
    assert bool((up_to > target - tolerance).all()), (up_to.min().item(), target)
    assert bool((below <= target + tolerance).all()), (below.max().item(), target)
    assert bool((tau[:, 0] <= probs.amax(-1)).all())


@pytest.mark.parametrize("scale", [0.01, 1.0, 4.0, 12.0])
def test_triton_top_p_threshold_is_the_cut_and_reproducible(scale, monkeypatch):
    """The top-p kernels at the Qwen2 vocabulary, near-uniform to peaked rows: the right cut (float64 masses), the
    torch search's on most rows, and the same on every run and with prefetching flipped."""
    from prorl_trl.rollout import top_p_triton
    from prorl_trl.rollout.sampler import top_p_threshold_reference
    from prorl_trl.rollout.top_p_triton import launch_top_p_threshold

    generator = torch.Generator(device="cuda").manual_seed(0)
    probs = torch.softmax(torch.randn(32, 151_936, device="cuda", generator=generator) * scale, dim=-1)
    for top_p in (0.05, 0.7, 0.95, 1 - 1e-7):
        top_p_tensor = torch.tensor([top_p], device="cuda")
        tau = launch_top_p_threshold(probs, top_p_tensor)
        assert_top_p_cut(probs, top_p, tau)
        assert torch.equal(launch_top_p_threshold(probs, top_p_tensor), tau)
        same = (tau == top_p_threshold_reference(probs, top_p_tensor, ways=2)).float().mean().item()
        assert same >= 0.5, same  # rows differ only where float32 rounding decides (near-uniform rows)
        monkeypatch.setattr(top_p_triton, "PREFETCH", not top_p_triton.PREFETCH)
        assert torch.equal(launch_top_p_threshold(probs, top_p_tensor), tau)  # the same sums, loaded earlier or not
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_softmax_matches_torch(dtype):
    """The softmax kernels at the Qwen2 vocabulary against torch's, with temperature and the EOS mask on and off."""
    from prorl_trl.rollout.softmax_triton import launch_softmax

    generator = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(32, 151_936, device="cuda", generator=generator) * 4).to(dtype)
    temperature, eos = torch.tensor([0.8], device="cuda"), torch.tensor([151_645, 5], device="cuda")
    for too_early in (True, False):
        got = launch_softmax(logits, temperature, eos, torch.tensor([too_early], device="cuda"))
        scores = logits.float().clone()  # float32 logits: `.float()` is the same tensor
        if too_early:
            scores[:, eos] = -float("inf")
        want = torch.softmax(scores / temperature, -1)
        relative = ((got - want).abs() / want.clamp_min(1e-30)).max().item()
        assert relative < 1e-4, relative  # exp's float32 rounding at |score - max| up to ~50, sums in another order
        assert (got[:, eos] == 0).all() == too_early


@pytest.mark.parametrize("scale", [0.01, 0.6, 4.0])
def test_triton_race_is_the_reference_draw(scale, monkeypatch):
    """The race kernel at the Qwen2 vocabulary (256 rows) against `race_tokens_reference` from the same uniforms:
    the same token on (almost) every row, only nucleus tokens, prefetch on and off identical."""
    from prorl_trl.rollout import race_triton
    from prorl_trl.rollout.sampler import race_tokens, race_tokens_reference, row_keys
    from prorl_trl.rollout.top_p_triton import launch_top_p_threshold

    generator = torch.Generator(device="cuda").manual_seed(1)
    probs = torch.softmax(torch.randn(256, 151_936, device="cuda", generator=generator) * scale, dim=-1)
    tau = launch_top_p_threshold(probs, torch.tensor([0.7], device="cuda"))
    keys = row_keys(torch.tensor([3], device="cuda"), torch.tensor([17], device="cuda"), probs.shape[0])
    tokens = race_tokens(probs, tau, keys)
    assert (probs.gather(-1, tokens[:, None]) >= tau).all()
    same = (tokens == race_tokens_reference(probs, tau, keys)).float().mean().item()
    assert same >= 0.99, same  # a row may differ only where two keys are within float32 rounding (GPU log vs torch)
    monkeypatch.setattr(race_triton, "PREFETCH", not race_triton.PREFETCH)
    assert torch.equal(race_tokens(probs, tau, keys), tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_logits_race_is_the_torch_draw(dtype, monkeypatch):
    """The race on the logits (sampling without top-p) at the Qwen2 vocabulary, 256 rows, against the compiled path's
    torch ops (`choose_tokens(process_logits(...))`) from the same uniforms: the same token on (almost) every row,
    with the temperature and the EOS mask, and an EOS never drawn while too early; the step takes the kernel."""
    from prorl_trl.rollout import sampler

    generator = torch.Generator(device="cuda").manual_seed(4)
    logits = (torch.randn(256, 151_936, device="cuda", generator=generator) * 3).to(dtype)
    eos = [151_643, 5]
    logits[:, eos[0]] = 40.0  # drawn almost surely unless masked
    layout = sampler.SamplerLayout(do_sample=True, top_k=0, use_top_p=False, use_min_p=False,
                                   use_min_new_tokens=True, num_eos=len(eos))  # fmt: skip
    assert sampler.uses_logits_race(logits, layout)
    tensors = sampler.SamplerTensors.allocate(len(eos), torch.device("cuda"))
    tensors.load(sampler.sampler_settings(GenerationConfig(
        do_sample=True, top_p=1.0, top_k=0, temperature=1.2, min_new_tokens=10, max_new_tokens=20,
        eos_token_id=eos, pad_token_id=0)), seed=7)  # fmt: skip
    for step, too_early in ((3, True), (12, False)):
        step = torch.tensor([step], device="cuda")
        got = sampler.logits_race_tokens(logits, layout, tensors, step)
        want = sampler.choose_tokens(sampler.process_logits(logits, layout, tensors, step), layout, tensors, step)
        same = (got == want).float().mean().item()
        assert same >= 0.99, same  # a row may differ only where two keys are within float32 rounding
        drew_eos = torch.isin(got, torch.tensor(eos, device="cuda"))
        assert not drew_eos.any() if too_early else drew_eos.all()
    monkeypatch.setattr(sampler, "RACE_KERNEL", False)
    assert not sampler.uses_logits_race(logits, layout)
