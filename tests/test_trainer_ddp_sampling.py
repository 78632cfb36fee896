"""Dynamic sampling and early stop under 2-process DDP (gloo on CPU): ranks agree on refill rounds, never hang,
keep only informative groups, and stay identical.

The test runs this file as a torchrun worker (`__main__` below).
"""

import json
import sys
from pathlib import Path

import pytest
from test_ddp import run_two_processes


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_sampling")
    run_two_processes(__file__, str(out), timeout=300)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_ranks_agree_and_keep_informative_groups(results):
    rank0, rank1 = results
    assert rank0["rounds"] == rank1["rounds"] and max(rank0["rounds"]) > 1
    for rank in results:
        assert all(min(step) > 0.5 for step in rank["abs_advantages"]), "only mixed groups are trained on"
    assert rank0["weights"] == pytest.approx(rank1["weights"], abs=0)


def _worker(out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from _prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model
    from transformers import TrainerCallback

    from prorl_trl import PhaseConfig, ProRLTrainer
    from prorl_trl.recipe.run import leave_process_group

    def correctness(prompts, completion_ids, kind, **kwargs):
        return [1.0 if k == "easy" else 0.0 if k == "hard" else float(i % 2) for i, k in enumerate(kind)]

    record = {"rounds": [], "abs_advantages": []}

    class Probe(TrainerCallback):
        def bind(self, trainer):
            self.trainer = trainer

        def on_step_end(self, args, state, control, **kwargs):
            record["abs_advantages"].append(self.trainer._buffered_inputs[0]["advantages"].abs().tolist())
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "prorl/sampling_rounds" in logs:
                record["rounds"].append(logs["prorl/sampling_rounds"])
            return control

    model, tokenizer = tiny_model()
    kinds = ["easy", "mixed", "hard"] * 8
    args = tiny_args(
        Path(out_dir),
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=8,
        early_stop_importance_ratio=5.0,
        phases=[PhaseConfig(max_steps=2), PhaseConfig(max_steps=2, num_generations=2, lora_r=2)],
    )
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[correctness], args=args,
        train_dataset=prompts_dataset(len(kinds), kind=kinds), peft_config=lora(), callbacks=[Probe()],
    )
    trainer.train()
    weights = torch.cat([p.detach().flatten() for _, p in sorted(trainer.model.named_parameters())])
    record["weights"] = weights[:: max(1, weights.numel() // 2000)].tolist()
    rank = trainer.accelerator.process_index
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    leave_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
    from _worker_exit import exit_without_finalization

    exit_without_finalization()
