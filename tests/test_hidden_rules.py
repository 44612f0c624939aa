"""The hidden-rules task family (issue 33, item 1): seeded generation, a fixed held-out split disjoint from
train, references with full marks (``lopd tasks verify``), documented forms that break every rule kind with
the rule named, format-only SFT references that parse but score 0 (1.0 on the plain tools, which have no
hidden rule and are 20-30% of either split), experience that carries the rule, and malformed replies scored 0
without an exception. Offline, CPU, seconds."""

from __future__ import annotations

import json

import pytest

from lopd_lightning.cli import main
from lopd_lightning.tasks import get_task
from lopd_lightning.tasks.bfcl.calls import parse_tool_calls
from lopd_lightning.tasks.hidden_rules import (
    PLAIN,
    PLAIN_TOOLS,
    RULE_KINDS,
    RULE_TOOLS,
    TOOLS,
    HiddenRulesMultiTurnTask,
    HiddenRulesTask,
    check_calls,
)
from lopd_lightning.tasks.hidden_rules.tools import (
    AUTHENTICATE,
    PLAIN_VARIANT,
    TOOL_KINDS,
    draw_rules,
    expected_calls,
    format_only_calls,
    offsets_changing,
    tool_by_name,
)
from lopd_lightning.tasks.verify import verify_task


@pytest.fixture(scope="module")
def task() -> HiddenRulesTask:
    return get_task("hidden_rules")


def key(example) -> str:
    return json.dumps([example.data["tool"], example.data["args"]], sort_keys=True)


def is_plain(example) -> bool:
    return example.data["plain"]


def rule_fragment(example) -> str:
    """The evidence of the rule in a call: ``"arg": value`` as the reply's JSON writes it (rule tools only)."""
    rule = example.data["rule"]
    assert rule["kind"] != PLAIN, example.id
    call = example.data["expected"][0] if rule["kind"] == "call_first" else example.data["expected"][-1]
    argument = "scope" if rule["kind"] == "call_first" else rule["argument"]
    return f'"{argument}": {json.dumps(call["arguments"][argument])}'


# ----------------------------------------------------------------------- generation and splits
def test_generation_is_deterministic_per_seed(task):
    again = HiddenRulesTask(seed=0)
    for split in ("train", "val"):
        assert [(e.id, e.text, e.data) for e in task.examples(split)] == \
               [(e.id, e.text, e.data) for e in again.examples(split)]
    other = HiddenRulesTask(seed=1)
    assert [e.text for e in other.examples("val")] != [e.text for e in task.examples("val")]
    assert len({json.dumps(HiddenRulesTask(seed=s).rule_table(), sort_keys=True) for s in range(6)}) > 1


def test_heldout_split_is_large_fixed_and_disjoint_from_train(task):
    train, val = task.examples("train"), task.examples("val")
    assert len(val) == 200 >= 150 and len(train) == 600
    assert task.examples("all") == train + val
    assert not {key(e) for e in train} & {key(e) for e in val}
    assert len({key(e) for e in train + val}) == 800 and len({e.id for e in train + val}) == 800
    assert {e.data["tool"] for e in val} == {e.data["tool"] for e in train} == {s.name for s in TOOLS}
    # the held-out split depends on the seed alone: another train size leaves it as it is
    assert [e.data for e in HiddenRulesTask(n_train=50).examples("val")] == [e.data for e in val]
    assert [e.data for e in HiddenRulesTask(n_heldout=150).examples("val")] == [e.data for e in val[:150]]


def test_registry_options_and_refusals(monkeypatch):
    small = get_task("hidden_rules", seed=3, n_train=22, n_heldout=11, references="format_only", show_tools="all")
    assert (len(small.examples("train")), len(small.examples("val"))) == (22, 11)
    system = small.initial_messages(small.examples()[0])[0]["content"]
    assert all(f'"name": "{name}"' in system for name in [s.name for s in TOOLS] + [AUTHENTICATE])
    for bad in ({"n_heldout": 0}, {"references": "none"}, {"show_tools": "some"}, {"system_prompt": "no tools"}):
        with pytest.raises(ValueError):
            HiddenRulesTask(**bad)
    import lopd_lightning.tasks.hidden_rules.task as module

    monkeypatch.setattr(module, "TOOLS", tuple(s for s in TOOLS if s.name == "set_thermostat"))  # 8 rooms x 16 degrees
    assert len(HiddenRulesTask(n_train=100, n_heldout=28).examples("train")) == 100
    with pytest.raises(ValueError, match="only 100 distinct train requests"):
        HiddenRulesTask(n_train=101, n_heldout=28)


