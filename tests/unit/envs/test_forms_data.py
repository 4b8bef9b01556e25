"""Forms data: fresh values per task, disjoint SFT / RL / evaluation sets, identical token spans."""

import random

import pytest

from flowrl_ray.envs.forms.spec import FormCatalog
from flowrl_ray.envs.forms.tasks import (FRESH, SPLITS, VALUE_PART, format_value, fresh_value, gold_actions,
                                         load_tasks, make_task, value_part)

from conftest import REPO


@pytest.fixture(scope="module")
def catalog():
    return FormCatalog.load()


def _free_text(task, catalog):
    """The composed free-text values of a task (names, companies, emails, sentences, ...)."""
    form = catalog[task.form_id]
    out = set()
    for name, value in task.ground_truth_fields.items():
        f = form.field(name)
        if f.type in ("text", "textarea", "email") and not isinstance(f.sample, tuple) \
                and (f.sample in FRESH or f.sample in (None, "email", "full_name", "first_name", "last_name",
                                                         "company", "city")):
            out.add(value)
    return out


def test_each_kind_keeps_its_own_hash_part_of_the_composed_values():
    rng = random.Random(1)
    for kind in ("train", "sft", "heldout_values", "heldout_forms"):
        for src in FRESH:
            assert all(value_part(fresh_value(src, rng, kind)) == VALUE_PART[kind] for _ in range(30)), (kind, src)
    assert VALUE_PART["train"] != VALUE_PART["sft"] != VALUE_PART["heldout_values"] != VALUE_PART["train"]
    assert value_part("Grugrex Prioprion") == value_part("Grugrex Prioprion")    # stable, not hash()


def test_evaluation_values_are_written_with_tokens_sft_answers_write(catalog):
    """Evaluation values are new combinations of the pieces SFT values are made of: with a tokenizer
    trained on the SFT texts, (almost) every token of an evaluation value occurs in an SFT answer, so
    a policy has learned to output it. (When each set composed from its own third of the word
    parts, 40 % of the evaluation values' tokens never occurred in an SFT answer.)"""
    from flowrl_ray.models.text_tokenizer import train_tokenizer
    from flowrl_ray.envs.forms import prompt_text
    sft = load_tasks("sft", per_form=32, catalog=catalog)
    answers = [gold_actions(t, catalog) for t in sft]
    tok = train_tokenizer([prompt_text(t, catalog) for t in sft] + answers, vocab_size=2048)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    written = set().union(*(enc(a) for a in answers))
    values = set().union(*(_free_text(t, catalog) for t in load_tasks("eval", catalog=catalog)))
    tokens = [i for v in values for i in enc(v)]
    assert len(values) > 100
    missing = sum(i not in written for i in tokens) / len(tokens)
    assert missing < 0.02, missing


def test_values_are_fresh_per_task(catalog):
    rng = random.Random(0)
    names = [fresh_value("first_name", rng, "train") for _ in range(500)]
    assert len(set(names)) > 400                 # composed, not drawn from a short list
    sentences = [fresh_value("sentence", rng, "train") for _ in range(200)]
    assert len(set(sentences)) > 150
    companies = [fresh_value("company", rng, "sft") for _ in range(200)]
    assert len(set(companies)) > 180
    tasks = load_tasks("rl", per_form=4, catalog=catalog)
    emails = [v for t in tasks for k, v in t.ground_truth_fields.items() if "@" in str(v)]
    assert emails and len(set(emails)) == len(emails)


def test_splits_are_aliases_and_forms_stay_held_out(catalog):
    assert {"sft", "rl", "eval"} <= set(SPLITS)
    rl = load_tasks("rl", per_form=2, catalog=catalog)
    assert [t.task_id for t in rl] == [t.task_id for t in load_tasks("train", per_form=2, catalog=catalog)]
    sft = load_tasks("sft", per_form=2, catalog=catalog)
    ev = load_tasks("eval", per_form=2, catalog=catalog)
    held = set(catalog.ids(heldout=True))
    assert held and not held & {t.form_id for t in sft + rl}
    assert held <= {t.form_id for t in ev}


