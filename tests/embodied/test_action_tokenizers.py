"""Action tokenizers (``loongforge_embodied.action_tokens``): every kind decodes within the bound it states -- on
smooth synthetic chunks and on Meta-World's expert actions -- and the bound is not vacuous; FAST's transform is
SciPy's orthonormal DCT; saved tokenizers give the same ids; malformed ids still decode to a chunk; unknown names are
the registry's one line; ``loongforge fit-action-tokenizer`` reports error, bound and compression."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.fft
from loongforge.registry import UnknownComponentError
from loongforge_embodied.action_tokens import (
    action_chunks,
    fit_action_tokenizer,
    load_action_tokenizer,
    measure_round_trip,
)
from loongforge_embodied.action_tokens.base import TOKENIZER_FILE, ActionTokenizerError
from loongforge_embodied.action_tokens.fast import FIRST_CODE_POINT, dct_matrix

KINDS = ("uniform-bins", "quantile-bins", "fast")
HORIZON, DIMS = 10, 3


def smooth_chunks(count: int, seed: int) -> np.ndarray:
    """(count, HORIZON, DIMS): per dimension a slow sinusoid with a random frequency, phase, amplitude and offset."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 1.0, HORIZON)[None, :, None]
    frequency, phase = rng.uniform(0.1, 0.8, (count, 1, DIMS)), rng.uniform(0, 2 * np.pi, (count, 1, DIMS))
    amplitude, offset = rng.uniform(0.2, 1.5, (count, 1, DIMS)), rng.uniform(-0.5, 0.5, (count, 1, DIMS))
    return amplitude * np.sin(2 * np.pi * frequency * t + phase) + offset


@pytest.fixture(scope="module")
def smooth() -> np.ndarray:
    return smooth_chunks(400, seed=0)


@pytest.fixture(scope="module")
def fitted(smooth) -> dict:
    return {kind: fit_action_tokenizer(kind, smooth) for kind in KINDS}


def reference_bound(kind: str, chunks: np.ndarray, horizon: int) -> np.ndarray:
    """Each kind's bound recomputed from the data, not from the tokenizer: half a uniform bin; half the widest
    quantile bin; FAST's ``0.5 / scale * max_t sum_k |C[k, t]|`` (C from SciPy) times the q01..q99 half-range."""
    values = chunks.reshape(-1, chunks.shape[2])
    if kind == "uniform-bins":
        return (values.max(0) - values.min(0)) / (2 * 256)
    if kind == "quantile-bins":
        return np.diff(np.quantile(values, np.linspace(0, 1, 257), axis=0), axis=0).max(0) / 2
    matrix = scipy.fft.dct(np.eye(horizon), type=2, norm="ortho", axis=0)
    half_range = (np.quantile(values, 0.99, axis=0) - np.quantile(values, 0.01, axis=0)) / 2
    return 0.5 / 10.0 * np.abs(matrix).sum(axis=0).max() * half_range