def test_the_prompt_is_the_bfcl_one_and_leaves_the_rules_out(task):
    for example in task.examples("train"):
        system, user = task.initial_messages(example)
        assert "<tools>" in system["content"] and "<tool_call>" in system["content"]
        assert user == {"role": "user", "content": example.text}
        shown = system["content"] + user["content"]
        if not is_plain(example):
            assert rule_fragment(example) not in shown


# ----------------------------------------------------------------------- references and verify
def test_every_reference_scores_full_marks_and_verify_passes(task, capsys):
    report = verify_task(task)
    assert report.ok and report.n == 800, report.failures[:5]
    assert main(["tasks", "verify", "hidden_rules"]) == 0
    assert "hidden_rules: 800/800 reference solutions score 1.0" in capsys.readouterr().out
    for seed in (1, 2):
        assert verify_task(HiddenRulesTask(seed=seed, n_train=40, n_heldout=40)).ok


def test_the_documented_forms_break_every_rule_kind_and_the_info_names_it(task):
    kinds = set()
    for example in task.examples("all"):
        score, info = task.score_with_info(example, task.format_only_reply(example))
        rule = example.data["rule"]
        if is_plain(example):  # complete docs: the documented form is the accepted one
            assert score == 1.0 and info == {}, (example.id, info)
            continue
        assert score == 0.0 and info["rule"] == rule["kind"], (example.id, info)
        assert f"hidden rule of {rule['tool']} ({rule['kind']}): {rule['description']}" in info["error"]
        kinds.add(info["rule"])
    assert kinds == set(RULE_KINDS)


@pytest.mark.parametrize("spec", RULE_TOOLS, ids=[s.name for s in RULE_TOOLS])
def test_every_variant_of_every_rule_is_checked(spec):
    """Whatever the seed draws: each variant's calls pass, the documented forms fail naming the rule."""
    import random

    rng = random.Random(0)
    for variant in spec.variants:
        rule = {"tool": spec.name, "kind": spec.kind, "argument": spec.argument, "description": variant.rule}
        for _ in range(20):
            args = spec.draw(rng).args
            good = [{"name": c.name, "arguments": c.arguments} for c in expected_calls(spec, variant, args)]
            assert check_calls(parse_tool_calls(HiddenRulesTask.format_calls(good)), good, rule).valid
            verdict = check_calls(format_only_calls(spec, args), good, rule)
            assert not verdict.valid and verdict.rule == spec.kind and variant.rule in verdict.error


def test_format_only_references_parse_as_calls_and_score_zero_except_on_plain_tools():
    sft = get_task("hidden_rules", references="format_only")
    for example in sft.examples("train"):
        reply = sft.reference_solution(example)
        calls = parse_tool_calls(reply)
        assert calls is not None and calls[-1].name == example.data["tool"]
        assert AUTHENTICATE not in [c.name for c in calls]
        assert sft.reference_replies(example) == [reply]
        if is_plain(example):
            assert sft.score(example, reply) == 1.0 and reply == sft.rule_reply(example)
        else:
            assert sft.score(example, reply) == 0.0
            assert rule_fragment(example) not in reply  # the SFT data never shows a rule
    n_plain = sum(map(is_plain, sft.examples("val")))
    assert verify_task(sft, split="val").n_full_marks == n_plain == 52


