"""The scripts in examples/ run and do what they say, at their tiny sizes (each is a user's
starting point; their numbers are not benchmarks)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import encoder_classification  # noqa: E402
import linear_probe  # noqa: E402
import tp_mixer  # noqa: E402
import train_loop  # noqa: E402


def test_custom_training_loop_with_carried_states_learns():
    losses = train_loop.main(steps=6, pieces=3)
    assert losses[-1] < 0.5 * losses[0], losses


def test_mixer_in_a_user_shard_map_with_tp_matches_one_device():
    assert tp_mixer.main(model_size=2) < 1e-5  # float32, sums over tp ranks in another order


def test_linear_probe_reads_token_parity_from_sharded_hidden_states():
    assert linear_probe.main("dp=2,cp=2,tp=2", steps=100) > 0.75  # chance: 0.5


def test_encoder_classifier_trains_on_cpu():
    assert encoder_classification.main(steps=14) > 0.85  # chance: about 0.5