def test_dct_is_scipys_orthonormal_dct_and_fast_rounds_its_scaled_coefficients(fitted, smooth):
    for horizon in (1, 7, HORIZON):
        x = np.random.default_rng(horizon).normal(size=(horizon, DIMS))
        np.testing.assert_allclose(dct_matrix(horizon) @ x, scipy.fft.dct(x, type=2, norm="ortho", axis=0),
                                   atol=1e-12)
    fast, chunk = fitted["fast"], smooth[5]
    values = smooth.reshape(-1, DIMS)
    low, high = np.quantile(values, 0.01, axis=0), np.quantile(values, 0.99, axis=0)
    normalised = np.clip((chunk - (low + high) / 2) / ((high - low) / 2), -2, 2)
    expected = np.rint(10 * scipy.fft.dct(normalised, type=2, norm="ortho", axis=0))
    np.testing.assert_array_equal(fast.coefficients(chunk), expected)
    # the BPE reads them frequency-major, dimensions interleaved (FAST's order): every DC term first
    read = np.array([ord(char) for char in fast.coefficient_text(chunk)]) - FIRST_CODE_POINT - fast.limit
    np.testing.assert_array_equal(read, expected.reshape(-1))
    # decoding inverts with SciPy's inverse DCT and undoes the normalisation
    decoded = fast.decode(fast.encode(chunk), HORIZON)
    np.testing.assert_allclose(decoded, scipy.fft.idct(expected / 10, type=2, norm="ortho", axis=0)
                               * (high - low) / 2 + (low + high) / 2, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_on_smooth_chunks_is_within_the_stated_bound_and_the_bound_is_tight(kind, fitted, smooth):
    tokenizer = fitted[kind]
    bound = tokenizer.error_bound(HORIZON)
    np.testing.assert_allclose(bound, reference_bound(kind, smooth, HORIZON), rtol=1e-6)
    held_out = smooth_chunks(100, seed=1)
    for chunks in (smooth, held_out):
        trip = measure_round_trip(tokenizer, chunks)
        assert trip.within_bound, (trip.max_error, trip.bound)
        assert (trip.max_error > bound / 4).all(), (trip.max_error, bound)  # the bound is not vacuous
    assert measure_round_trip(tokenizer, smooth).in_range == 1.0
    if kind != "fast":  # each value within half of its own bin, not only of the widest
        for chunk in smooth[:50]:
            ids = np.asarray(tokenizer.encode(chunk)).reshape(HORIZON, DIMS)
            widths = np.take_along_axis(np.diff(tokenizer.edges, axis=1).T, ids, axis=0)
            assert (np.abs(tokenizer.decode(ids.reshape(-1).tolist(), HORIZON) - chunk) <= widths / 2 + 1e-12).all()


def test_fast_compresses_smooth_chunks_and_not_noise(fitted):
    fast = fitted["fast"]
    smooth_trip = measure_round_trip(fast, smooth_chunks(100, seed=2))
    assert smooth_trip.compression > 2.0, smooth_trip.tokens_per_chunk
    noise = np.random.default_rng(3).uniform(-1.0, 1.0, (100, HORIZON, DIMS))
    noise_trip = measure_round_trip(fast, noise)
    assert noise_trip.within_bound
    assert noise_trip.compression < smooth_trip.compression / 2, (noise_trip.compression, smooth_trip.compression)
    for kind in ("uniform-bins", "quantile-bins"):
        assert measure_round_trip(fitted[kind], noise).tokens_per_chunk == HORIZON * DIMS


@pytest.mark.parametrize("kind", KINDS)
def test_saved_tokenizer_loads_as_json_and_gives_the_same_ids(kind, fitted, smooth, tmp_path):
    tokenizer = fitted[kind]
    tokenizer.save(tmp_path)
    assert {path.suffix for path in tmp_path.iterdir()} == {".json"}
    assert json.loads((tmp_path / TOKENIZER_FILE).read_text())["kind"] == kind
    loaded = load_action_tokenizer(tmp_path)
    assert loaded.vocab_size == tokenizer.vocab_size
    for chunk in smooth[:20]:
        ids = tokenizer.encode(chunk)
        assert loaded.encode(chunk) == ids
        np.testing.assert_array_equal(loaded.decode(ids, HORIZON), tokenizer.decode(ids, HORIZON))


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_ids_decode_to_a_chunk_of_the_right_shape(kind, fitted, smooth):
    tokenizer = fitted[kind]
    ids = tokenizer.encode(smooth[0])
    for malformed in ([], ids[:1], ids + ids, [-5, tokenizer.vocab_size + 10, *ids]):
        decoded = tokenizer.decode(malformed, HORIZON)
        assert decoded.shape == (HORIZON, DIMS) and np.isfinite(decoded).all()
    values = smooth.reshape(-1, DIMS)
    empty = tokenizer.decode([], HORIZON)
    if kind == "fast":  # all coefficients zero: every step at the centre of q01..q99
        centre = (np.quantile(values, 0.01, axis=0) + np.quantile(values, 0.99, axis=0)) / 2
        np.testing.assert_allclose(empty, np.broadcast_to(centre, (HORIZON, DIMS)), atol=1e-12)
        # ids outside the vocabulary are dropped, the rest decode as before
        np.testing.assert_allclose(tokenizer.decode([-5, tokenizer.vocab_size, *ids], HORIZON),
                                   tokenizer.decode(ids, HORIZON))
    else:  # the middle bin, and out-of-vocabulary ids clip to the first / last bin
        np.testing.assert_array_equal(empty, np.broadcast_to(tokenizer.centres[:, 128], (HORIZON, DIMS)))
        clipped = tokenizer.decode([-5, 10_000] * (HORIZON * DIMS // 2), HORIZON)
        np.testing.assert_array_equal(clipped[0], [tokenizer.centres[0, 0], tokenizer.centres[1, -1],
                                                   tokenizer.centres[2, 0]])


def test_unknown_names_and_options_are_one_line(smooth, tmp_path):
    with pytest.raises(UnknownComponentError) as caught:
        fit_action_tokenizer("fats", smooth)
    message = str(caught.value)
    assert "\n" not in message and "Known: fast, quantile-bins, uniform-bins." in message
    assert "Did you mean 'fast'?" in message
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps({"kind": "wavelet", "options": {}, "fitted": {}}))
    with pytest.raises(UnknownComponentError, match=f"Unknown action_tokenizer 'wavelet' \\({tmp_path}"):
        load_action_tokenizer(tmp_path)
    with pytest.raises(ActionTokenizerError, match=r"'fast' has no option\(s\) \['bins'\]; its options"):
        fit_action_tokenizer("fast", smooth, bins=8)
    with pytest.raises(ActionTokenizerError, match="vocab_size 50 cannot hold the 129 coefficient values"):
        fit_action_tokenizer("fast", smooth, vocab_size=50)


def test_meta_world_actions_round_trip_within_the_bound_and_the_command_reports_it(metaworld_recorded, tmp_path,
                                                                                    capsys):
    from loongforge.cli import main

    chunks = action_chunks(metaworld_recorded.root, HORIZON)
    lengths = metaworld_recorded.report.lengths
    assert chunks.shape == (sum(length - HORIZON + 1 for length in lengths), HORIZON, 4)
    for kind in KINDS:
        tokenizer = fit_action_tokenizer(kind, chunks)
        trip = measure_round_trip(tokenizer, chunks)
        assert trip.within_bound and trip.in_range == 1.0, (kind, trip.max_error, trip.bound)
        np.testing.assert_allclose(trip.bound, reference_bound(kind, chunks, HORIZON), rtol=1e-6, atol=1e-15)
        moving = trip.bound > 0  # the expert never moves the gripper: its bound and error are 0
        assert (trip.max_error[moving] > trip.bound[moving] / 4).all(), (kind, trip.max_error, trip.bound)
    out = tmp_path / "fast"
    assert main(["fit-action-tokenizer", str(metaworld_recorded.root), "--kind", "fast", "--out", str(out),
                 "--held-out-episodes", "1", "--vocab-size", "256"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "round_trip.json").read_text())
    assert report["within_bound"] and report["measured_episodes"] == [1] and report["compression"] > 2.0, report
    assert f"({report['compression']:.2f}x)" in printed and "within the bound" in printed
    assert load_action_tokenizer(out).vocab_size <= 256
    assert main(["fit-action-tokenizer", str(metaworld_recorded.root), "--kind", "uniform-bins", "--out", str(out),
                 "--held-out-episodes", "2"]) == 2
    assert "--held-out-episodes 2: " in capsys.readouterr().err