# ----------------------------------------------------------------------- plain tools
def test_plain_tools_are_about_a_quarter_of_either_split(task):
    assert len(PLAIN_TOOLS) in (3, 4) and len(RULE_TOOLS) == 11 and TOOLS == RULE_TOOLS + PLAIN_TOOLS
    for split, n in (("train", 600), ("val", 200)):
        examples = task.examples(split)
        plain = [e for e in examples if is_plain(e)]
        assert len(examples) == n and 0.2 <= len(plain) / n <= 0.3, (split, len(plain))
        assert {e.data["tool"] for e in plain} == {s.name for s in PLAIN_TOOLS}
    for seed in (1, 2):
        val = HiddenRulesTask(seed=seed, n_train=40).examples("val")
        assert 0.2 <= sum(map(is_plain, val)) / len(val) <= 0.3


def test_plain_tools_have_complete_docs_and_no_rule(task):
    assert PLAIN not in RULE_KINDS and TOOL_KINDS == (*RULE_KINDS, PLAIN)
    for spec in PLAIN_TOOLS:
        assert spec.plain and spec.kind == PLAIN and spec.argument is None and spec.variants == (PLAIN_VARIANT,)
        params = spec.doc["parameters"]
        assert params["required"] == list(params["properties"])  # nothing "optional" that is in fact required
        assert all(p["description"] for p in params["properties"].values())
    assert not any(spec.plain for spec in RULE_TOOLS)
    for seed in range(4):  # no draw for a plain tool
        assert all(draw_rules(seed)[spec.name] is PLAIN_VARIANT for spec in PLAIN_TOOLS)
    assert {name: row for name, row in task.rule_table().items() if row["kind"] == PLAIN} == {
        spec.name: {"kind": PLAIN, "argument": None, "variant": PLAIN, "description": PLAIN_VARIANT.rule}
        for spec in PLAIN_TOOLS}
    for example in task.examples("all"):
        if is_plain(example):
            assert example.data["expected"] == example.data["format_only"]
            assert example.data["rule"]["kind"] == PLAIN and example.data["rule"]["argument"] is None
            # every enum value the request needs is listed in the doc shown
            doc = example.data["functions"][0]
            for param, value in example.data["args"].items():
                enum = doc["parameters"]["properties"][param].get("enum")
                assert enum is None or value in enum


@pytest.mark.parametrize("spec", PLAIN_TOOLS, ids=[s.name for s in PLAIN_TOOLS])
def test_plain_tools_check_the_request_and_never_report_a_rule(spec):
    import random

    rng = random.Random(0)
    rule = {"tool": spec.name, "kind": spec.kind, "argument": spec.argument, "description": PLAIN_VARIANT.rule}
    texts = set()
    for _ in range(30):
        request = spec.draw(rng)
        texts.add(request.text)
        args = request.args
        good = [{"name": c.name, "arguments": c.arguments} for c in expected_calls(spec, PLAIN_VARIANT, args)]
        assert expected_calls(spec, PLAIN_VARIANT, args) == format_only_calls(spec, args) and len(good) == 1
        assert check_calls(parse_tool_calls(HiddenRulesTask.format_calls(good)), good, rule).valid
        for param in args:  # a wrong or missing argument fails, and names no rule
            wrong = dict(args, **{param: 999 if isinstance(args[param], int) else "zzz"})
            verdict = check_calls(format_only_calls(spec, wrong), good, rule)
            assert not verdict.valid and verdict.rule is None and f"invalid value for {param!r}" in verdict.error
            missing = {k: v for k, v in args.items() if k != param}
            verdict = check_calls(format_only_calls(spec, missing), good, rule)
            assert not verdict.valid and verdict.rule is None and f"missing parameter {param!r}" in verdict.error
            assert "hidden rule" not in verdict.error
    assert len(texts) > 20  # values to transcribe, not one request


def test_plain_requests_state_their_values_in_natural_terms(task):
    weather = [e for e in task.examples("train") if e.data["tool"] == "get_weather"]
    assert any("Fahrenheit" in e.text for e in weather) and any("three days" in e.text for e in weather)
    notes = [e for e in task.examples("train") if e.data["tool"] == "add_calendar_note"]
    assert all(e.data["args"]["date"] not in e.text for e in notes)  # spoken dates; the doc gives YYYY-MM-DD
    contacts = [e for e in task.examples("train") if e.data["tool"] == "lookup_contact"]
    assert any("postal address" in e.text and e.data["args"]["field"] == "address" for e in contacts)
    packages = [e for e in task.examples("train") if e.data["tool"] == "track_package"]
    assert all(e.data["args"]["tracking_number"] in e.text for e in packages)


