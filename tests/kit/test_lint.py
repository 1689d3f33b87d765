"""``graphrt lint`` (issue 33): one forward under the capture checks names every host sync,
data-dependent shape and baked host value with its module path and the fix; graphrt's own
reference model is clean."""

from __future__ import annotations

import pytest

from graphrt.backends.torch.capture.capture_lint import FIXES
from graphrt.cli import main
from graphrt.cli.lint import lint_model
from support.lint_models import moe_model


def by_kind(report) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in report.findings:
        out.setdefault(f.kind, []).append(f)
    return out


def test_the_planted_router_item_is_named_with_its_module_path():
    report = lint_model(moe_model())
    kinds = by_kind(report)
    sync = [f for f in kinds["host sync"] if f.module == "model.layers.1.mlp.router"]
    assert sync and ".item()" in sync[0].what and sync[0].fix == FIXES["host sync"]
    shapes = {(f.module, f.what.split(" (")[0]) for f in kinds["data-dependent shape"]}
    assert ("model.layers.1.mlp.router", "`torch.bincount`") in shapes
    assert ("model.layers.1.mlp", "`torch.nonzero` / `torch.where(cond)` / `torch.argwhere`") in shapes
    baked = [f for f in kinds["baked host value"] if f.module == "model.layers.0.post_attention_layernorm"]
    assert baked and "on one step" in baked[0].detail
    # nothing is blamed on modules that are capture-safe
    assert {f.module for f in report.findings} <= {"model.layers.1.mlp", "model.layers.1.mlp.router",
                                                    "model.layers.1.mlp.experts.0", "model.layers.1.mlp.experts.1",
                                                    "model.layers.0.post_attention_layernorm", "model.layers.1",
                                                    "model.layers.2", "model.layers.3", "model.norm", "model"}


def test_the_reference_model_is_clean(model_dir):
    from graphrt.models.torch.loader import load_torch_model

    report = lint_model(load_torch_model(model_dir))
    assert report.clean, str(report)
    assert report.num_ops > 100


def test_the_cli_prints_each_finding_and_exits_1(capsys, model_dir):
    assert main(["lint", "support.lint_models:moe_model"]) == 1
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.router: host sync: `.item()`" in out and "fix: keep the value on the device" in out
    assert main(["lint", model_dir]) == 0
    assert "no capture hazards" in capsys.readouterr().out


def test_a_stock_transformers_model_is_linted_by_its_own_forward(model_dir, capsys):
    status = main(["lint", model_dir, "--transformers"])
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out
    assert status in (0, 1) and ("no capture hazards" in out or "fix:" in out)


def test_a_bad_model_spec_is_a_usage_error(capsys):
    assert main(["lint", "no_such_module_xyz:build"]) == 2
    assert "graphrt lint:" in capsys.readouterr().err


# ---- exit status: 0 clean, 1 findings, 2 a usage error in one line (issue 46, item 11) ----------

BROKEN_MODELS = '''
import torch


class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, input_ids=None, use_cache=False):
        raise RuntimeError("boom in forward")


def not_a_model():
    return 42


def raises():
    raise ValueError("no weights here")


def forward_raises():
    return Boom()
'''


@pytest.fixture
def broken(tmp_path):
    path = tmp_path / "broken_models.py"
    path.write_text(BROKEN_MODELS)
    return str(path)


@pytest.mark.parametrize("function, line", [
    ("not_a_model", "graphrt lint: the model builder {spec} returned int (42), not a torch.nn.Module"),
    ("raises", "graphrt lint: the model builder {spec} raised ValueError: no weights here"),
    ("forward_raises", "graphrt lint: one forward of {spec} (Boom) raised RuntimeError: boom in forward"),
    ("no_such_function", "graphrt lint: loading the model '{spec}' raised ConfigError: model: {path} has no "
                         "function 'no_such_function'"),
])
def test_a_model_that_cannot_be_linted_is_a_one_line_usage_error(broken, capsys, function, line):
    """Not a finding (exit 1) and no traceback: exit 2, one line on stderr naming the builder
    and what it returned or raised, nothing on stdout."""
    spec = f"{broken}:{function}"
    assert main(["lint", spec]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [line.format(spec=spec, path=broken)]


def test_a_module_that_fails_to_import_and_a_missing_directory_are_usage_errors(tmp_path, capsys):
    bad = tmp_path / "syntax_error.py"
    bad.write_text("def build(:\n")
    assert main(["lint", f"{bad}:build"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"graphrt lint: loading the model '{bad}:build' raised SyntaxError: ")
    assert main(["lint", str(tmp_path / "nowhere")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"graphrt lint: loading the model directory {tmp_path / 'nowhere'} raised InputError: ")


# ---- file and line; a value carried between forwards (issue 47) ---------------------------------

def test_a_finding_names_the_file_and_line_that_issued_the_op():
    report = lint_model(moe_model())
    sync = next(f for f in report.findings if f.kind == "host sync" and f.module == "model.layers.1.mlp.router")
    path, line, source = sync.where.split(":", 2)
    assert path.endswith("support/lint_models.py") and ".item()" in source, sync.where
    import support.lint_models as planted
    assert ".item()" in open(planted.__file__).read().splitlines()[int(line) - 1]
    assert f"\n    at {sync.where}\n" in str(sync)


def test_a_value_carried_between_forwards_is_a_baked_host_value_at_its_line(capsys):
    """The own mixer keeps the previous forward's token count (tests/support/own_mixer.py): two
    runs back to back see the same carried number; a step of another shape between them makes it
    differ, and the finding names the line that uses it."""
    assert main(["lint", "support.own_mixer:carried_model"]) == 1
    out = capsys.readouterr().out
    assert "layers.0.mixer: baked host value: aten.mul.Tensor" in out, out
    assert "own_mixer.py:" in out and "mix = mix * (1.0 + 0.05 * self._carried)" in out, out
    assert main(["lint", "support.own_mixer:clean_model"]) == 0
    assert "no capture hazards" in capsys.readouterr().out