def test_sft_rl_eval_share_no_task_and_no_free_text_value(catalog):
    sets = {s: load_tasks(s, per_form=24, catalog=catalog) for s in ("sft", "rl", "eval")}
    ids = {s: {t.task_id for t in ts} for s, ts in sets.items()}
    keys = {s: {(t.form_id, t.instruction) for t in ts} for s, ts in sets.items()}
    values = {s: set().union(*(_free_text(t, catalog) for t in ts)) for s, ts in sets.items()}
    for a, b in (("sft", "rl"), ("sft", "eval"), ("rl", "eval")):
        assert not ids[a] & ids[b]
        assert not keys[a] & keys[b]
        assert values[a] and values[b]
        assert not values[a] & values[b], (a, b, sorted(values[a] & values[b])[:5])


def test_tasks_rebuild_from_seed_and_index(catalog):
    form = catalog[catalog.ids(heldout=False)[0]]
    assert make_task(form, "sft", 3, 7) == make_task(form, "sft", 3, 7)
    assert make_task(form, "sft", 3, 7).ground_truth_fields != make_task(form, "train", 3, 7).ground_truth_fields


def _contains(seq, sub):
    n = len(sub)
    return any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


def test_copied_values_have_identical_token_ids_in_prompt_and_action(catalog, tmp_path):
    from flowrl_ray.models.text_tokenizer import train_tokenizer
    tasks = [t for s in ("sft", "rl", "eval") for t in load_tasks(s, per_form=6, catalog=catalog)]
    texts = [t.instruction for t in tasks] + [gold_actions(t, catalog) for t in tasks]
    tok = train_tokenizer(texts, vocab_size=800)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    seen_types = set()
    for t in tasks:
        form = catalog[t.form_id]
        prompt, target = enc(t.instruction), enc(gold_actions(t, catalog))
        for name, value in t.ground_truth_fields.items():
            f = form.field(name)
            if f.type == "checkbox" and not f.is_group:
                copies = [f.label]
            elif f.is_group:
                copies = list(value)
            else:
                copies = [format_value(f, value), f.label]
            for c in copies:
                ids = enc(c)
                assert tok.decode(ids) == c
                assert _contains(prompt, ids), (t.task_id, c)
                assert _contains(target, ids), (t.task_id, c)
            seen_types.add(f.type)
    assert {"text", "email", "number", "date", "select", "checkbox"} <= seen_types


def test_isolating_pre_tokenizer_splits_context_off(tmp_path):
    from flowrl_ray.models.text_tokenizer import train_tokenizer
    tok = train_tokenizer(["Amara Zielinski. 2024-05-17, \"Amara\" amara@x.com"] * 20, vocab_size=300)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    assert _contains(enc('fill "Name" "Amara"'), enc("Amara"))
    assert _contains(enc("The name is Amara."), enc("Amara"))
    assert len(enc("2024")) == 4                 # one token per digit
    assert tok.decode(enc('a  "b", 12.5')) == 'a  "b", 12.5'


# --------------------------------------------------------------------------- the copy benchmark

