"""benchmarks/forms_packaged_lm_cost.py: the cost of a packaged LM as the masked-diffusion policy,
measured with the project's SFT loss, sampler and step log-probs, beside the small base, on a tiny
GGUF package written by the test."""

import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests/unit/models"))


@pytest.mark.slow
def test_both_models_are_timed_and_the_projection_is_the_formula(tmp_path, monkeypatch):
    import forms_packaged_lm_cost
    from test_packaged_lm import make_package, write_tiny_gguf

    site = tmp_path / "site"
    site.mkdir()
    write_tiny_gguf(make_package(site, "tiny_cost_pkg") / "tiny.gguf")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(REPO)
    out = forms_packaged_lm_cost.main(["--model", "tiny_cost_pkg:tiny.gguf", "--repeats", "1", "--probe-steps", "2",
                                       "--sft-batch", "2", "--episodes", "2", "--threads", "1", "--results-dir", str(tmp_path),
                                       "--output", "cost"])
    data = json.loads((tmp_path / "cost.json").read_text())
    assert data["models"].keys() == out["models"].keys() and len(data["models"]) == 2
    small, tiny = data["models"]["small base (pretrained/forms_small_sft)"], data["models"]["tiny_cost_pkg:tiny.gguf"]
    t, k, e = data["unmasking_steps"], data["steps_per_minibatch"], data["epochs"]
    assert (t, k, e, data["episodes"]) == (48, 8, 2, 2)                # forms_small.yaml's T, K and epochs
    assert small["gen_length"] == 256 and tiny["gen_length"] % 8 == 0
    assert small["sft"].keys() == {"full"} and tiny["sft"].keys() == {"full", "lora"}
    assert 0 < tiny["sft"]["lora"]["trainable_parameters"] < tiny["parameters"]
    for m in (small, tiny):
        assert m["episodes"] == 2
        assert m["unmasking_forward_s"] > 0 and m["logprob_forward_backward_s"] > 0
        assert m["generate_s"] == pytest.approx(t * m["unmasking_forward_s"])
        assert m["update_s"] == pytest.approx(k * m["logprob_forward_s"]
                                              + e * k * (m["logprob_forward_s"] + m["logprob_forward_backward_s"]))
        for s in m["sft"].values():
            assert s["pairs_per_hour"] == pytest.approx(3600 * 2 / s["step_s"])
            assert s["hours_per_base_data_pass"] == pytest.approx(42_000 / s["pairs_per_hour"])
    md = (tmp_path / "cost.md").read_text()
    assert "tiny_cost_pkg:tiny.gguf, SFT lora (r 16" in md and "small base (pretrained/forms_small_sft), SFT full" in md
