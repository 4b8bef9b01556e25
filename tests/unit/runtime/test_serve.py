"""Ray Serve deployment without Ray: request parsing, the action rescaling, a directory that is
not a run refused."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl_ray.config import ConfigError
from flowrl_ray.runtime.serve import BadRequest, parse_request, rescale

OBS_SHAPE = (3,)          # Pendulum-v1: cos, sin, angular velocity

#: (name, raw request body): each must be answered 4xx with {"error": ...}, never 500
BAD_BODIES = [
    ("not json", b"this is not json"),
    ("empty body", b""),
    ("truncated json", b'{"observation": [1, 2'),
    ("invalid utf-8", b"\xff\xfe\x00"),
    ("top-level list", b"[1, 2, 3]"),
    ("no observation key", b'{"obs": [1, 2, 3]}'),
    ("unknown extra key", b'{"observation": [1, 2, 3], "foo": 1}'),
    ("observation null", b'{"observation": null}'),
    ("observation string", b'{"observation": "1,2,3"}'),
    ("observation number", b'{"observation": 1.5}'),
    ("wrong length", b'{"observation": [1, 2]}'),
    ("wrong batch width", b'{"observation": [[1, 2, 3, 4], [1, 2, 3, 4]]}'),
    ("ragged batch", b'{"observation": [[1, 2, 3], [1, 2]]}'),
    ("mixed depth", b'{"observation": [[1, 2, 3], 4]}'),
    ("strings inside", b'{"observation": ["a", 1, 2]}'),
    ("numeric strings", b'{"observation": ["1", "2", "3"]}'),
    ("bools inside", b'{"observation": [true, 1, 2]}'),
    ("null inside", b'{"observation": [null, 1, 2]}'),
    ("dict inside", b'{"observation": [{"x": 1}, 1, 2]}'),
    ("NaN", b'{"observation": [NaN, 1, 2]}'),
    ("Infinity", b'{"observation": [1, Infinity, 2]}'),
    ("-Infinity in batch", b'{"observation": [[1, 2, 3], [1, -Infinity, 2]]}'),
    ("overflows float64", b'{"observation": [1e999, 1, 2]}'),
    ("overflows float32", b'{"observation": [1e39, 1, 2]}'),
    ("huge integer", b'{"observation": [1' + b"0" * 400 + b', 1, 2]}'),
    ("nested too deep", b'{"observation": [[[1, 2, 3]]]}'),
    ("nested very deep", b'{"observation": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    ("empty list", b'{"observation": []}'),
    ("empty inner list", b'{"observation": [[]]}'),
    ("deterministic not bool", b'{"observation": [1, 2, 3], "deterministic": "yes"}'),
]

# --------------------------------------------------------------------------- parsing, no Ray

@pytest.mark.parametrize("name,body", BAD_BODIES, ids=[n for n, _ in BAD_BODIES])
def test_parse_rejects(name, body):
    with pytest.raises(BadRequest) as e:
        parse_request(body, OBS_SHAPE)
    assert 400 <= e.value.status < 500 and str(e.value)


def test_parse_single_and_batch():
    obs, batch, det = parse_request(b'{"observation": [1, 0.5, -2]}', OBS_SHAPE)
    assert obs.shape == (1, 3) and obs.dtype == np.float32 and not batch and det
    obs, batch, det = parse_request(b'{"observation": [[1, 0, 0], [0, 1, 2]], "deterministic": false}',
                                    OBS_SHAPE)
    assert obs.shape == (2, 3) and batch and not det


def test_rescale_matches_env_bounds():
    low, high = np.array([-2.0, 0.0]), np.array([2.0, 10.0])
    out = rescale(np.array([[-1.0, 1.0], [0.0, 0.0], [5.0, -5.0]]), low, high)
    np.testing.assert_allclose(out, [[-2.0, 10.0], [0.0, 5.0], [2.0, 0.0]])


def test_deploy_rejects_a_non_run_dir_before_ray(tmp_path):
    import ray

    from flowrl_ray.runtime.serve import deploy
    with pytest.raises(ConfigError, match="not a run directory"):
        deploy(tmp_path, port=1)
    assert not ray.is_initialized()