def _bench():
    import importlib.util
    path = REPO / "benchmarks" / "forms_sft_copy.py"
    spec = importlib.util.spec_from_file_location("forms_sft_copy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_copy_benchmark_scores_gold_right_and_a_miscopied_value_wrong(catalog):
    bench = _bench()
    tasks = load_tasks("eval", per_form=2, catalog=catalog)
    task = next(t for t in tasks if any(bench.is_free_text(catalog[t.form_id].field(n)) and "@" in str(v)
                                        for n, v in t.ground_truth_fields.items()))
    form = catalog[task.form_id]
    gold = gold_actions(task, catalog)
    scored = bench.score_task(task, form, gold, catalog)
    assert all(r for _, r, _ in scored) and scored[-1][0] == "click"
    email = next(v for v in task.ground_truth_fields.values() if "@" in str(v))
    bad = bench.score_task(task, form, gold.replace(email, email.replace("@", "@x")), catalog)
    assert [k for k, r, _ in bad if not r] == ["fill email"]
    s = bench.summarize([scored, bad], n_boot=200)
    assert s["task_completion"]["all"]["mean"] == 0.5
    n_free = sum(ft for _, _, ft in scored)
    assert s["copy_accuracy"]["mean"] == pytest.approx((2 * n_free - 1) / (2 * n_free))
    assert s["field_accuracy"]["click"] == {"mean": 1.0, "ci_low": 1.0, "ci_high": 1.0, "n": 2}


def test_copy_benchmark_runs_end_to_end_with_a_tiny_model(catalog, tmp_path):
    import json

    from flowrl_ray.models.masked_diffusion import build_masked_lm
    from flowrl_ray.models.text_tokenizer import train_tokenizer
    tasks = load_tasks("sft", per_form=1, catalog=catalog)
    tok = train_tokenizer([t.instruction for t in tasks] + [gold_actions(t, catalog) for t in tasks], 400)
    lm = build_masked_lm({"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                          "max_len": 160, "vocab_size": 400}, tokenizer=tok, seed=0)
    lm.save(tmp_path / "ck")
    res = _bench().main(["--checkpoint", str(tmp_path / "ck"), "--tasks", "12", "--n-boot", "200",
                         "--results-dir", str(tmp_path), "--threads", "1",
                         "algo.gen_length=32", "algo.max_prompt_len=128", "algo.num_generation_steps=4",
                         "algo.model.max_len=160"])
    saved = json.loads((tmp_path / "forms_sft_copy.json").read_text())
    assert saved["tasks"] == res["tasks"] == 12 and "all" in saved["task_completion"]
    assert (tmp_path / "forms_sft_copy.md").read_text().startswith("# Forms SFT model")
    assert set(saved["field_accuracy"]) >= {"click", "all"}


def test_sft_uses_its_own_tasks_and_copy_pairs_quote_their_answer(catalog):
    from flowrl_ray.config import config_from_dict, read_yaml
    from flowrl_ray.envs.forms import prompt_text
    from flowrl_ray.pretrain.text_sft import copy_pairs, sft_pairs
    cfg = config_from_dict(read_yaml(REPO / "configs/flow_grpo/forms_small.yaml"))
    pairs = sft_pairs(cfg.env, tasks_per_form=2)
    sft = {prompt_text(t, catalog) for t in load_tasks("sft", per_form=2, catalog=catalog)}
    rl = {prompt_text(t, catalog) for t in load_tasks("rl", per_form=2, catalog=catalog)}
    assert {p for p, _ in pairs} == sft and not sft & rl
    more = sft_pairs(cfg.env, tasks_per_form=2, copy_aux=0.5)
    assert more[:len(pairs)] == pairs and len(more) == len(pairs) + round(0.5 * len(pairs))
    for prompt, answer in more[len(pairs):]:
        assert f'"{answer}"' in prompt and answer
    assert copy_pairs([], catalog, 5) == []
    with pytest.raises(ValueError, match="copy_aux"):
        sft_pairs(cfg.env, tasks_per_form=1, copy_aux=-1)


def test_copy_probe_scores_tokens_by_position_and_copies_exactly():
    import importlib.util
    path = REPO / "benchmarks" / "forms_copy_probe.py"
    spec = importlib.util.spec_from_file_location("forms_copy_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    outputs, values = ["abc", "axc", "ab", "bcd"], ["abc", "abc", "abcd", "abc"]
    # characters as tokens: 3/3, 2/3 (x at position 1), 2/4 (a short output), 0/3 (shifted by one)
    assert probe.token_accuracy(list, outputs, values) == pytest.approx((1 + 2 / 3 + 2 / 4 + 0) / 4)
    assert probe.exact_copies(outputs, values) == [1.0, 0.0, 0.0, 0.0]
    assert probe.token_accuracy(list, ["", "a"], ["", ""]) == 0.5
    with pytest.raises(ValueError):                                   # outputs and values must pair up
        probe.token_accuracy(list, ["a"], ["a", "b"])
