"""`prorl-trl ablate` on a tiny grid: two good variants and one that fails at run time, run 2 at a time; the table
has the validation metric and reward means of each; a re-run skips finished variants; a bad grid exits 2."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import yaml

from prorl_trl.recipe.ablate import load_grid
from prorl_trl.cli import main
from prorl_trl.recipe import RecipeError

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = REPO / "tests" / "recipes" / "tiny_gsm8k.yaml"


def write_grid(tmp_path: Path, tiny_dir: Path, shared_data: Path, variants: dict) -> Path:
    grid = {
        "base": str(TINY_RECIPE),
        "output_dir": str(tmp_path / "ablation"),
        "overrides": {
            "model.name_or_path": str(tiny_dir),
            "data.source": str(shared_data / "gsm8k"),
            "phases": [{"name": "only", "max_steps": 1}],
        },
        "variants": variants,
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def ablation(tiny_dir, shared_data, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ablate")
    variants = {
        "rank4": {},
        "rank2": {"peft.r": 2, "rewards": [{"name": "boxed_answer"}, {"name": "think_answer_format", "weight": 0.5}]},
        # a valid recipe that fails at run time: validate does not reach the hub (reported unchecked), train is offline
        "broken": {"data.source": "hub-org/no-such-dataset"},
    }
    grid = write_grid(tmp_path, tiny_dir, shared_data, variants)
    code = main(["ablate", str(grid), "--parallel", "2"])
    return tmp_path / "ablation", grid, code


def read_table(out: Path) -> dict[str, dict[str, str]]:
    with open(out / "summary.csv") as handle:
        return {row["variant"]: row for row in csv.DictReader(handle)}


def test_table_has_metric_and_reward_means_and_survives_a_failure(ablation):
    out, _, code = ablation
    assert code == 1  # one variant failed; the others still ran
    table = read_table(out)
    assert list(table) == ["rank4", "rank2", "broken"]
    assert table["rank4"]["status"] == table["rank2"]["status"] == "done"
    assert table["broken"]["status"].startswith("failed") and "logs/broken.log" in table["broken"]["status"]
    for name in ("rank4", "rank2"):
        assert 0.0 <= float(table[name]["eval_pass@1"]) <= 1.0
        assert -1.0 <= float(table[name]["boxed_answer (mean)"]) <= 1.0
        assert table[name]["steps"] == "1"
    assert table["rank2"]["think_answer_format (mean)"] != "" and table["rank4"]["think_answer_format (mean)"] == ""
    markdown = (out / "summary.md").read_text()
    assert "| rank2 | done |" in markdown and "eval_pass@1" in markdown
    log = (out / "logs" / "broken.log").read_text()
    assert "hub-org/no-such-dataset [train]: cannot be loaded" in log and "Traceback" not in log


def test_rerun_skips_finished_variants(ablation, capsys):
    out, grid, _ = ablation
    before = (out / "rank4" / "run_summary.json").stat().st_mtime
    assert main(["ablate", str(grid), "--only", "rank4", "rank2"]) == 0
    assert "running 0 (skipping 2 already finished)" in capsys.readouterr().out
    assert (out / "rank4" / "run_summary.json").stat().st_mtime == before
    assert read_table(out)["rank4"]["status"] == "done (earlier run)"


def test_a_variant_whose_training_settings_changed_is_stale_not_done(ablation, capsys):
    """A finished variant whose overrides the grid has since changed in a way that alters training is reported
    `stale` (not re-run, its old numbers not shown, exit 1, how to re-run it said); a change that only renames the
    run keeps it done."""
    out, grid, _ = ablation
    raw = yaml.safe_load(grid.read_text())
    raw["variants"] = {"rank4": {"peft.r": 3}, "rank2": {**raw["variants"]["rank2"], "logging.run_name": "renamed"}}
    changed = grid.with_name("changed_grid.yaml")
    changed.write_text(yaml.safe_dump(raw, sort_keys=False))
    before = (out / "rank4" / "run_summary.json").stat().st_mtime
    assert main(["ablate", str(changed), "--only", "rank4", "rank2"]) == 1
    captured = capsys.readouterr()
    assert "running 0 (skipping 1 already finished, 1 stale)" in captured.out
    assert "re-run them with --only rank4 --force" in captured.err
    assert (out / "rank4" / "run_summary.json").stat().st_mtime == before
    table = read_table(out)
    assert table["rank4"]["status"].startswith("stale (ran with other settings: peft.r: 4 -> 3;")
    assert table["rank4"]["eval_pass@1"] == "" and table["rank4"]["overrides"] == "peft.r=3"
    assert table["rank2"]["status"] == "done (earlier run)" and table["rank2"]["eval_pass@1"] != ""


FAKE_LAUNCHER = """
import json, os, sys, time
import yaml

