"""The notebooks run top to bottom at the small size and draw their figures; the committed copies
carry the outputs of a full run."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
_spec = importlib.util.spec_from_file_location("notebook_runner", NOTEBOOKS / "run.py")
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

# figures each notebook draws: loss_barriers: 2 curves, the plane, the shared-init curves;
# fusion: one bar chart per setting and one for align_many; federated: accuracy and barrier per round
FIGURES = {"loss_barriers.ipynb": 4, "fusion.ipynb": 3, "federated.ipynb": 2}


@pytest.mark.slow  # ~4 min for the three: run by `make test-slow` and CI
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_at_small_size(name, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")  # the kernels train: optimised (conftest)
    out = tmp_path / name
    nb = runner.execute(NOTEBOOKS / name, "small", out)  # raises CellExecutionError on any failing cell
    assert runner.images(nb) == FIGURES[name]
    assert out.is_file() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    parameters = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert parameters[0].source == 'SIZE = "small"'


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_committed_notebook_holds_a_full_run(name):
    nb = runner.nbformat.read(NOTEBOOKS / name, as_version=4)
    parameters = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert [c.source for c in parameters] == ['SIZE = "full"']
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "commit the notebook executed (notebooks/run.py)"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert runner.images(nb) == FIGURES[name]


def test_runner_rejects_a_notebook_without_parameters(tmp_path):
    nb = runner.nbformat.v4.new_notebook()
    nb.cells = [runner.nbformat.v4.new_code_cell("x = 1")]
    path = tmp_path / "plain.ipynb"
    runner.nbformat.write(nb, path)
    with pytest.raises(ValueError, match="one cell tagged 'parameters', found 0"):
        runner.execute(path, "small")
    with pytest.raises(ValueError, match="size='huge'"):
        runner.execute(path, "huge")