def test_experience_of_a_train_task_carries_its_rule(task):
    seen = set()
    for example in task.examples("train"):
        episode, messages = task.start(example), list(task.initial_messages(example))
        for reply in task.reference_replies(example):
            messages.append({"role": "assistant", "content": reply})
            messages.extend(episode.step(reply).messages)
        text = task.experience_text(example, messages)
        assert example.text in text
        if is_plain(example):  # the experience of a plain tool is its call, nothing hidden
            assert task.format_only_reply(example) in text
        else:
            assert rule_fragment(example) in text
        seen.add(example.data["rule"]["kind"])
    assert seen == set(TOOL_KINDS)


# ----------------------------------------------------------------------- the checker on other replies
def test_request_errors_are_not_rule_errors_and_values_compare_as_bfcl_does(task):
    flight = next(e for e in task.examples("train") if e.data["tool"] == "book_flight")
    call = flight.data["expected"][0]
    loose = dict(call["arguments"], passenger=call["arguments"]["passenger"].upper())
    assert task.score(flight, HiddenRulesTask.format_calls([{"name": "book_flight", "arguments": loose}])) == 1.0
    wrong = dict(call["arguments"], origin="Nowhere", seat="12A")
    score, info = task.score_with_info(flight, HiddenRulesTask.format_calls([{"name": "book_flight", "arguments": wrong}]))
    assert score == 0.0 and "rule" not in info
    assert "invalid value for 'origin'" in info["error"] and "unexpected parameter 'seat'" in info["error"]
    score, info = task.score_with_info(flight, HiddenRulesTask.format_calls([{"name": "rent_car", "arguments": {}}]))
    assert score == 0.0 and "no call to 'book_flight'" in info["error"]
    meeting = next(e for e in task.examples("train") if e.data["tool"] == "schedule_meeting")
    args = meeting.data["expected"][0]["arguments"]
    as_float = dict(args, duration=float(args["duration"]))
    assert task.score(meeting, HiddenRulesTask.format_calls([{"name": "schedule_meeting", "arguments": as_float}])) == 1.0


def test_call_first_wants_authenticate_first_with_its_scope(task):
    transfer = next(e for e in task.examples("train") if e.data["tool"] == "transfer_funds")
    auth, action = transfer.data["expected"]
    for calls, detail in (([action, auth], "does not come first"),
                          ([{"name": AUTHENTICATE, "arguments": {"scope": "admin"}}, action], "got authenticate(scope='admin')")):
        score, info = task.score_with_info(transfer, HiddenRulesTask.format_calls(calls))
        assert score == 0.0 and info["rule"] == "call_first" and detail in info["error"]
    flight = next(e for e in task.examples("train") if e.data["tool"] == "book_flight")
    extra = [auth, *flight.data["expected"]]
    score, info = task.score_with_info(flight, HiddenRulesTask.format_calls(extra))
    assert score == 0.0 and "unexpected calls" in info["error"]


MALFORMED = [
    "", "   ", "I would book the flight for you.", "<tool_call>", "<tool_call>[", "<tool_call>{not json}</tool_call>",
    "[1, 2]", "null", '{"name": 3}', '<tool_call>[{"name": "book_flight", "arguments": "not json"}]</tool_call>',
    '<tool_call>[{"name": "book_flight", "arguments": [1]}]</tool_call>', "[" * 5000 + "]" * 5000,
    '<tool_call>[{"name": "book_flight", "arguments": {"date": ["x"], "passenger": {"a": 1}}}]</tool_call>',
    '<tool_call>[{"name": "book_flight", "arguments": {"date": NaN, "origin": 1e999, "destination": true}}]</tool_call>',
    '<tool_call>[{"name": "\\ud800", "arguments": {}}]</tool_call>', "book_flight(date=)", "```json\n[]\n```",
    '<tool_call>[]</tool_call>', '<tool_call>[{"name": "authenticate", "arguments": null}]</tool_call>',
]


