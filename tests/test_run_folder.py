"""The run folder as a user meets it: a used --output-dir refused before anything slow happens, no lock file left in a
finished run's folder, and the model card of a language model's run."""

from __future__ import annotations

import pytest
import torch

from acc_trainer.config import ConfigError

# A dataset factory that says it was called (built.txt in the current folder): the built-in linear set.
RECORDING_FACTORY = '''
from pathlib import Path
from acc_trainer.data.datasets import DATASETS

def build(config):
    Path("built.txt").write_text("the data was built\\n")
    return DATASETS["linear"](config)
'''
LINREG = ["--model", "linreg", "--train-size", "64", "--eval-size", "32", "--batch-size", "32", "--max-steps", "2",
          "--progress", "none", "--no-plots"]


def test_a_used_output_dir_is_refused_before_the_data_is_built(tmp_path, main_in_process):
    """The refusal of a folder that holds a run comes before the dataset factory is called (it came after the data was
    built: 43 s on a large text set); the same command into a new folder calls it."""
    (tmp_path / "recording_data.py").write_text(RECORDING_FACTORY)
    code, _, stderr = main_in_process(*LINREG, "--dataset", "recording_data:build", "--output-dir", "run")
    assert code == 0 and (tmp_path / "built.txt").is_file(), stderr
    (tmp_path / "built.txt").unlink()
    code, _, stderr = main_in_process(*LINREG, "--dataset", "recording_data:build", "--output-dir", "run")
    assert (code, stderr) == (2, "acc-trainer: error: --output-dir run already holds a run; choose a new folder, or add "
                                 "--resume auto\n")
    assert not (tmp_path / "built.txt").exists()


def test_a_finished_run_leaves_no_lock_file_and_its_folder_is_still_refused(tmp_path):
    import acc_trainer

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    options = {"epochs": 1, "batch_size": 16, "progress": "none", "plots": False, "output_dir": str(tmp_path / "run")}
    acc_trainer.fit(torch.nn.Linear(4, 2), data, data, **options)
    assert not (tmp_path / "run" / ".lock").exists() and (tmp_path / "run" / "summary.json").is_file()
    with pytest.raises(ConfigError, match="already holds a run; choose a new folder"):
        acc_trainer.fit(torch.nn.Linear(4, 2), data, data, **options)
    assert not (tmp_path / "run" / ".lock").exists()


def test_a_run_that_opened_the_lock_file_as_a_finished_run_removed_it_locks_the_one_at_its_name(tmp_path, monkeypatch):
    """The second run opens .lock, the first finishes (removes the file, lets go), then the second takes its lock: a
    lock on the removed file would guard nothing, and a third run would take the folder beside it."""
    from acc_trainer.outputs import runfiles

    folder = tmp_path / "run"
    first = runfiles.RunFiles(folder, enabled=True, lock=runfiles.lock_run_folder(folder, resuming=False))
    first.write_summary({"steps": 1})
    in_use = runfiles._in_use

    def first_ends_meanwhile(where, handle):
        first.release()  # once: the second run's file is open, its lock not yet taken
        monkeypatch.setattr(runfiles, "_in_use", in_use)
        return in_use(where, handle)

    monkeypatch.setattr(runfiles, "_in_use", first_ends_meanwhile)
    second = runfiles.lock_run_folder(folder, resuming=True)  # a resume of the finished run
    try:
        assert (folder / ".lock").is_file()
        with pytest.raises(ConfigError, match="is in use by another run"):
            runfiles.lock_run_folder(folder, resuming=True)
    finally:
        second.close()


def test_the_command_a_model_card_shows_gives_the_runs_options_back():
    import shlex
    from dataclasses import replace

    from acc_trainer.config import make_config
    from acc_trainer.flags import parse_config
    from acc_trainer.outputs.runfiles import command_line

    cfg = make_config({"model": "stdlib_lm:llama", "dataset": "stdlib_lm:documents", "dataset_args": {"max_files": 3},
                       "prompts": ["import os\n", "it's"], "metrics": ["perplexity"], "no_decay_norm_bias": True,
                       "tf32": False, "lr": 0.003, "output_dir": "runs/x"})
    line = command_line(cfg)
    assert line.startswith("acc-trainer --model stdlib_lm:llama --dataset stdlib_lm:documents ") and "--no-tf32" in line
    assert parse_config(shlex.split(line)[1:]) == replace(cfg, output_dir=None)  # where it wrote is not recorded


def _lm_run(folder, **options) -> dict:
    from lm_probe import base_model, documents, pad

    import acc_trainer

    return acc_trainer.fit(base_model(), documents(32, 0), documents(16, 1), collate_fn=pad, batch_size=8, max_steps=2,
                           metrics=["perplexity"], progress="none", plots=False, output_dir=str(folder), **options)


def _sums(folder) -> dict:
    return {name: digest for digest, _, name in (line.partition("  ") for line in
                                                 (folder / "SHA256SUMS").read_text().splitlines())}


def test_a_language_models_run_folder_has_a_model_card(tmp_path):
    """README.md of a transformers model's run: its base, its data, its objective, the command and the final figures,
    listed in the folder's SHA256SUMS with the weights."""
    import hashlib

    summary = _lm_run(tmp_path / "run")
    card = (tmp_path / "run" / "README.md").read_text()
    assert "LlamaForCausalLM" in card and "starting weights: the model's own" in card
    assert "the dataset: `builtins:list`" in card and "training set: 32 samples" in card
    assert "evaluation set: 16 samples" in card
    assert "- `lm`: the model's own loss" in card and "\nacc-trainer --model " in card
    assert "fit() was given objects this command cannot build" in card
    final = summary["eval"]
    assert "- steps: 2, of 8 samples each (16 samples)" in card
    assert f"final evaluation, at step 2, on 16 samples: loss {final['loss']:.4g}, perplexity {final['perplexity']:.4g}" \
        in card
    assert _sums(tmp_path / "run")["README.md"] == hashlib.sha256(card.encode()).hexdigest()


def test_a_lora_runs_card_keeps_peft_s_part_beside_its_own(tmp_path):
    """peft's own card content (its metadata and version, as PeftModel.create_or_update_model_card adds them) and the
    run's sections, in the folder of a LoRA run started from the first run's weights."""
    import peft

    _lm_run(tmp_path / "base")
    summary = _lm_run(tmp_path / "lora", lora=4, init_from=str(tmp_path / "base"))
    card = (tmp_path / "lora" / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: peft" in card and f"- PEFT {peft.__version__}" in card
    assert f"starting weights: `--init-from {tmp_path / 'base'}`" in card and "LoRA adapters of rank 4" in card
    assert f"loss {summary['eval']['loss']:.4g}" in card and "README.md" in _sums(tmp_path / "lora")


def test_a_run_of_a_model_that_is_not_a_language_model_has_no_card(tmp_path):
    import acc_trainer

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    acc_trainer.fit(torch.nn.Linear(4, 2), data, data, epochs=1, batch_size=16, progress="none", plots=False,
                    output_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run" / "README.md").exists()
