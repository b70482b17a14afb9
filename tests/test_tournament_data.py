"""A tournament plan (``autopar plan --trainers``) is refused at plan time, with a named error,
for a model file whose data the tournament runtime cannot draw or cut into batches by rows."""

import types
from pathlib import Path

import pytest
import torch

from autopar.errors import AutoparError
from autopar.tournament.pricing import TournamentDataError, TrainersError, check_tournament_data

ROOT = Path(__file__).resolve().parents[1]


def _mf(inputs, targets=lambda n: torch.randn(n), **module):
    return types.SimpleNamespace(name="m", module=types.SimpleNamespace(**module),
                                 example_inputs=inputs, example_targets=targets)


def test_a_batch_of_samples_passes():
    check_tournament_data(_mf(lambda n: (torch.randn(n, 3), torch.zeros(n, dtype=torch.long))), 4, 80)


def test_a_concatenated_graph_batch_is_refused():
    mf = _mf(lambda n: (torch.randn(5 * n, 9), torch.zeros(2, 11 * n, dtype=torch.long)))
    with pytest.raises(TournamentDataError) as e:
        check_tournament_data(mf, 4, 80)
    assert isinstance(e.value, TrainersError) and isinstance(e.value, AutoparError)
    assert "not 4 rows in every input" in str(e.value)


def test_example_inputs_refusing_the_data_set_size_is_named():
    def inputs(n):
        if n != 4:
            raise ValueError("built for 4 per batch")
        return (torch.randn(n, 3),)
    with pytest.raises(TournamentDataError, match=r"example_inputs\(80\), which refuses: ValueError: built for 4"):
        check_tournament_data(_mf(inputs), 4, 80)
    # a model file with its own make_dataset is not asked for example_inputs(n)
    check_tournament_data(_mf(inputs, make_dataset=lambda n, seed: None), 4, 80)


def test_pyg_nnconv_is_refused():
    pytest.importorskip("torch_geometric")
    from autopar.modelfile import load_model_file
    mf = load_model_file(ROOT / "strategies/examples/pyg_nnconv.py")
    with pytest.raises(TournamentDataError, match="PyG batch"):
        check_tournament_data(mf, 8, 160)