recipe = yaml.safe_load(open(sys.argv[sys.argv.index("train") + 1]))
run_dir = recipe["training"]["output_dir"]
name = os.path.basename(run_dir)
started = time.time()
time.sleep(float(name.split("_")[1]))
with open(os.environ["FAKE_DEVICE_LOG"], "a") as log:
    log.write(json.dumps([name, os.environ["CUDA_VISIBLE_DEVICES"], started, time.time()]) + "\\n")
"""


def test_devices_go_to_variants_only_while_free(tmp_path, tiny_dir, shared_data, monkeypatch):
    """`--parallel 2 --devices 0,1` with a long variant first: the short ones after it take the GPU that is free,
    never the one the long variant still runs on (a fake launcher logs its CUDA_VISIBLE_DEVICES and run time)."""
    import json

    launcher = tmp_path / "fake_launcher.py"
    launcher.write_text(FAKE_LAUNCHER)
    monkeypatch.setenv("FAKE_DEVICE_LOG", str(tmp_path / "devices.log"))
    variants = {"long_2.0": {}, "short_0.3": {}, "next_0.3": {}, "last_0.3": {}}
    grid = write_grid(tmp_path, tiny_dir, shared_data, variants)
    main(["ablate", str(grid), "--parallel", "2", "--devices", "0,1", "--launcher", f"{sys.executable} {launcher}"])
    runs = [json.loads(line) for line in (tmp_path / "devices.log").read_text().splitlines()]
    assert sorted(run[0] for run in runs) == sorted(variants)
    for index, (name, device, start, end) in enumerate(runs):
        for other, other_device, other_start, other_end in runs[index + 1 :]:
            overlap = start < other_end and other_start < end
            assert not (overlap and device == other_device), f"{name} and {other} ran on GPU {device} together"
    assert {run[1] for run in runs} == {"0", "1"}


def test_bad_variant_fails_validation_before_anything_runs(tmp_path, tiny_dir, shared_data, capsys):
    grid = write_grid(tmp_path, tiny_dir, shared_data, {"ok": {}, "typo": {"peft.lora_aplha": 8}})
    assert main(["ablate", str(grid)]) == 2
    err = capsys.readouterr().err
    assert "variants.typo: peft.lora_aplha = 8" in err and "did you mean `lora_alpha`" in err
    assert not (tmp_path / "ablation").exists()


def test_grid_axes_expand_to_the_cartesian_product(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "base": "x.yaml",
                "grid": {
                    "rank": {"r8": {"peft.r": 8}, "r4": {"peft.r": 4}},
                    "gens": {"g2": {}, "g3": {"training.num_generations": 3}},
                },
            },
            sort_keys=False,
        )
    )
    _, variants = load_grid(path)
    assert [v.name for v in variants] == ["r8_g2", "r8_g3", "r4_g2", "r4_g3"]
    assert variants[1].overrides == {"peft.r": 8, "training.num_generations": 3}
    path.write_text(yaml.safe_dump({"base": "x.yaml", "variant": {}}))
    with pytest.raises(RecipeError, match="did you mean `variants`"):
        load_grid(path)


@pytest.mark.parametrize(
    "text, key_path",
    [
        ("variants: {a: 5}", "variants.a = 5: expected a mapping of recipe key paths"),
        ("variants: [a, b]", "variants = ['a', 'b']: expected a mapping of variant names"),
        ("overrides: 3\nvariants: {a: {}}", "overrides = 3: expected a mapping of recipe key paths"),
        ("grid: {rank: [r8, r4]}", "grid.rank = ['r8', 'r4']: expected a mapping of level names"),
        ("grid: {rank: {r8: peft.r}}", "grid.rank.r8 = 'peft.r': expected a mapping of recipe key paths"),
        ("variants: {a: {}}}", "YAML syntax error at line 3"),
    ],
)
def test_malformed_grid_exits_2_naming_the_key(tmp_path, capsys, text, key_path):
    path = tmp_path / "grid.yaml"
    path.write_text(f"base: {TINY_RECIPE}\noutput_dir: {tmp_path / 'ablation'}\n{text}\n")
    assert main(["ablate", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and key_path in err and "Traceback" not in err, err
    assert not (tmp_path / "ablation").exists()


def test_shipped_ablation_grid_validates(capsys):
    grid = str(REPO / "recipes" / "ablations" / "qwen3_0.6b_rewards.yaml")
    assert main(["ablate", grid, "--validate-only", "--no-machine-checks"]) == 0  # a GPU grid (bf16)
    assert "8 variants" in capsys.readouterr().out


def test_a_problem_every_variant_shares_is_listed_once_with_the_right_command(capsys):
    """Issue 30: `ablate --validate-only` on a GPU grid without a GPU said the bf16 problem once per variant and
    pointed to `prorl-trl validate`; now once, for all variants, with the ablate command that checks the grid."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("bf16 is valid on this machine's GPU")
    grid = str(REPO / "recipes" / "ablations" / "qwen3_0.6b_rewards.yaml")
    assert main(["ablate", grid, "--validate-only"]) == 2
    err = capsys.readouterr().err
    assert err.count("training.bf16 = True") == 1 and "(1 problem)" in err, err
    assert f"{grid}: (all 8 variants): training.bf16 = True: needs a CUDA GPU" in err
    hint = "hint: to check a recipe meant for another machine (precision switches not tested here): "
    assert f"{hint}prorl-trl ablate {grid} --validate-only --no-machine-checks" in err
    assert "prorl-trl validate" not in err


