"""Found by a new user: `rotsym align --method activations` on CLIPModel, documented as refused by
name, was answered by the .npz reader first, with a message that contradicted itself (CLIPModel
reads images too) or a TypeError. The dual model's refusal (`Family.data_refusal`) now comes before
its inputs are read."""

import numpy as np
import pytest
from parity_utils import save_reference
from test_dual import DUALS

from rotsym_jax import cli

pytestmark = pytest.mark.usefixtures("float32_models")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    cls, config, *_ = DUALS["clip"]
    save_reference(cls, config(), folder / "a")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 60, size=(8, 9))
    ids[:, -1] = 7  # CLIP's eos
    images = rng.normal(size=(8, 3, 16, 16)).astype(np.float32)
    np.savez(folder / "both.npz", input_ids=ids, attention_mask=np.ones_like(ids), pixel_values=images)
    np.savez(folder / "text.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    return folder


@pytest.mark.parametrize("data", ["both.npz", "text.npz"])
def test_the_command_line_refuses_data_methods_on_clip_by_name(clip, data, capsys):
    a = str(clip / "a")
    with pytest.raises(SystemExit):  # a refusal exits 2 whichever message it gives
        cli.main(["align", a, a, str(clip / f"out_{data}"), "--quiet", "--method", "activations", "--data", str(clip / data)])
    err = capsys.readouterr().err
    assert "from data do not run on it yet" in err, err
