"""The did-you-mean hints of the one-line errors (lopd_lightning.hints): one lookup, two phrasings."""

from __future__ import annotations

from lopd_lightning.hints import choose_one_of, closest, did_you_mean

EMBEDDERS = ("minilm", "backbone", "hashing")


def test_closest_is_difflibs_nearest_name_above_the_cutoff():
    assert closest("hashng", EMBEDDERS) == "hashing"
    assert closest("xyz", EMBEDDERS) is None
    assert closest(16, ["16", "32"]) == "16"  # compared as text
    assert closest("max_step", ["max_steps"], cutoff=0.85) == "max_steps"
    assert closest("max_st", ["max_steps"], cutoff=0.85) is None


def test_choose_one_of_asks_about_the_closest_then_lists_the_choices_in_order():
    assert choose_one_of("hashng", EMBEDDERS) == "did you mean 'hashing'? choose one of minilm, backbone, hashing"
    assert choose_one_of("xyz", EMBEDDERS) == "choose one of minilm, backbone, hashing"


def test_did_you_mean_is_a_suffix_with_a_prefix_or_in_quotes():
    assert did_you_mean("max_stepz", ["max_steps"], prefix="--") == "; did you mean --max_steps?"
    assert did_you_mean("lora_alfa", ["lora_alpha", "r"], quote=True) == "; did you mean 'lora_alpha'?"
    assert did_you_mean("xyz", ["lora_alpha"]) == ""