@pytest.mark.parametrize("reply", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_replies_score_zero_and_never_raise(task, reply):
    for example in task.examples("val")[:len(TOOLS)]:  # one per tool
        score, info = task.score_with_info(example, reply)
        assert score == 0.0 and info["error"]


# ----------------------------------------------------------------------- multi-turn
def test_multi_turn_answers_a_broken_rule_with_the_rule_and_takes_the_retry():
    multi = get_task("hidden_rules_multi_turn", n_train=30, n_heldout=15)
    assert multi.multi_turn and multi.max_turns == 3
    assert verify_task(multi).ok
    for example in multi.examples("val"):
        episode = multi.start(example)
        if is_plain(example):  # no rule: the documented form succeeds at once; a wrong value names no rule
            assert episode.step(multi.format_only_reply(example)).done and episode.reward() == 1.0
            episode = multi.start(example)
            call = example.data["expected"][0]
            wrong = dict(call["arguments"], **{next(iter(call["arguments"])): "zzz"})
            first = episode.step(HiddenRulesTask.format_calls([{"name": call["name"], "arguments": wrong}]))
            assert not first.done and "rule" not in first.info
            assert first.messages[0]["content"].startswith("Error: invalid value for")
            assert "hidden rule" not in first.messages[0]["content"]
            assert episode.step(multi.rule_reply(example)).done and episode.reward() == 1.0
            continue
        first = episode.step(multi.format_only_reply(example))
        assert not first.done and first.info["rule"] == example.data["rule"]["kind"]
        assert first.messages[0]["role"] == "tool"
        assert example.data["rule"]["description"] in first.messages[0]["content"]
        second = episode.step(multi.rule_reply(example))
        assert second.done and episode.reward() == 1.0
    example = multi.examples("val")[0]
    episode = multi.start(example)
    results = [episode.step("no calls") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and episode.reward() == 0.0
    with pytest.raises(RuntimeError):
        episode.step("again")
    with pytest.raises(ValueError):
        HiddenRulesMultiTurnTask(max_attempts=0)
    sft = HiddenRulesMultiTurnTask(n_train=22, n_heldout=11, references="format_only")
    assert sft.reference_replies(example) == [sft.format_only_reply(example)]


# ----------------------------------------------------------------------- the SFT warm start's data
def test_a_config_selects_format_only_references_for_the_sft_warm_start():
    """``data.init_args.task_options.references: format_only``: SFT trains on the call format, not the rules."""
    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules import SFTModule

    dm = OnPolicyDataModule("hidden_rules", task_options={"references": "format_only", "n_train": 30, "n_heldout": 15})
    module = SFTModule("tiny", lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj"]})
    examples = dm.train_examples[:15]
    batch = module.reference_batch(dm.task, examples)
    for messages, example in zip(batch.messages, examples, strict=True):
        assert messages[-1] == {"role": "assistant", "content": dm.task.format_only_reply(example)}
        if not is_plain(example):
            assert rule_fragment(example) not in "".join(m["content"] for m in messages)


# ----------------------------------------------------------------------- rule_offset: other rules, same requests
def test_rule_offset_moves_every_rule_tool_by_its_variant_count_and_keeps_the_requests(task):
    """rule_offset k gives each rule tool variant (seed's index + k) mod n; requests, ids, docs, prompts and
    the format-only replies are the seed's; plain tools are unaffected."""
    for offset in (1, 2, 3, 4, 5, 7):
        other = HiddenRulesTask(rule_offset=offset)
        assert other.rule_offset == offset
        for spec in TOOLS:
            seed_index = spec.variants.index(task.rules[spec.name])
            assert other.rules[spec.name] == spec.variants[(seed_index + offset) % len(spec.variants)]
        for split in ("train", "val"):
            for a, b in zip(task.examples(split), other.examples(split), strict=True):
                assert (a.id, a.text, a.data["tool"], a.data["args"], a.data["functions"]) == \
                       (b.id, b.text, b.data["tool"], b.data["args"], b.data["functions"])
                assert task.initial_messages(a) == other.initial_messages(b)
                assert task.format_only_reply(a) == other.format_only_reply(b)
                changed = offset % len(tool_by_name(a.data["tool"]).variants) != 0
                assert (a.data["rule"] != b.data["rule"]) == changed, (offset, a.id)
                if is_plain(a) or not changed:
                    assert a.data == b.data and not (is_plain(a) and changed)
                elif a.data["expected"] == b.data["expected"]:  # two rules that agree on this request: only
                    labels = {a.data["rule"]["variant"], b.data["rule"]["variant"]}  # DD/MM and MM/DD on day == month
                    assert labels == {"DD/MM/YYYY", "MM/DD/YYYY"}, (offset, a.id, labels)
                    day = a.data["args"][a.data["rule"]["argument"]]
                    assert day[5:7] == day[8:10], (offset, a.id, day)
                else:  # the seed's rule reply breaks the offset environment's rule, and the other way round
                    assert other.score(b, task.rule_reply(a)) == 0.0 == task.score(a, other.rule_reply(b))
    assert draw_rules(0, 0) == draw_rules(0) == task.rules
    assert HiddenRulesTask(rule_offset=12).rules == task.rules  # 12 = lcm(2, 3, 4): every tool back to the seed's
    assert HiddenRulesTask(rule_offset=13).rules == HiddenRulesTask(rule_offset=1).rules


def test_which_offsets_change_every_rule_tool_as_the_docstring_says():
    """Computed from the variant counts: offsets coprime to 6 change every rule tool (1, 5, 7, 11 below 12);
    offsets_changing gives a tool each of its other variants once."""
    import lopd_lightning.tasks.hidden_rules.task as module

    counts = {spec.name: len(spec.variants) for spec in RULE_TOOLS}
    assert sorted(set(counts.values())) == [2, 3, 4]
    every = [k for k in range(12) if all(k % n for n in counts.values())]
    assert every == [1, 5, 7, 11]
    assert "coprime to 6 (1, 5, 7,\n11, ...: not a multiple of 2, 3 or 4)" in module.__doc__
    seed_rules = draw_rules(0)
    for spec in RULE_TOOLS:
        offsets = offsets_changing(spec)
        assert offsets == tuple(range(1, counts[spec.name]))
        variants = [draw_rules(0, k)[spec.name] for k in offsets]
        assert len(set(variants)) == len(variants) and seed_rules[spec.name] not in variants
        assert set(variants) | {seed_rules[spec.name]} == set(spec.variants)
    for spec in PLAIN_TOOLS:
        assert offsets_changing(spec) == () and draw_rules(0, 1)[spec.name] == PLAIN_VARIANT


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5])
def test_verify_gives_full_marks_for_any_rule_offset(offset):
    assert verify_task(HiddenRulesTask(rule_offset=offset, n_train=60, n_heldout=30)).ok
    multi = HiddenRulesMultiTurnTask(rule_offset=offset, n_train=30, n_heldout=15)
    assert multi.rule_offset == offset and verify_task(multi).ok


@pytest.mark.parametrize("bad", [-1, 1.0, "1", True, None])
def test_a_bad_rule_offset_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"^rule_offset must be an int >= 0 .*got"):
        get_task("hidden_rules", rule_offset=bad)


def test_example_category_is_the_tools_rule_kind_and_none_elsewhere(task):
    """hidden_rules' held-out breakdown key: a rule tool's kind, "none" for a plain tool (the rule table's), every
    kind present in the held-out split; a task without categories (toy) answers None."""
    table = task.rule_table()
    heldout = task.examples("val")
    categories = [task.example_category(e) for e in heldout]
    assert categories == [table[e.data["tool"]]["kind"] for e in heldout]
    assert set(categories) == {*RULE_KINDS, PLAIN}
    assert all((c == PLAIN) == is_plain(e) for c, e in zip(categories, heldout))
    toy = get_task("toy")
    assert {toy.example_category(e) for e in toy.examples("val")} == {None}
