"""`acc-trainer export`: a run's model rebuilt from its config.yaml and written as ONNX, pt2 and safetensors, each
file read back by its own library (onnxruntime, torch.export.load, safetensors) and giving the trained model's
outputs on a batch of another size; a LoRA run's adapters merged; a fit() run's from Python with its model given;
bad input in one line."""

import re
import sys

import pytest
import torch
from conftest import check, one_thread, reset_accelerate, run_here
from safetensors.torch import load_file

SMALL = ("--train-size", "96", "--eval-size", "32", "--batch-size", "32", "--image-size", "8", "--no-plots",
         "--progress", "none")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A built-in model's run, and the same with LoRA adapters on its first layer (2 steps each)."""
    folder = tmp_path_factory.mktemp("export")
    check(run_here("--model", "mlp", "--max-steps", "2", *SMALL, "--output-dir", folder / "plain"))
    check(run_here("--model", "mlp", "--max-steps", "2", *SMALL, "--lora", "2", "--lora-targets", "fc1",
                   "--output-dir", folder / "lora"))
    return folder


def _trained_model_and_inputs(run):
    """The run's model as a user rebuilds it (its config, its factory under its seed) and 3 evaluation images."""
    import acc_trainer
    from acc_trainer.workload.components import build_data, build_model
    from acc_trainer.workload.first_batch import first_samples

    cfg = acc_trainer.parse_config(["--config", str(run / "config.yaml")])
    acc_trainer.set_seed(cfg.seed)
    data = build_data(cfg)
    model = build_model(cfg, data).eval()
    images, _ = first_samples(data.eval, data.kind.eval, 3)
    return model, images


def _largest_difference(stdout: str) -> float:
    return float(re.search(r"by at most (\S+) \(", stdout).group(1))


def test_each_format_is_the_trained_model(runs):
    """Three exports of one run: each prints how far its file's outputs are from PyTorch's on 5 evaluation samples,
    and each file, read back without acc_trainer, gives the trained weights' outputs for a batch of 3."""
    run = runs / "plain"
    model, images = _trained_model_and_inputs(run)
    model.load_state_dict(load_file(run / "model.safetensors"))
    with torch.no_grad():
        expected = model(images)
    for format in ("safetensors", "pt2", "onnx"):
        result = check(run_here("export", run, "--format", format, "--samples", "5"))
        assert f"{run}/export/model.{format}; on 5 evaluation samples" in result.stdout, result.stdout
        assert _largest_difference(result.stdout) <= 1e-5, result.stdout
    assert "(onnxruntime " in result.stdout
    import onnxruntime

    session = onnxruntime.InferenceSession(str(run / "export" / "model.onnx"))
    (onnx_out,) = session.run(None, {session.get_inputs()[0].name: images.numpy()})  # exported for 5: any batch runs
    with one_thread(), torch.no_grad():
        pt2_out = torch.export.load(run / "export" / "model.pt2").module()(images)
    assert torch.allclose(torch.from_numpy(onnx_out), expected, atol=1e-5)
    assert torch.equal(pt2_out, expected)
    # The image's channels, height and width stay the model's (they were symbolic, the channels named '3'); any batch; the
    # output named for what it is (it was the layer's 'linear_2').
    graph = __import__("onnx").load(run / "export" / "model.onnx").graph
    dims = [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    assert isinstance(dims[0], str) and dims[1:] == list(images.shape[1:]), dims
    assert [o.name for o in graph.output] == ["output"]
    exported = load_file(run / "export" / "model.safetensors")
    assert exported.keys() == load_file(run / "model.safetensors").keys()
    model.load_state_dict(exported)
    with torch.no_grad():
        assert torch.equal(model(images), expected)


def test_a_lora_run_is_exported_merged(runs):
    """The adapters folded into the weights: a plain MLP's tensors, giving what the base model with the run's
    adapter (peft's own loader) gives."""
    from peft import PeftModel

    run = runs / "lora"
    result = check(run_here("export", run, "--format", "safetensors"))
    assert "its LoRA adapters merged" in result.stdout
    base, images = _trained_model_and_inputs(run)
    merged = load_file(run / "export" / "model.safetensors")
    assert sorted(merged) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert not torch.equal(merged["fc1.weight"], base.fc1.weight)  # the trained adapter is in it
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, str(run))(images)
        plain, _ = _trained_model_and_inputs(run)
        plain.load_state_dict(merged)
        assert torch.allclose(plain(images), adapted, atol=1e-5)


def test_a_fit_run_exports_from_python_with_its_model_given(tmp_path, torch_on_one_thread):
    """The command line cannot build a fit() run's model: it says how to do it from Python, which works."""
    from torch.utils.data import TensorDataset

    import acc_trainer

    def net():
        acc_trainer.set_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    x = torch.randn(48, 6, generator=torch.Generator().manual_seed(1))
    y = x[:, :3].argmax(1)
    reset_accelerate()
    acc_trainer.fit(net(), TensorDataset(x, y), TensorDataset(x[:12], y[:12]), epochs=1, batch_size=16,
                    progress="none", plots=False, output_dir=str(tmp_path / "fit"))
    refused = run_here("export", tmp_path / "fit", "--format", "pt2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "trained by fit() on objects" in refused.stderr and "acc_trainer.export(" in refused.stderr
    result = acc_trainer.export(tmp_path / "fit", model=net(), data=TensorDataset(x[12:], y[12:]), format="pt2")
    assert result["matches"] and result["samples"] == 8 and result["max_abs_diff"] == 0
    trained = net()
    trained.load_state_dict(load_file(tmp_path / "fit" / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(torch.export.load(result["output"]).module()(x[:2]), trained(x[:2]))


def test_bad_export_input_is_one_line(runs, tmp_path, monkeypatch):
    run = runs / "plain"
    for args, message in ((["export", tmp_path, "--format", "onnx"], "holds no config.yaml"),
                          (["export", run, "--format", "onx"], "invalid choice: 'onx'"),
                          (["export", run, "--format", "onx"], "did you mean onnx?"),
                          (["export", run], "acc-trainer export needs --format onnx|pt2|safetensors")):
        result = run_here(*args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if not installed
    result = run_here("export", run, "--format", "onnx", "--output", tmp_path / "m.onnx")
    assert result.returncode == 2 and "--format onnx needs onnx and onnxscript: pip install" in result.stderr
    assert not (tmp_path / "m.onnx").exists()