# ----------------------------------------------------------------------------------- the output folder (--out)

FINISHING_LAUNCHER = """
import json, os, sys
import yaml

recipe = yaml.safe_load(open(sys.argv[sys.argv.index("train") + 1]))
os.makedirs(recipe["training"]["output_dir"], exist_ok=True)
with open(os.path.join(recipe["training"]["output_dir"], "run_summary.json"), "w") as summary:
    json.dump({"steps": 1, "final_eval": {}, "reward_means": {}}, summary)
"""


def ablate_into(tmp_path, tiny_dir, shared_data, out: Path, *flags: str) -> int:
    """`prorl-trl ablate` of one variant into `out`, each variant "trained" by a launcher that only writes its
    `run_summary.json` (the folder checks come before any training)."""
    grid = write_grid(tmp_path, tiny_dir, shared_data, {"r4": {}})
    raw = yaml.safe_load(grid.read_text())
    grid.write_text(yaml.safe_dump({**raw, "output_dir": str(out)}, sort_keys=False))
    launcher = tmp_path / "finishing_launcher.py"
    launcher.write_text(FINISHING_LAUNCHER)
    return main(["ablate", str(grid), "--launcher", f"{sys.executable} {launcher}", *flags])


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_out_holding_files_the_ablation_would_write_over_is_refused_before_anything(
    tmp_path, tiny_dir, shared_data, capsys
):
    """The review's case: `--out` a folder of the user's with their own `summary.md`, `recipes/r4.yaml` and
    `logs/r4.log`: the ablation wrote its table, recipe and log over them. Now exit 2, nothing changed, even with
    --allow-other-files."""
    out = tmp_path / "project"
    for name in ("summary.md", "recipes/r4.yaml", "logs/r4.log"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(f"my {name}\n")
    before = snapshot(out)
    for flags in ((), ("--allow-other-files",)):
        assert ablate_into(tmp_path, tiny_dir, shared_data, out, *flags) == 2
        err = capsys.readouterr().err
        assert f"{out}/ holds logs/, recipes/, summary.md, named like outputs this run writes" in err, err
        assert "Nothing was changed" in err and "choose another --out" in err
        assert snapshot(out) == before and not (out / "r4").exists()


def test_an_out_holding_other_files_needs_allow_other_files_which_keeps_them(tmp_path, tiny_dir, shared_data, capsys):
    """A folder of other files (`--out .` in a project) is refused before any work, saying how to go on; with
    --allow-other-files the ablation runs among them and they are kept; re-running there needs no flag."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert ablate_into(tmp_path, tiny_dir, shared_data, out) == 2
    err = capsys.readouterr().err
    assert f"{out}/ holds files this run did not write: notes.txt. Nothing was changed." in err, err
    assert "Choose a new or empty --out, or pass --allow-other-files" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert ablate_into(tmp_path, tiny_dir, shared_data, out, "--allow-other-files") == 0
    assert ablate_into(tmp_path, tiny_dir, shared_data, out) == 0
    assert "running 0 (skipping 1 already finished)" in capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "mine"


def test_an_out_holding_a_training_run_a_file_or_home_is_refused_whatever_the_flags(
    tmp_path, tiny_dir, shared_data, capsys, monkeypatch
):
    """An ablation never writes among a training run's outputs (their tables and `recipes/` mixed, and `train
    --overwrite` there deleting the ablation's), into a file's place, or into $HOME."""
    from prorl_trl.trainer.manifest import record_outputs

    run = tmp_path / "run"
    record_outputs(run, ["recipe.yaml", "phase-0/"])
    (run / "recipe.yaml").write_text("x: 1\n")
    file = tmp_path / "a-file"
    file.write_text("mine")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    expected = {
        run: "holds the outputs of `prorl-trl train`", file: "is a file, not a folder", home: "your home folder",
    }  # fmt: skip
    for out, message in expected.items():
        for flags in ((), ("--allow-other-files",)):
            assert ablate_into(tmp_path, tiny_dir, shared_data, out, *flags) == 2
            err = capsys.readouterr().err
            assert message in err and "Nothing was changed" in err, err
    assert sorted(p.name for p in run.iterdir()) == [".prorl_manifest.json", "recipe.yaml"]
    assert file.read_text() == "mine" and list(home.iterdir()) == []


def test_an_ablation_from_before_manifests_is_its_own_folder(tmp_path, tiny_dir, shared_data, capsys):
    """A re-run into an ablation's folder written before manifests skips its finished variants as before (its
    `recipes/<name>.yaml` naming `<out>/<name>` tell it is an ablation's), and records them."""
    from prorl_trl.trainer.manifest import MANIFEST_NAME, manifest_kind, read_manifest

    out = tmp_path / "ablation"
    assert ablate_into(tmp_path, tiny_dir, shared_data, out) == 0
    assert manifest_kind(out) == "ablate"
    assert read_manifest(out) == ["logs/", "r4/", "recipes/", "summary.csv", "summary.md"]
    (out / MANIFEST_NAME).unlink()
    capsys.readouterr()
    assert ablate_into(tmp_path, tiny_dir, shared_data, out) == 0
    assert "running 0 (skipping 1 already finished)" in capsys.readouterr().out
    assert read_manifest(out) == ["logs/", "r4/", "recipes/", "summary.csv", "summary.md"]
